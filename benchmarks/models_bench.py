"""The engines, one model at a time: PyTorch eager vs torch.compile vs ONNX Runtime FP32 / FP16 / INT8.

Every registered model at a few batch or image sizes, on real inputs from its card's data, with one thread count,
warm-up, median of repeats and ratios to PyTorch eager from the same run; plus the denoiser's latency vs pixel count,
the classifier's throughput vs batch size, and ONNX Runtime's speed per precision beside the quantization reports'
accuracy.

This module runs the CPU benchmark; the inputs and graphs it needs are in :mod:`.models_inputs`, the Markdown in
:mod:`.models_markdown`, and ``--device cuda`` in :mod:`.models_cuda` (:func:`~.models_cuda.run_cuda` runs the GPU
rows that :func:`~.models_cuda.cuda_plan` and a real probe allow, and writes nothing when nothing could be measured).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

import unroll
from unroll import artifacts, tasks
from unroll.benchmarks import plots
from unroll.benchmarks.common import (
    demo_model,
    machine_info,
    ort_session,
    progress_bars,
    quantizable,
    time_call,
    write_results,
)
from unroll.benchmarks.models_inputs import (
    OPENVINO,
    QUANTIZED,
    QUICK,
    case_inputs,
    cases_for,
    ensure_export,
    lam_default,
    noisy_image,
    prepare_run,
    quant_report,
    quantized_graphs,
    torch_call,
)
from unroll.benchmarks.models_markdown import markdown
from unroll.errors import NoModel
from unroll.registry import get_spec
from unroll.serving.runtimes import open_session, unavailable_reason

SCALING_SIDES = (128, 256, 512, 768, 1024)
THROUGHPUT_BATCHES = (1, 4, 16, 64, 256)


def _timed(fn: Callable[[], object], budget_s: float) -> dict:
    """Median of at least 3 repeats after warm-up (1 call for quick budgets, else 2)."""
    return time_call(fn, warmup=1 if budget_s < QUICK["budget_s"] + 1e-9 else 2, min_repeats=3, max_repeats=200,
                     budget_s=budget_s)


def bench_model(name: str, onnx_dir: Path, threads: int, budget_s: float, with_compile: bool, quick: bool,
                status: Callable[[str], None]) -> list[dict]:
    """Rows for one registered model: every case × every engine available."""
    spec = get_spec(name)
    model = unroll.load(name, pretrained=spec.has_weights)
    notes: dict[str, str] = {}
    sessions = {}
    try:
        sessions["fp32"] = ort_session(ensure_export(name, onnx_dir), threads)
    except Exception as e:  # an export that fails is a result to report, not a reason to stop
        notes["onnxruntime fp32"] = f"export failed: {type(e).__name__}: {e}"[:200]
    q, why = quantized_graphs(name, onnx_dir)
    sessions.update({p: ort_session(path, threads) for p, path in q.items()})
    openvino = None
    if "fp32" in sessions:
        skip = unavailable_reason("openvino")
        if skip:
            notes[OPENVINO] = f"skipped: {skip}"
        else:
            try:
                openvino = open_session(ensure_export(name, onnx_dir), "openvino", threads)
            except Exception as e:  # a graph OpenVINO cannot compile is a result too
                notes[OPENVINO] = f"OpenVINO failed: {type(e).__name__}: {e}"[:200]
    lam = lam_default(name, onnx_dir)
    if quantizable(name):  # only these have gate data, so only these can be quantized
        notes.update({f"onnxruntime {p}": w for p, w in why.items()})
    rows = []
    for label, case in cases_for(name, quick):
        feeds = case_inputs(name, case, lam)
        row: dict = {"model": name, "task": spec.task, "case": label, "weights": spec.has_weights, "timings": {},
                     "notes": dict(notes)}
        with torch.inference_mode():
            status(f"{name} {label}: pytorch eager")
            row["timings"]["pytorch eager"] = _timed(torch_call(model, name, feeds), budget_s)
            if with_compile:
                status(f"{name} {label}: torch.compile (compiling)")
                try:
                    compiled = torch.compile(model, dynamic=False)
                    fn = torch_call(compiled, name, feeds)
                    fn()
                    row["timings"]["torch.compile"] = _timed(fn, budget_s)
                except Exception as e:
                    row["notes"]["torch.compile"] = f"{type(e).__name__}: {e}"[:200]
        for p, sess in sessions.items():
            status(f"{name} {label}: onnxruntime {p}")
            names = {i.name for i in sess.get_inputs()}
            np_feeds = {k: v.numpy() for k, v in feeds.items() if k in names}
            row["timings"][f"onnxruntime {p}"] = _timed(partial(sess.run, None, np_feeds), budget_s)
            if p == "fp32" and openvino is not None:
                status(f"{name} {label}: {OPENVINO}")
                ref = sess.run(None, np_feeds)[0]
                row["openvino_max_abs_diff"] = float(np.abs(next(iter(openvino(np_feeds).values())) - ref).max())
                row["timings"][OPENVINO] = _timed(partial(openvino, np_feeds), budget_s)
        eager = row["timings"]["pytorch eager"]["median_ms"]
        row["speedup_vs_eager"] = {k: eager / v["median_ms"] for k, v in row["timings"].items()}
        rows.append(row)
    return rows


def _fit_power_law(pixels: list[int], ms: list[float]) -> dict:
    k, c = np.polyfit(np.log(pixels), np.log(ms), 1)
    return {"exponent": float(k), "log_coef": float(c)}


def scaling(onnx_dir: Path, threads: int, budget_s: float, quick: bool, status: Callable[[str], None]) -> dict:
    """The trained denoiser's latency vs pixels (ONNX Runtime FP32) and the trained classifier's throughput vs
    batch (eager, ORT FP32/INT8). A part whose model the registry lacks is left out, with the reason in ``notes``."""
    out: dict = {}
    notes = {}
    for task, part in ((tasks.DENOISING, _denoiser_scaling), (tasks.CLASSIFICATION, _classifier_scaling)):
        try:
            name = demo_model(task)
        except NoModel as e:
            notes[task] = str(e)
            continue
        out.update(part(name, onnx_dir, threads, budget_s, quick, status))
    return {**out, **({"notes": notes} if notes else {})}


def _denoiser_scaling(name: str, onnx_dir: Path, threads: int, budget_s: float, quick: bool,
                      status: Callable[[str], None]) -> dict:
    sess = ort_session(ensure_export(name, onnx_dir), threads)
    points = []
    for side in (QUICK["scaling_sides"] if quick else SCALING_SIDES):
        status(f"scaling: {name} {side}×{side}")
        feeds = {k: v.numpy() for k, v in noisy_image(name, side).items()}
        t = _timed(partial(sess.run, None, feeds), budget_s)
        points.append({"side": side, "pixels": side * side, **t})
    return {"denoiser": {"onnxruntime fp32": {
        "model": name, "points": points,
        "fit": _fit_power_law([p["pixels"] for p in points], [p["median_ms"] for p in points])}}}


def _classifier_scaling(name: str, onnx_dir: Path, threads: int, budget_s: float, quick: bool,
                        status: Callable[[str], None]) -> dict:
    model = unroll.load(name)
    graphs = {"fp32": ensure_export(name, onnx_dir), **quantized_graphs(name, onnx_dir)[0]}
    lam = lam_default(name, onnx_dir)
    engines: dict[str, Callable[[dict[str, torch.Tensor]], Callable[[], object]]] = {
        "pytorch eager": lambda f: torch_call(model, name, f)}
    for p in ("fp32", "int8"):
        if p in graphs:
            s = ort_session(graphs[p], threads)
            engines[f"onnxruntime {p}"] = lambda f, s=s: partial(s.run, None, {k: v.numpy() for k, v in f.items()})
    out: dict = {"model": name, "engines": {}}
    for engine, make in engines.items():
        pts = []
        for b in (QUICK["throughput_batches"] if quick else THROUGHPUT_BATCHES):
            status(f"scaling: {name} {engine} batch {b}")
            with torch.inference_mode():
                t = _timed(make(case_inputs(name, b, lam)), budget_s)
            pts.append({"batch": b, **t, "images_per_s": b / (t["median_ms"] / 1e3)})
        out["engines"][engine] = pts
    return {"classifier": out}


def _quality(model: str, precision: str, onnx_dir: Path) -> dict | None:
    """Accuracy (classifiers) or PSNR per σ (denoisers) for one precision, from the quantization reports."""
    reports = {p: quant_report(model, p, onnx_dir) for p in QUANTIZED}
    rep = (reports["int8"] or reports["fp16"]) if precision == "fp32" else reports[precision]
    m = (rep or {}).get("metrics") or {}
    fp32 = precision == "fp32"
    if "accuracy" in m:
        return {"accuracy": m["accuracy_fp32"] if fp32 else m["accuracy"],
                "top1_agreement": 1.0 if fp32 else m.get("top1_agreement"), "n": m.get("n")}
    if "per_sigma" in m:
        ps = m["per_sigma"]
        return {"psnr_db": {s: v["psnr_fp32"] if fp32 else v["psnr"] for s, v in ps.items()},
                "psnr_loss_db": {s: 0.0 if fp32 else v["psnr_loss_db"] for s, v in ps.items()}}
    return None


def precision_table(rows: list[dict], onnx_dir: Path) -> list[dict]:
    """ONNX Runtime FP32 vs FP16 vs INT8 speed for the quantizable models, beside their accuracy-gate figures."""
    out = []
    for r in rows:
        if not quantizable(r["model"]) or "onnxruntime fp32" not in r["timings"]:
            continue
        base = r["timings"]["onnxruntime fp32"]["median_ms"]
        for p in ("fp32", *QUANTIZED):
            t = r["timings"].get(f"onnxruntime {p}")
            out.append({"model": r["model"], "case": r["case"], "precision": p,
                        "median_ms": t["median_ms"] if t else None,
                        "speedup_vs_fp32": base / t["median_ms"] if t else None,
                        "note": r["notes"].get(f"onnxruntime {p}"), "quality": _quality(r["model"], p, onnx_dir)})
    return out


def run(models: list[str] | None = None, threads: int = 2, budget_s: float = 1.0, with_compile: bool = False,
        quick: bool = False, onnx_dir: Path = artifacts.ONNX_DIR, progress: bool = True,
        out_dir: Path | None = None, with_scaling: bool = True) -> dict:
    """Benchmark every registered model (or ``models``); write ``models.json|md`` + ``models_scaling.png``."""
    onnx_dir, names, budget_s = prepare_run(models, threads, onnx_dir, budget_s, QUICK["budget_s"] if quick else None)
    rows: list[dict] = []
    with progress_bars(progress) as bars:
        task = bars.add_task("models", total=len(names) + (1 if with_scaling else 0), info="")

        def status(msg: str) -> None:
            bars.update(task, info=msg)

        for name in names:
            rows += bench_model(name, onnx_dir, threads, budget_s, with_compile, quick, status)
            bars.advance(task)
        scal = scaling(onnx_dir, threads, budget_s, quick, status) if with_scaling else {}
        bars.advance(task)
    payload = {"benchmark": "models", "machine": machine_info(threads),
               "config": {"threads": threads, "budget_s": budget_s, "torch_compile": with_compile, "quick": quick,
                          "timing": f"{1 if quick else 2} warm-up call(s), then repeats until the budget (≥ 3): median",
                          "onnx_dir": str(onnx_dir)},
               "rows": rows, "precision": precision_table(rows, onnx_dir), "scaling": scal}
    if out_dir is not None:
        write(payload, Path(out_dir))
    return payload


def write(payload: dict, out_dir: Path) -> list[Path]:
    paths = list(write_results("models", payload, markdown(payload), out_dir))
    if payload.get("scaling"):
        paths += plots.models_plots(payload, out_dir)
    return paths


