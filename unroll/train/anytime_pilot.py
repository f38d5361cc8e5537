"""Pilot for anytime serving (issue 58): does an SDNet trained at every served iteration count rise with the count?

Today's SDNet-MNIST demo (the registered model built by ``unroll.models.mnist.sdnet_mnist`` whose card serves
several counts) is trained at K = 2 FISTA steps; its other served counts (1, 4, 8) are the same weights
unrolled less or further. This pilot trains the same network from scratch (same seed, epochs, schedule) with the
loss averaged over every served count, and measures both networks' clean accuracy per count on the validation digits
(where a choice would be made) and the test digits (reported), each with the BatchNorm statistics shared by all
counts and with statistics recomputed per count on the training digits (each count is a graph of its own, so each
could carry its own). Writes ``anytime_pilot.json`` and ``.md`` in ``--out``.

Usage: ``python -m unroll.train.anytime_pilot [--epochs 30] [--out benchmarks/results]``
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

from unroll import data, registry
from unroll.evaluation import accuracy
from unroll.machine import cpu_model
from unroll.models.mnist import MNISTSDNet, sdnet_mnist
from unroll.train.mnist import _refresh_csc, fit_digits, smoothed_cross_entropy


def model_name() -> str:
    """The registered SDNet-MNIST whose card serves several iteration counts (found by its builder, not its name)."""
    found = [n for n in registry.list_models()
             if registry.get_spec(n).builder is sdnet_mnist and registry.get_spec(n).card.iters is not None]
    if not found:
        raise SystemExit("no registered SDNet-MNIST serves several iteration counts")
    return found[0]


def default_count() -> int:
    """The trained count: the solver layer's own (the card leaves it to export)."""
    return MNISTSDNet().csc.n_steps


def counts() -> tuple[int, ...]:
    return tuple(sorted({*registry.get_spec(model_name()).card.iters.served, default_count()}))


def all_counts_loss(ks: tuple[int, ...]):
    """Cross-entropy (label smoothing 0.05, as the recipe) averaged over the FISTA counts ``ks``."""

    def loss(model: MNISTSDNet, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        total = 0.0
        for k in ks:
            model.csc.n_steps = k
            total = total + smoothed_cross_entropy(model, x, y)
        model.csc.n_steps = default_count()
        return total / len(ks)

    return loss


@torch.no_grad()
def recalibrate_bn(model: nn.Module, k: int, batch: int = 250, limit: int | None = None) -> nn.Module:
    """A copy of ``model`` at ``k`` steps whose BatchNorm running statistics are recomputed (cumulative average)
    on the training digits, unaugmented."""
    m = copy.deepcopy(model)
    m.csc.n_steps = k
    bns = [b for b in m.modules() if isinstance(b, nn.BatchNorm2d)]
    for b in bns:
        b.reset_running_stats()
        b.momentum = None
    m.train()
    xtr = torch.from_numpy(data.mnist_roles()["train"][0][:limit])
    for i in range(0, len(xtr), batch):
        m(xtr[i:i + batch])
    m.eval()
    return m


def per_count(model: MNISTSDNet, limit: int | None = None) -> list[dict]:
    """Accuracy per served count on the validation and test digits (the first ``limit`` of each split, and of the
    training digits that recompute BN: a smoke run), with shared and with per-count BatchNorm statistics."""
    roles = data.mnist_roles()
    rows = []
    for k in counts():
        shared = copy.deepcopy(model)
        shared.csc.n_steps = k
        own = recalibrate_bn(model, k, limit=limit)
        row = {"iters": k}
        for split in ("validation", "test"):
            x, y = roles[split]
            x, y = torch.from_numpy(x[:limit]), y[:limit]
            row[f"{split}_shared_bn"] = accuracy(shared, x, y)
            row[f"{split}_own_bn"] = accuracy(own, x, y)
        rows.append(row)
        print(f"  iters={k}: " + ", ".join(f"{c} {v * 100:.1f} %" for c, v in row.items() if c != "iters"), flush=True)
    return rows


def markdown(res: dict) -> str:
    smoke = "".join(f" --{k.replace('_', '-')} {res[k]}" for k in ("max_steps", "eval_limit") if res.get(k))
    lines = ["# Anytime pilot: SDNet-MNIST accuracy per FISTA count", "",
             f"{res['machine']['cpu']}, {res['machine']['logical_cores']} cores; "
             f"`python -m unroll.train.anytime_pilot --epochs {res['epochs']}{smoke}`"
             f"{' (a smoke run: not a result)' if smoke else ''}. Clean top-1 accuracy (%) per served "
             "count; *shared BN*: one set of BatchNorm statistics for every count (as served today), *own BN*: "
             "statistics recomputed at that count on the training digits. Choices on validation, report on test.", ""]
    for key, title in (("today", f"today's weights (trained at K = {res['default']})"),
                       ("anytime", "trained at every count (loss averaged over them), same recipe otherwise")):
        trained = f"training: {res[key]['wall_time_s']} s" if res[key].get("wall_time_s") else ""
        lines += [f"## {title}", "", *([trained, ""] if trained else []),
                  "| iters | validation, shared BN | validation, own BN | test, shared BN | test, own BN |",
                  "|---|---|---|---|---|"]
        for r in res[key]["rows"]:
            lines.append(f"| {r['iters']} | {r['validation_shared_bn'] * 100:.1f} | {r['validation_own_bn'] * 100:.1f}"
                         f" | {r['test_shared_bn'] * 100:.1f} | {r['test_own_bn'] * 100:.1f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--max-steps", type=int, default=None, help="stop training early (a smoke run)")
    ap.add_argument("--eval-limit", type=int, default=None, help="evaluate on the first N digits of each split "
                    "(a smoke run)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--save", type=Path, default=Path("build") / "anytime_pilot.sdnet.pt",
                    help="where the trained weights go (not committed)")
    a = ap.parse_args(argv)
    ks = counts()
    name = model_name()
    res: dict = {"model": name, "counts": list(ks), "epochs": a.epochs, "default": default_count(),
                 "max_steps": a.max_steps, "eval_limit": a.eval_limit,
                 "machine": {"cpu": cpu_model(), "logical_cores": os.cpu_count(),
                             "torch": torch.__version__, "threads": torch.get_num_threads()}}
    print(f"today's {name}:", flush=True)
    res["today"] = {"rows": per_count(registry.load(name), a.eval_limit)}
    print(f"training at every count {ks}, {a.epochs} epochs:", flush=True)
    t0 = time.perf_counter()
    model, recipe = fit_digits(MNISTSDNet, a.epochs, max_steps=a.max_steps, refresh=(20, _refresh_csc),
                               loss=all_counts_loss(ks))
    trained_s = round(time.perf_counter() - t0, 1)  # training alone, before the evaluation
    res["anytime"] = {"rows": per_count(model, a.eval_limit), "wall_time_s": trained_s, "recipe": recipe}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "anytime_pilot.json").write_text(json.dumps(res, indent=2) + "\n")
    (a.out / "anytime_pilot.md").write_text(markdown(res))
    a.save.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), a.save)  # for a next step, not committed
    print(f"wrote {a.out / 'anytime_pilot.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
