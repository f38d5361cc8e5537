"""Export speed: PyTorch eager vs torch.compile vs ONNX Runtime on the naive and the fused export.

Same inputs, same thread count (2 by default) for every engine, in one run; ratios are to PyTorch
eager from the same run.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import onnx
import onnxruntime as ort
import onnxslim
import torch
from unroll.benchmarks.common import machine_info, time_call, write_results
from unroll.export.inputs import image_batch
from unroll.export.onnx_export import _Classifier, _torch_export, io_names

import unroll
from unroll.registry import get_spec
from unroll.solvers.shrink import textbook_mode

#: (model, label, input builder) — the rows the export issue asks for.
ROWS: list[tuple[str, str, int | tuple[int, int]]] = [
    ("sdnet18-cifar", "batch 1", 1), ("sdnet18-cifar", "batch 32", 32),
    ("csc-denoiser", "256×256", (256, 256)), ("csc-denoiser", "512×512", (512, 512)),
    ("sdnet-mnist", "batch 1", 1), ("sdnet-mnist", "batch 64", 64),
]
ENGINES = ("pytorch eager", "torch.compile", "onnxruntime naive", "onnxruntime fused")


def _inputs(name: str, size: int | tuple[int, int]) -> dict[str, torch.Tensor]:
    spec = get_spec(name)
    if spec.task == "denoising":
        from unroll import data

        img = torch.from_numpy(data.bundled_image("camera"))[None, None]
        img = torch.nn.functional.interpolate(img, size=size, mode="bilinear", antialias=True)
        gen = torch.Generator().manual_seed(0)
        return {"noisy": img + 25 / 255 * torch.randn(img.shape, generator=gen), "sigma": torch.tensor([25 / 255])}
    x = image_batch(spec, size)
    return {"image": x, "lam": torch.full((size,), 0.1)}


def _session(path: str, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def run(threads: int = 2, rows: list | None = None, with_compile: bool = True, budget_s: float = 3.0,
        progress: Callable[[str], None] | None = None, out_dir: Path | None = None) -> dict:
    torch.set_num_threads(threads)
    rows = rows or ROWS
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, label, size in rows:
            spec = get_spec(name)
            model = unroll.load(name, pretrained=spec.has_weights)
            module = _Classifier(model).eval() if spec.task == "classification" else model
            feeds = _inputs(name, size)
            ins, outs, axes = io_names(spec, spec.task == "classification")
            args = tuple(feeds[k] for k in ins)
            paths = {}
            for tag, ctx in (("fused", nullcontext), ("naive", textbook_mode)):
                p = str(Path(tmp) / f"{name}.{tag}.{label.replace(' ', '_')}.onnx")
                with ctx():
                    _torch_export(module, args, p, ins, outs, axes, 17)
                onnx.save(onnxslim.slim(onnx.load(p)), p)
                paths[tag] = p
            row = {"model": name, "case": label, "timings": {}}
            np_feeds = {k: v.numpy() for k, v in feeds.items() if k in ins}
            with torch.inference_mode():
                if progress:
                    progress(f"{name} {label}: pytorch eager")
                row["timings"]["pytorch eager"] = time_call(partial(module, *args), budget_s=budget_s)
                if with_compile:
                    if progress:
                        progress(f"{name} {label}: torch.compile (compiling)")
                    compiled = torch.compile(module, dynamic=False)
                    compiled(*args)
                    row["timings"]["torch.compile"] = time_call(partial(compiled, *args), budget_s=budget_s)
            for tag in ("naive", "fused"):
                if progress:
                    progress(f"{name} {label}: onnxruntime {tag}")
                sess = _session(paths[tag], threads)
                row["timings"][f"onnxruntime {tag}"] = time_call(partial(sess.run, None, np_feeds), budget_s=budget_s)
            eager = row["timings"]["pytorch eager"]["median_ms"]
            row["speedup_vs_eager"] = {k: eager / v["median_ms"] for k, v in row["timings"].items()}
            results.append(row)
    payload = {"benchmark": "export speed", "machine": machine_info(threads), "rows": results,
               "targets": "fused ONNX Runtime ≥ 1.5× PyTorch eager and faster than torch.compile on every row"}
    write_results("export_speed", payload, markdown(payload), out_dir) if out_dir is not None else None
    return payload


def markdown(payload: dict) -> str:
    m = payload["machine"]
    lines = [f"# Export speed ({m['cpu']}, {m['threads_used']} threads, torch {m['versions'].get('torch')}, "
             f"onnxruntime {m['versions'].get('onnxruntime')})", "",
             "Median latency in ms (speed-up vs PyTorch eager in the same run).", "",
             "| model | case | " + " | ".join(ENGINES) + " | fused ≥ 1.5× eager | fused < compile |",
             "|---|---|" + "---|" * (len(ENGINES) + 2)]
    for r in payload["rows"]:
        cells = []
        for e in ENGINES:
            t = r["timings"].get(e)
            cells.append(f"{t['median_ms']:.2f} ({r['speedup_vs_eager'][e]:.2f}×)" if t else "-")
        fused = r["timings"]["onnxruntime fused"]["median_ms"]
        comp = r["timings"].get("torch.compile", {}).get("median_ms")
        ok1 = "yes" if r["speedup_vs_eager"]["onnxruntime fused"] >= 1.5 else "**no**"
        ok2 = "-" if comp is None else ("yes" if fused < comp else "**no**")
        lines.append(f"| {r['model']} | {r['case']} | " + " | ".join(cells) + f" | {ok1} | {ok2} |")
    return "\n".join(lines) + "\n"
