"""Measuring one candidate on one case for the GPU check: build it, check its output against the CPU FP32 reference
(the card's gate for its precision), and time it only when it passes.

Why: a refused or failing candidate is a result (a row with the reason), never a crash that ends the run, so
:func:`measure` catches everything, including the budget's alarm when a compile wraps it in its own error.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np

from unroll import tasks
from unroll.benchmarks.gpu_check_cases import CANDIDATES, Case
from unroll.benchmarks.gpu_check_device import time_runner
from unroll.errors import BudgetExceeded, UnknownName
from unroll.metrics import psnr
from unroll.serving.torch_runtime import set_tf32

#: Tolerance when the card's gate names none of the metrics measured here (metric → bound), per precision.
STATED_TOLERANCE = {"fp32": {"rel_err": 1e-4}, "fp16": {"rel_err": 1e-2}}
#: Metrics where larger is better (the others are upper bounds).
AT_LEAST = {"top1_agreement"}


# ----------------------------------------------------------------------------------------------- parity


def parity(case: Case, out: np.ndarray) -> dict[str, float]:
    """Candidate output vs the CPU FP32 reference: max abs, relative L2 error, finiteness and the task metric."""
    ref = case.reference
    d = out.astype(np.float64) - ref.astype(np.float64)
    m: dict[str, float] = {"max_abs": float(np.max(np.abs(d))),
                           "rel_err": float(np.linalg.norm(d) / max(np.linalg.norm(ref), 1e-30)),
                           "finite": float(np.isfinite(out).all())}
    if tasks.get(case.task).data == "noisy":
        loss = psnr(case.truth, ref[0, 0]) - psnr(case.truth, out[0, 0])
        m["psnr_loss_db"] = m["psnr_loss_db_worst"] = float(loss)  # one gate image: mean and worst coincide
    else:
        top_ref, top = ref.argmax(1), out.argmax(1)
        m["top1_agreement"] = float(np.mean(top_ref == top))
        if case.truth is not None:
            m["accuracy_loss"] = float(np.mean(top_ref == case.truth) - np.mean(top == case.truth))
    return m


def gate_check(metrics: dict[str, float], tolerance: dict[str, float]) -> list[str]:
    """The gate's violations (empty: passed); a non-finite output always fails."""
    bad = [] if metrics.get("finite", 1.0) == 1.0 else ["non-finite output"]
    for k, bound in tolerance.items():
        if k not in metrics:
            continue
        v = metrics[k]
        if (v < bound) if k in AT_LEAST else (v > bound):
            bad.append(f"{k} {v:.3g} {'<' if k in AT_LEAST else '>'} {bound:g}")
    return bad


def tolerance_for(case: Case, precision: str) -> tuple[dict[str, float], str]:
    """The card's gate for ``precision`` restricted to the metrics measured here, else the stated tolerance."""
    measured = {"max_abs", "rel_err", "psnr_loss_db", "psnr_loss_db_worst", "top1_agreement", "accuracy_loss"}
    tol = {k: v for k, v in case.gate_of(precision).items() if k in measured}
    return (tol, f"card {precision} gate") if tol else (STATED_TOLERANCE[precision], f"stated {precision} tolerance")


# ----------------------------------------------------------------------------------------------- candidates


def make_runner(cand: str, model: Any, args: tuple, device: str, workdir: Path) -> Callable[[], Any]:
    """A no-argument callable running ``model`` on ``args`` as candidate ``cand`` (builds/compiles first)."""
    import torch

    amp: Callable[[], AbstractContextManager] = nullcontext
    if cand in ("autocast-fp16", "autocast-bf16"):
        dtype = torch.float16 if cand == "autocast-fp16" else torch.bfloat16
        amp = lambda: torch.autocast(device, dtype=dtype)  # noqa: E731
    if cand in ("eager-fp32", "eager-tf32", "autocast-fp16", "autocast-bf16"):
        fn = model
    elif cand in ("compile", "compile-max-autotune"):
        torch._dynamo.reset()
        fn = torch.compile(model, dynamic=False,
                           mode="max-autotune-no-cudagraphs" if cand == "compile-max-autotune" else None)
    elif cand == "aoti":
        import torch._inductor

        package = workdir / f"{id(model)}-{'x'.join(map(str, args[0].shape))}.pt2"
        with torch.no_grad():
            ep = torch.export.export(model, args)
            path = torch._inductor.aoti_compile_and_package(ep, package_path=str(package))
        fn = torch._inductor.aoti_load_package(path)
    else:
        raise UnknownName(f"unknown candidate {cand!r}; known: {', '.join(CANDIDATES)}")

    def run() -> Any:
        with torch.no_grad(), amp():
            return fn(*args)

    return run


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def _budget_ended(e: BaseException) -> bool:
    """Whether ``e`` is, or wraps, the run's :class:`BudgetExceeded` (Inductor re-raises it as its own error)."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, BudgetExceeded):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return f"{BudgetExceeded.__name__}:" in str(e)


def measure(case: Case, cand: str, model: Any, device: str, workdir: Path, warmup: int, repeats: int,
            time_s: float) -> dict:
    """Build, parity-gate and (when it passes) time one candidate on one case; never raises."""
    import torch

    spec = CANDIDATES[cand]
    tol, source = tolerance_for(case, spec.precision)
    row: dict[str, Any] = {"candidate": cand, "precision_gate": spec.precision, "tolerance": tol,
                           "tolerance_source": source}
    args = tuple(a.to(device) for a in case.args)
    try:
        set_tf32(cand == "eager-tf32")
        t = time.perf_counter()
        run = make_runner(cand, model, args, device, workdir)
        out = run()
        if device == "cuda":
            torch.cuda.synchronize()
        row["build_s"] = round(time.perf_counter() - t, 2)
        metrics = parity(case, out.float().cpu().numpy())
        row["parity"] = metrics
        bad = gate_check(metrics, tol)
        if bad:
            row.update(status="refused", reason="; ".join(bad))
            return row
        row.update(status="ok", **time_runner(run, device, warmup, repeats, time_s))
        row["images_per_s"] = case.batch * 1e3 / row["p50_ms"]
    except BudgetExceeded as e:
        row.update(status="skipped", reason=str(e))
    except Exception as e:  # noqa: BLE001 (a failing candidate is a result, not a crash)
        if _budget_ended(e):  # the alarm came inside a compile, which wrapped it (InductorError)
            row.update(status="skipped", reason=_reason(e))
        else:
            row.update(status="error", reason=_reason(e))
    finally:
        set_tf32(False)
    return row
