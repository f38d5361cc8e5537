"""Export speed: PyTorch eager vs torch.compile vs ONNX Runtime on the naive and the fused export.

Same inputs (from each model's card data), same thread count (2 by default) for every engine, in one
run; ratios are to PyTorch eager from the same run. The rows are chosen from the registry
(:func:`default_rows`).

The fused graph also runs on OpenVINO (where installed; the cell says "skipped" otherwise), through the
same :func:`unroll.serving.runtimes.open_session` the server uses, and the outputs of the two runtimes
are compared (max |Δ| per row). "served" is the runtime the model's card names (``cpu_runtime``), which the
CPU target serves; the targets are judged on it, and the row also names the fastest runtime, so a card whose
choice stopped being the faster one shows.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import numpy as np
import onnx
import onnxslim
import torch

import unroll
from unroll import tasks
from unroll.benchmarks.common import load_note, machine_info, time_call, trained_models, write_results
from unroll.benchmarks.models_inputs import case_inputs, cases_for, torch_call
from unroll.errors import BenchError
from unroll.export.onnx_export import _Classifier, _torch_export, io_names, resolve_card
from unroll.registry import REGISTRY, get_spec
from unroll.serving.runtimes import open_session, unavailable_reason
from unroll.solvers.shrink import textbook_mode

ENGINES = ("pytorch eager", "torch.compile", "onnxruntime naive", "onnxruntime fused", "openvino fused")
#: CPU runtimes that run the fused graph (serving/cpu_runtime.py); the card's ``cpu_runtime`` is the "served" one.
FUSED = {"onnxruntime fused": "onnxruntime", "openvino fused": "openvino"}


def default_rows(quick: bool = False) -> list[tuple[str, str, int]]:
    """(model, label, case): the first classifier architecture without weights (a larger network at its own
    input size) and every trained model, both cases each; ``quick``: the trained models' first case only."""
    trained = trained_models()  # (imports the model modules: the registry is filled by then)
    untrained = [n for n, s in REGISTRY.items() if s.task == tasks.CLASSIFICATION and not s.has_weights][:1]
    untrained = [] if quick else untrained
    rows = []
    for name in untrained + trained:
        cases = cases_for(name, quick)
        rows += [(name, label, case) for label, case in (cases[:1] if quick else cases)]
    return rows


def fastest(row: dict) -> str | None:
    """The CPU runtime that ran the fused graph fastest in ``row`` (what a card's ``cpu_runtime`` should name)."""
    times = [(row["timings"][e]["median_ms"], r) for e, r in FUSED.items() if e in row["timings"]]
    return min(times)[1] if times else None


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
            outputs = {}
            for engine, (runtime, tag) in (("onnxruntime naive", ("onnxruntime", "naive")),
                                           *((e, (r, "fused")) for e, r in FUSED.items())):
                why = unavailable_reason(runtime)
                if why:
                    row.setdefault("skipped", {})[engine] = f"skipped: {why}"
                    continue
                if progress:
                    progress(f"{name} {label}: {engine}")
                # OpenVINO as served: static shapes where the card asks for them (serving/cpu_runtime.py)
                static = runtime == "openvino" and spec.card.cpu_static_shapes
                sess = open_session(paths[tag], runtime, threads, static_shapes=static)
                outputs[engine] = next(iter(sess(np_feeds).values()))
                row["timings"][engine] = time_call(partial(sess, np_feeds), budget_s=budget_s)
            if "openvino fused" in outputs:
                row["openvino_max_abs_diff"] = float(np.abs(outputs["openvino fused"]
                                                            - outputs["onnxruntime fused"]).max())
            eager = row["timings"]["pytorch eager"]["median_ms"]
            row["speedup_vs_eager"] = {k: eager / v["median_ms"] for k, v in row["timings"].items()}
            runtime = spec.card.cpu_runtime  # what the CPU target serves (the card's choice)
            engine = next(e for e, r in FUSED.items() if r == runtime)
            if engine not in row["timings"]:
                raise BenchError(f"{name}'s card serves with {runtime}, which cannot run here: "
                                   f"{row['skipped'][engine]}")
            row["served"] = {"engine": engine, "runtime": runtime, "median_ms": row["timings"][engine]["median_ms"],
                             "speedup_vs_eager": eager / row["timings"][engine]["median_ms"], "fastest": fastest(row)}
            results.append(row)
    payload = {"benchmark": "export speed", "machine": machine_info(threads), "rows": results,
               "targets": "the served fused graph (the card's CPU runtime) ≥ 1.5× PyTorch eager and faster than "
                          "torch.compile on every row"}
    write_results("export_speed", payload, markdown(payload), out_dir) if out_dir is not None else None
    return payload


def markdown(payload: dict) -> str:
    m = payload["machine"]
    ov = m["versions"].get("openvino")
    lines = [f"# Export speed ({m['cpu']}, {m['threads_used']} threads, torch {m['versions'].get('torch')}, "
             f"onnxruntime {m['versions'].get('onnxruntime')}, openvino {ov or 'not installed'})", "",
             "Median latency in ms (speed-up vs PyTorch eager in the same run). \"served\": the CPU runtime the "
             "model's card names (`cpu_runtime`), the one `unroll serve` runs; the targets are judged on it (a runtime "
             "in *italics* after it ran this row faster). "
             "OpenVINO runs with static shapes where the card asks for them (`cpu_static_shapes`), as served. "
             "max |Δ|: OpenVINO's output vs ONNX Runtime's on the same fused graph. " + load_note(m), "",
             "| model | case | " + " | ".join(ENGINES) + " | served | max \\|Δ\\| | served ≥ 1.5× eager "
             "| served < compile |",
             "|---|---|" + "---|" * (len(ENGINES) + 4)]
    for r in payload["rows"]:
        cells = []
        for e in ENGINES:
            t = r["timings"].get(e)
            cells.append(f"{t['median_ms']:.2f} ({r['speedup_vs_eager'][e]:.2f}×)" if t
                         else r.get("skipped", {}).get(e, "-"))
        best = r.get("served") or {"engine": "onnxruntime fused", "runtime": "onnxruntime",
                                   "median_ms": r["timings"]["onnxruntime fused"]["median_ms"],
                                   "speedup_vs_eager": r["speedup_vs_eager"]["onnxruntime fused"]}
        comp = r["timings"].get("torch.compile", {}).get("median_ms")
        ok1 = "yes" if best["speedup_vs_eager"] >= 1.5 else "**no**"
        ok2 = "-" if comp is None else ("yes" if best["median_ms"] < comp else "**no**")
        diff = r.get("openvino_max_abs_diff")
        name = best["runtime"] if best.get("fastest", best["runtime"]) == best["runtime"] else \
            f"{best['runtime']} (*{best['fastest']}*)"
        lines.append(f"| {r['model']} | {r['case']} | " + " | ".join(cells) + f" | {name} | "
                     + ("-" if diff is None else f"{diff:.1e}") + f" | {ok1} | {ok2} |")
    return "\n".join(lines) + "\n"
