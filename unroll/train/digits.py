"""Recipe of the small digit classifiers (:mod:`unroll.models.digits`): one recipe for all, so they compare.

The SDNet recipe's training loop (:func:`unroll.train.mnist.fit_digits`: AdamW, one-cycle, ±2 px shifts, label
smoothing, seeded) on the same split (``unroll.data.mnist_roles``: 3,500 train / 500 validation / 1,000 test digits).
Every choice is made on the validation digits: the weights kept are those of the epoch with the best validation
accuracy (ties: the later epoch), and the recipe's epochs and learning rate were picked on validation accuracy;
the test digits are only reported. Models with weight-tied solver layers are also measured at every iteration
count their card serves (``card.iters``). The recipe interface is :mod:`unroll.train`'s.
"""

from __future__ import annotations

import copy
import os
import time

import torch

from unroll import data
from unroll.evaluation import accuracy
from unroll.models.dic_vit import refresh_dic
from unroll.models.digits import parameter_count
from unroll.registry import get_spec
from unroll.solvers.iterations import iteration_count, set_iterations
from unroll.train import Evaluation, Option, ProgressFactory, Table, TrainRun, counted, slice_option
from unroll.train.mnist import fit_digits

EPOCHS, LR = 30, 4e-3
#: How EPOCHS and LR were chosen, on the two baselines (the softmax ViT, the plain CNN): their records from
#: ``unroll train NAME --out DIR --lr LR [--epochs 20]`` (seed 0, this recipe otherwise) are in PILOT_DIR, one per
#: setting, each with its best-epoch validation accuracy; the solver models train with the setting chosen there (one
#: recipe for all, so that they compare).
PILOT = {"records": "benchmarks/results/digits_pilot/NAME-LR[-e20].json (unroll train NAME --lr LR [--epochs 20])",
         "settings": {"lr": [1e-3, 2e-3, 4e-3, 8e-3], "epochs": [20, 30]},
         "choice": "lr 4e-3 and 30 epochs: the best validation accuracy of both baselines; where 4e-3 and 8e-3 tie, "
                   "the smaller is kept for the solver layers, which the baselines do not have"}
#: One thread: the weights do not depend on the machine's core count, and on a shared CPU a second thread spends
#: more time waiting for its partner (spinning) than it saves.
THREADS = 1
SELECTION = ("weights of the epoch with the best validation accuracy (ties: the later epoch); the recipe's epochs "
             "and learning rate were chosen on validation accuracy (pilot); the test digits are reported only")


#: The fixed slice of ``unroll eval NAME --slice``: the first digits of the validation and of the test split.
SLICE = {"validation": 100, "test": 100}
SLICE_DESCRIPTION = f"the first {SLICE['validation']} validation and {SLICE['test']} test digits, every iteration count"


def _roles(first: dict[str, int] | None = None) -> dict[str, tuple[torch.Tensor, object]]:
    """The validation and test digits (``first``: only the first of each, e.g. :data:`SLICE`)."""
    out = {}
    for role, (x, y) in data.mnist_roles().items():
        if role != "train":
            n = len(y) if first is None else first[role]
            out[role] = (torch.from_numpy(x[:n]), y[:n])
    return out


def _ready(model: torch.nn.Module) -> torch.nn.Module:
    """Eval mode with state derived from the weights up to date (Dic-Attn's normalised atoms and ``L``)."""
    refresh_dic(model)
    return model.eval()


# ---------------------------------------------------------------------------------------------- recipe interface

TRAIN_OPTIONS = (Option("epochs", EPOCHS,
                        f"training epochs over the {data.MNIST_TRAIN - data.MNIST_VALIDATION:,} training digits"),
                 Option("lr", LR, "peak learning rate of the one-cycle schedule"),
                 Option("threads", THREADS, "PyTorch threads while training: the same number gives the same weights "
                                            "on any machine (float sums split across threads round differently)"))
EVAL_OPTIONS = (slice_option(SLICE_DESCRIPTION),)


