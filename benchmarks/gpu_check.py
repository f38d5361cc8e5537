"""The GPU check: every PyTorch runtime the trained models can reach on a CUDA machine, parity-gated, then timed.

Why: a GPU machine is lent rarely and briefly (no TensorRT, no network there), so one run must measure
everything GPU-dependent and leave committable results. For each registered model with committed weights
(denoisers at 256² and 512², σ=25; classifiers at batch 1 and 64) it builds the candidates — PyTorch eager FP32 (TF32
off), eager TF32, FP16/BF16 autocast, ``torch.compile`` (default, then ``max-autotune-no-cudagraphs`` while the
time budget lasts) and AOTInductor (``torch.export`` → ``aoti_compile_and_package`` → ``aoti_load_package``).
Each is first checked against the FP32 CPU PyTorch output on the card's gate data (tolerances from the card's
gate for the candidate's precision; a candidate beyond them is refused, not timed), then timed with CUDA events
(warm-up, then p50/p99). A candidate that fails to build or run is recorded with the reason; the run goes on.

The iteration dial on the GPU: every model whose card serves several iteration counts (``card.iters``: SDNet,
VARS, Dic-Attn, Hamburger) is also run at each served K (:func:`unroll.solvers.iterations.set_iterations`), batch
1 and 64, as eager FP32 and ``torch.compile`` (while its own share of the budget, ``--dial-budget-s``, lasts), each
gated against the CPU FP32 model at the same K and timed beside that CPU model (eager, on this machine's CPU) —
the GPU counterpart of ``unroll bench iters`` (``iterations.md``). It runs first, then the candidates above.

Without CUDA it says why and writes nothing. ``--device cpu`` runs the very same code on the CPU (a dry run
for the tests). Results are rewritten after every candidate, so a run cut short still leaves its rows.

Usage: ``python -m unroll.benchmarks.gpu_check --out DIR`` (or ``scripts/gpu_check.sh``, which runs it from a
checkout without installing it).

This module is the entry point: it runs the parts in order under the time budget. The parts:
:mod:`~unroll.benchmarks.gpu_check_cases` (the candidates, the cases with their inputs and CPU references),
:mod:`~unroll.benchmarks.gpu_check_run` (one candidate on one case: build, parity gate, timing),
:mod:`~unroll.benchmarks.gpu_check_device` (CUDA's presence, the machine, TF32, the timer) and
:mod:`~unroll.benchmarks.gpu_check_report` (the results files, written and read back).
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import unroll
from unroll.benchmarks.common import RESULTS
from unroll.benchmarks.gpu_check_cases import (
    CANDIDATES,
    DIAL_BUDGET_S,
    DIAL_CANDIDATES,
    Case,
    build_cases,
    build_dial_cases,
    trained_models,
)
from unroll.benchmarks.gpu_check_device import cuda_unavailable, machine
from unroll.benchmarks.gpu_check_report import STEM, restore, write
from unroll.benchmarks.gpu_check_run import measure
from unroll.errors import BudgetExceeded
from unroll.serving.torch_runtime import set_tf32
from unroll.solvers.iterations import set_iterations

#: Seconds kept back for ``compile-max-autotune``: it starts only with at least this much of the budget left.
AUTOTUNE_RESERVE_S = 90.0


def run_check(out: Path, device: str = "cuda", models: list[str] | None = None, candidates: list[str] | None = None,
              warmup: int = 20, repeats: int = 300, time_per_candidate_s: float = 2.0, budget_s: float = 420.0,
              quick: bool = False, resume: bool = False, dial_candidates: list[str] | None = None,
              dial_budget_s: float = DIAL_BUDGET_S) -> list[Case] | None:
    """Measure every candidate on every case; ``None`` (nothing written) when ``device`` is cuda and CUDA is absent.

    The iteration dial (:func:`build_dial_cases`, ``dial_candidates``) runs first, for at most ``dial_budget_s`` of
    the ``budget_s`` (0: not at all); then the candidates on the cases. ``resume`` keeps the rows of an earlier run in
    ``out``, and the time it had spent, and measures only the rest; a row that run left unfinished (its process died
    in native code, e.g. a segfault) becomes an error row instead of a retry.
    """
    if device == "cuda":
        why = cuda_unavailable()
        if why:
            print(f"gpu_check: skipped, no CUDA GPU here: {why}. Nothing written.")
            return None

    start = time.perf_counter()
    models = models or trained_models()
    names = candidates or list(CANDIDATES)
    dial_names = list(DIAL_CANDIDATES) if dial_candidates is None else dial_candidates
    unknown = (set(names) | set(dial_names)) - set(CANDIDATES)
    if unknown:
        raise SystemExit(f"unknown candidates {sorted(unknown)}; known: {', '.join(CANDIDATES)}")
    dial_budget_s = min(max(dial_budget_s, 0.0), budget_s) if dial_names else 0.0
    info = machine(device)
    print(f"gpu_check: {info.get('gpu', device)}, torch {info['torch']} (CUDA {info.get('cuda_build')})", flush=True)
    set_tf32(False)
    cases = build_cases(models, quick=quick)
    dial = build_dial_cases(models, quick=quick) if dial_budget_s > 0 else []
    if resume:
        start -= restore(out, cases, dial)
    dev_models = {m: unroll.load(m).to(device) for m in models}
    order = sorted(names, key=lambda n: (CANDIDATES[n].phase, list(CANDIDATES).index(n)))
    dial_order = sorted(dial_names, key=lambda n: (CANDIDATES[n].phase, list(CANDIDATES).index(n)))
    deadline = start + budget_s

    def save() -> None:
        write(out, info, cases, time.perf_counter() - start, budget_s, dial, dial_budget_s)

    def on_alarm(signum: int, frame: object) -> None:
        raise BudgetExceeded(f"the run's time budget ({budget_s:.0f} s) ended while this candidate ran")

    alarm = hasattr(signal, "setitimer")
    if alarm:  # a compile that outlasts the budget is stopped as an error row, not by an outer kill
        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, max(deadline - time.perf_counter(), 0.01))
    try:
        with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
            common = dict(dev_models=dev_models, device=device, save=save, start=start, workdir=Path(tmp),
                          warmup=warmup, repeats=repeats, time_per_candidate_s=time_per_candidate_s)
            if dial:
                _run_all(dial_order, dial, until_s=dial_budget_s,
                         spent=f"the iteration dial's share of the budget ({dial_budget_s:.0f} s) spent", **common)
            _run_all(order, cases, until_s=budget_s, spent=f"time budget ({budget_s:.0f} s) spent", **common)
    except BudgetExceeded:  # the alarm came between candidates: the rows so far stand
        pass
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    elapsed = time.perf_counter() - start
    write(out, info, cases, elapsed, budget_s, dial, dial_budget_s)
    print(f"gpu_check: wrote {out / (STEM + '.json')} and {out / (STEM + '.md')} in {elapsed:.0f} s")
    return cases


def _run_all(order: list[str], cases: list[Case], dev_models: dict, device: str, save: Callable[[], None],
             start: float, until_s: float, spent: str, workdir: Path, warmup: int, repeats: int,
             time_per_candidate_s: float) -> None:
    """Every candidate on every case, phase by phase, while ``until_s`` seconds since ``start`` last (past them a
    row says ``spent``); results rewritten after each (and marked before it). A case with an iteration count
    sets the model's solver layers to it first."""
    import torch

    for cand in order:
        for case in cases:
            if cand in case.rows:  # restored from the run this one resumes
                continue
            left = until_s - (time.perf_counter() - start)
            need = AUTOTUNE_RESERVE_S if cand == "compile-max-autotune" else 0.0
            if left <= need:
                case.rows[cand] = {"candidate": cand, "status": "skipped", "reason": spent}
            else:
                case.rows[cand] = {"candidate": cand, "status": "unfinished",
                                   "reason": "the run was stopped while this candidate built or ran"}
                save()
                model = dev_models[case.model]
                if case.iters is not None:
                    set_iterations(model, case.iters)
                case.rows[cand] = measure(case, cand, model, device, workdir, warmup, repeats, time_per_candidate_s)
            row = case.rows[cand]
            print(f"  {case.model:14s} {case.label:18s} {cand:22s} {row['status']:8s} "
                  + (f"p50 {row['p50_ms']:.3f} ms" if "p50_ms" in row else row.get("reason", "")), flush=True)
            save()
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m unroll.benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=RESULTS, help="results folder (default: benchmarks/results)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (skips with the reason when absent); cpu: a dry run of the same code")
    p.add_argument("--models", default=None, help="comma-separated registered models (default: those with weights)")
    p.add_argument("--candidates", default=",".join(CANDIDATES), help="comma-separated, of: " + ", ".join(CANDIDATES))
    p.add_argument("--dial-candidates", default=",".join(DIAL_CANDIDATES),
                   help="the iteration dial's candidates, comma-separated (empty: no dial)")
    p.add_argument("--dial-budget-s", type=float, default=DIAL_BUDGET_S,
                   help="seconds of --budget-s for the iteration dial, which runs first (0: no dial)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--repeats", type=int, default=300, help="timed calls per candidate (at most)")
    p.add_argument("--time-per-candidate", type=float, default=2.0, help="seconds of timed calls per candidate")
    p.add_argument("--budget-s", type=float, default=420.0, help="whole run; later candidates are skipped past it")
    p.add_argument("--quick", action="store_true", help="one case per model (256², batch 1)")
    p.add_argument("--resume", action="store_true", help="keep the rows already in --out; measure the rest")
    a = p.parse_args(argv)
    run_check(a.out, a.device, [m for m in (a.models or "").split(",") if m], [c for c in a.candidates.split(",") if c],
              a.warmup, a.repeats, a.time_per_candidate, a.budget_s, a.quick, a.resume,
              [c for c in a.dial_candidates.split(",") if c], a.dial_budget_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
