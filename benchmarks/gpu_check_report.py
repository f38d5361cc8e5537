"""The GPU check's results: ``gpu_check.json`` and ``gpu_check.md`` (a table per case, then the iteration dial beside
the CPU model and the committed CPU dial), rewritten whole after every candidate, and read back when a run resumes.

Why apart from the run: these files are both the check's committed evidence and its resume state, so how a row is
written and read back lives in one place, and the entry point (:mod:`unroll.benchmarks.gpu_check`) only decides
what runs when.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from unroll.benchmarks.common import RESULTS
from unroll.benchmarks.gpu_check_cases import BASELINE, CPU_TIMING, DIAL_BUDGET_S, Case
from unroll.benchmarks.gpu_check_run import AT_LEAST, tolerance_for

STEM = "gpu_check"


def speedups(case: Case) -> None:
    base = case.rows.get(BASELINE, {}).get("p50_ms")
    for row in case.rows.values():
        if base and row.get("p50_ms"):
            row["speedup_vs_eager"] = base / row["p50_ms"]


def _num(src: dict, key: str, fmt: str) -> str:
    v = src.get(key)
    return format(v, fmt) if isinstance(v, int | float) else "–"


def markdown(info: dict, cases: list[Case], elapsed_s: float, budget_s: float, dial: list[Case] | None = None,
             dial_budget_s: float = DIAL_BUDGET_S) -> str:
    """The results table per case (candidate, parity, p50/p99, images/s, speed-up vs eager FP32), then the
    iteration dial's tables (when it ran)."""
    lines = ["# GPU check: PyTorch runtimes of the trained models, parity-gated, then timed", "",
             f"Device **{info['device']}**: {info.get('gpu', info.get('cpu', '?'))}"
             + (f", driver {info.get('driver')}" if info.get("driver") else "")
             + f"; torch {info['torch']} (CUDA {info.get('cuda_build')}, cuDNN {info.get('cudnn')}, "
               f"Triton {info.get('triton')}); Python {info['python']}; {info['date_utc']} UTC.",
             f"Wall time {elapsed_s:.0f} s of a {budget_s:.0f} s budget. Written by "
             "`scripts/gpu_check.sh` (`python -m unroll.benchmarks.gpu_check`).", "",
             "Parity: each candidate's output against PyTorch FP32 on the CPU, on the card's gate data; beyond the "
             "tolerance (the card's gate for the candidate's precision: `fp32` for eager FP32, compile and "
             "AOTInductor; `fp16` for TF32, FP16 and BF16) it is refused and not timed. Timing: "
             + ("CUDA events" if info["device"] == "cuda" else "the wall clock")
             + f" around each call after warm-up; images/s = batch / p50; speed-up vs `{BASELINE}` p50.", ""]
    for case in cases:
        tols = "; ".join(f"{p}: " + ", ".join(f"{k} {'≥' if k in AT_LEAST else '≤'} {v:g}"
                                               for k, v in tolerance_for(case, p)[0].items())
                         for p in ("fp32", "fp16"))
        at = f", iters {case.iters}" if case.iters is not None else ""
        lines += [f"## {case.model}, {case.label}{at} ({case.note})", "", f"Tolerances ({tols}).", "",
                  "| candidate | status | max abs | rel err | task metric | p50 ms | p99 ms | images/s | "
                  "speed-up | build s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for cand, row in case.rows.items():
            p = row.get("parity", {})
            task = (f"PSNR loss {p['psnr_loss_db']:+.4f} dB" if "psnr_loss_db" in p else
                    f"top-1 agree {p['top1_agreement']:.3f}" if "top1_agreement" in p else "")

            status = row["status"] if row["status"] == "ok" else f"{row['status']}: {row.get('reason', '')}"
            lines.append(f"| {cand} | {status.replace('|', '/')} | {_num(p, 'max_abs', '.2e')} | "
                         f"{_num(p, 'rel_err', '.2e')} | {task} | {_num(row, 'p50_ms', '.3f')} | "
                         f"{_num(row, 'p99_ms', '.3f')} | {_num(row, 'images_per_s', ',.0f')} | "
                         f"{_num(row, 'speedup_vs_eager', '.2f')} | {_num(row, 'build_s', '.1f')} |")
        lines.append("")
    if dial:
        lines += dial_markdown(info, dial, dial_budget_s)
    return "\n".join(lines)


def cpu_dial_p50() -> tuple[dict[tuple[str, int], float], str]:
    """The committed CPU iteration dial (``unroll bench iters``, ``iterations.json``): gateway p50 ms at batch 1 per
    (model, K), and its machine in words; empty when that file is absent."""
    path = RESULTS / "iterations.json"
    try:
        payload = json.loads(path.read_text())
        m = payload.get("machine", {})
        where = f"{m.get('cpu', '?')}, {m.get('logical_cores', '?')} logical cores"
        return {(name, r["iters"]): float(r["latency_ms"]["p50"])
                for name, model in payload["models"].items() for r in model["counts"]}, where
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}, "absent"


