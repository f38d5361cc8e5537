"""Export speed: PyTorch eager vs torch.compile vs ONNX Runtime on the naive and the fused export.

Same inputs (from each model's card data), same thread count (2 by default) for every engine, in one
run; ratios are to PyTorch eager from the same run. The rows are chosen from the registry
(:func:`default_rows`).
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
from unroll.benchmarks.common import machine_info, time_call, trained_models, write_results
from unroll.benchmarks.models_bench import case_inputs, cases_for, torch_call
from unroll.export.onnx_export import _Classifier, _torch_export, io_names, resolve_card

import unroll
from unroll.registry import REGISTRY, get_spec
from unroll.solvers.shrink import textbook_mode

ENGINES = ("pytorch eager", "torch.compile", "onnxruntime naive", "onnxruntime fused")


def default_rows(quick: bool = False) -> list[tuple[str, str, int]]:
    """(model, label, case): the first classifier architecture without weights (a larger network at its own
    input size) and every trained model, both cases each; ``quick``: the trained models' first case only."""
    untrained = [n for n, s in REGISTRY.items() if s.task == "classification" and not s.has_weights][:1]
    untrained = [] if quick else untrained
    rows = []
    for name in untrained + trained_models():
        cases = cases_for(name, quick)
        rows += [(name, label, case) for label, case in (cases[:1] if quick else cases)]
    return rows


def _session(path: str, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def run(threads: int = 2, rows: list | None = None, with_compile: bool = True, budget_s: float = 3.0,
        progress: Callable[[str], None] | None = None, out_dir: Path | None = None) -> dict:
    torch.set_num_threads(threads)
    rows = rows or default_rows()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, label, size in rows:
            spec = get_spec(name)
            model = unroll.load(name, pretrained=spec.has_weights)
            has_lam = spec.card.lam is not None
            module = _Classifier(model).eval() if has_lam else model
            card = resolve_card(spec.card, model, has_lam)  # λ default: the model's trained first-layer λ
            feeds = case_inputs(name, size, card.lam.default if has_lam else None)
            ins, outs, axes = io_names(card, has_lam)
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
                row["timings"]["pytorch eager"] = time_call(torch_call(model, name, feeds), budget_s=budget_s)
                if with_compile:
                    if progress:
                        progress(f"{name} {label}: torch.compile (compiling)")
                    compiled = torch_call(torch.compile(model, dynamic=False), name, feeds)
                    compiled()
                    row["timings"]["torch.compile"] = time_call(compiled, budget_s=budget_s)
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