def train(run: TrainRun, epochs: int = EPOCHS, lr: float = LR, threads: int = THREADS) -> tuple[torch.nn.Module, dict]:
    """Train (CPU, ``threads`` threads) keeping the best-validation epoch's weights, then measure (unless
    ``run.metrics`` is false)."""
    spec = get_spec(run.name)
    xva, yva = _roles()["validation"]
    curve: list[float] = []
    best: dict = {}

    def after_epoch(model: torch.nn.Module, epoch: int) -> None:
        acc = accuracy(_ready(model), xva, yva)
        model.train()
        curve.append(acc)
        if acc >= best.get("accuracy", -1.0):
            best.update(accuracy=acc, epoch=epoch, state=copy.deepcopy(model.state_dict()))

    before, load, cpu = torch.get_num_threads(), os.getloadavg()[0], time.process_time()
    torch.set_num_threads(threads)
    try:
        with run.progress(f"training {run.name}", 1) as update:
            model, recipe = fit_digits(lambda: spec.builder(**spec.defaults), epochs, lr=lr, seed=run.seed,
                                       max_steps=run.steps, progress=update, after_epoch=after_epoch)
    finally:
        torch.set_num_threads(before)
    # on a shared machine the wall time depends on the others' load: the CPU time and the load beside it
    recipe.update(threads=threads, cpu_time_s=round(time.process_time() - cpu, 1),
                  load_average_at_start=round(load, 2))
    if best:
        model.load_state_dict(best["state"])
    _ready(model)
    recipe["selection"] = {"rule": SELECTION, "chosen_epoch": best.get("epoch"),
                           "validation_accuracy_per_epoch": curve, "pilot": PILOT}
    record: dict = {"name": run.name, "model": {}, "parameters": parameter_count(model), "recipe": recipe}
    if run.metrics:
        record["metrics"] = evaluate(run.name, model, record, run.progress).metrics
    return model, record


def _counts(name: str, model: torch.nn.Module) -> tuple[int | None, tuple[int, ...]]:
    """The trained iteration count and every count served (its card's), or ``(None, ())`` without tied solvers."""
    iters = get_spec(name).card.iters
    if iters is None:
        return None, ()
    trained = iteration_count(model)
    return trained, tuple(sorted({*iters.served, trained}))


def evaluate(name: str, model: torch.nn.Module, record: dict, progress: ProgressFactory,
             slice: bool = False) -> Evaluation:
    """Validation and test accuracy (``metrics.validation_accuracy``, ``metrics.test_accuracy``) and, for a model
    whose card serves several iteration counts, both at each count (``metrics.iterations``); with ``slice`` the same
    on :data:`SLICE` only."""
    roles = _roles(SLICE if slice else None)
    _ready(model)
    trained, counts = _counts(name, model)
    others = [k for k in counts if k != trained]
    with counted(progress, f"evaluating {name}", 2 * (1 + len(others))) as tick:
        def measured() -> dict[str, float]:
            out = {}
            for role in ("validation", "test"):
                out[f"{role}_accuracy"] = accuracy(model, *roles[role])
                tick()
            return out

        m: dict = measured()
        by_count = {trained: m}
        try:
            for k in others:
                set_iterations(model, k)
                by_count[k] = measured()
        finally:
            if trained is not None:
                set_iterations(model, trained)
    rows = [{"iters": k, **by_count[k]} for k in counts]
    if rows:
        m = {**m, "iterations": {"trained": trained, "served": rows}}
    n_val, n_test = len(roles["validation"][1]), len(roles["test"][1])
    lines = [f"validation accuracy: {m['validation_accuracy'] * 100:.2f} % ({n_val:,} digits; the epoch was chosen on "
             "them)", f"test accuracy: {m['test_accuracy'] * 100:.2f} % ({n_test:,} held-out digits, reported only)"]
    tables = [Table(f"accuracy per solver iteration count (trained: {trained})",
                    ["iterations", "validation", "test"],
                    [[f"{r['iters']}{' (trained)' if r['iters'] == trained else ''}",
                      f"{r['validation_accuracy'] * 100:.1f} %", f"{r['test_accuracy'] * 100:.1f} %"] for r in rows])
              ] if rows else []
    return Evaluation(metrics=m, lines=lines, tables=tables, slice=SLICE_DESCRIPTION if slice else None)