def dial_markdown(info: dict, dial: list[Case], dial_budget_s: float) -> list[str]:
    """The iteration dial's section: per model, per served K and batch, each candidate beside the CPU model."""
    where = "CUDA events" if info["device"] == "cuda" else "the wall clock"
    gateway, gateway_machine = cpu_dial_p50()
    lines = ["## The iteration dial on the " + ("GPU" if info["device"] == "cuda" else info["device"].upper())
             + " (`iters=K`)", "",
             "Each model whose card serves several iteration counts, at every served K (the same weights unrolled "
             "to K steps by `set_iterations`; the trained count is marked *), on the MNIST test digits of the table "
             "above. Parity: the output against PyTorch FP32 on the CPU **at the same K** (the card's `fp32` gate; "
             f"beyond it refused, not timed). Timing: {where} after warm-up, as above; images/s = batch / p50. "
             f"*CPU eager*: that CPU FP32 model timed on this machine's CPU ({info.get('cpu', '?')}, "
             f"{info.get('cpu_threads', '?')} threads; wall clock, up to {CPU_TIMING[1]} calls); ×CPU = CPU eager "
             "p50 / this row's p50. *Gateway p50*: the committed CPU dial "
             "([`iterations.md`](iterations.md), `unroll bench iters`: one digit PNG through the gateway and "
             f"tritonserver on another machine ({gateway_machine}), so the request's overhead is in it), "
             "batch 1 only. "
             f"The dial had {dial_budget_s:.0f} s of the budget; it ran before the candidates above.", ""]
    for model in dict.fromkeys(c.model for c in dial):
        rows = sorted((c for c in dial if c.model == model), key=lambda c: (c.iters, c.batch))
        lines += [f"### {model} ({rows[0].note})", "",
                  "| iters | batch | candidate | status | rel err | top-1 agree | p50 ms | p99 ms | images/s | "
                  "CPU eager p50 ms | CPU eager images/s | ×CPU | gateway p50 ms | build s |",
                  "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for case in rows:
            cpu = case.cpu or {}
            gw = gateway.get((model, case.iters)) if case.batch == 1 else None
            mark = "*" if case.iters == case.trained else ""
            for cand, row in case.rows.items():
                p = row.get("parity", {})
                status = row["status"] if row["status"] == "ok" else f"{row['status']}: {row.get('reason', '')}"
                vs_cpu = cpu["p50_ms"] / row["p50_ms"] if row.get("p50_ms") and cpu.get("p50_ms") else None
                lines.append(f"| {case.iters}{mark} | {case.batch} | {cand} | {status.replace('|', '/')} | "
                             f"{_num(p, 'rel_err', '.2e')} | {_num(p, 'top1_agreement', '.3f')} | "
                             f"{_num(row, 'p50_ms', '.3f')} | {_num(row, 'p99_ms', '.3f')} | "
                             f"{_num(row, 'images_per_s', ',.0f')} | {_num(cpu, 'p50_ms', '.3f')} | "
                             f"{_num(cpu, 'images_per_s', ',.0f')} | {_num({'x': vs_cpu}, 'x', '.1f')} | "
                             f"{_num({'x': gw}, 'x', '.2f')} | {_num(row, 'build_s', '.1f')} |")
        lines.append("")
    return lines


def _finite(obj: Any) -> Any:
    """NaN/inf → ``None`` (strict JSON), recursively."""
    if isinstance(obj, float):
        return obj if np.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def _case_json(c: Case) -> dict:
    d: dict[str, Any] = {"model": c.model, "case": c.label, "batch": c.batch, "inputs": c.note}
    if c.iters is not None:
        d.update(iters=c.iters, trained_iters=c.trained)
    if c.cpu is not None:
        d["cpu_eager_fp32"] = c.cpu
    return {**d, "rows": list(c.rows.values())}


def write(out: Path, info: dict, cases: list[Case], elapsed_s: float, budget_s: float,
          dial: list[Case] | None = None, dial_budget_s: float = DIAL_BUDGET_S) -> None:
    """``out/gpu_check.json`` + ``out/gpu_check.md`` (rewritten after each candidate)."""
    dial = dial or []
    for c in [*cases, *dial]:
        speedups(c)
    payload: dict[str, Any] = {"machine": info, "elapsed_s": round(elapsed_s, 1), "budget_s": budget_s,
                               "cases": [_case_json(c) for c in cases]}
    if dial:
        payload["iterations"] = {"budget_s": dial_budget_s, "cases": [_case_json(c) for c in dial]}
    out.mkdir(parents=True, exist_ok=True)
    for path, text in ((out / f"{STEM}.json", json.dumps(_finite(payload), indent=2, allow_nan=False) + "\n"),
                       (out / f"{STEM}.md", markdown(info, cases, elapsed_s, budget_s, dial, dial_budget_s))):
        tmp = path.with_name(path.name + ".tmp")  # whole files only, should the run be killed mid-write
        tmp.write_text(text)
        tmp.replace(path)


def restore(out: Path, cases: list[Case], dial: list[Case] | None = None) -> float:
    """Rows of the previous run in ``out`` back into ``cases`` (and the iteration dial's into ``dial``); an
    ``unfinished`` row is the candidate that crashed. Returns the seconds that run had spent (0 without one), so a
    resumed run keeps to the one budget."""
    path = out / f"{STEM}.json"
    if not path.exists():
        return 0.0
    payload = json.loads(path.read_text())
    crashed: dict[str, str] = {}
    sections = [(cases, payload["cases"]), (dial or [], payload.get("iterations", {}).get("cases", []))]
    for mine, theirs in sections:
        done = {(c["model"], c["case"]): c["rows"] for c in theirs}
        for case in mine:
            for row in done.get((case.model, case.label), []):
                if row.get("status") == "unfinished":
                    row = {**row, "status": "error", "reason": "the process died while this candidate built or ran "
                           "(a crash in native code; the run's log has the trace)"}
                    crashed[row["candidate"]] = f"{case.model} {case.label}"
                case.rows[row["candidate"]] = row
    for mine, _ in sections:  # a candidate that crashed the process once is not tried again on the other cases
        for case in mine:
            for cand, where in crashed.items():
                case.rows.setdefault(cand, {"candidate": cand, "status": "skipped",
                                            "reason": f"it crashed the process on {where}"})
    return float(payload.get("elapsed_s") or 0.0)

