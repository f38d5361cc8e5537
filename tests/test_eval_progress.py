"""``unroll eval sdnet-mnist``: its progress bar moves with the work (one unit per accuracy pass), and the numbers
it computes are exactly the committed ones (batching the evaluation for speed changed none of them): those of the
whole evaluation's clean row, and all of those of its fixed slice (``--slice``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from nested_close import close

import unroll
from unroll.registry import get_spec
from unroll.train import SLICE_KEY, counted, mnist, recipe_module

NAME = "sdnet-mnist"


class Recorder:
    """A :data:`unroll.train.ProgressFactory` that keeps every bar opened and every update, as the CLI's rich
    bar receives them."""

    def __init__(self) -> None:
        self.bars: list[tuple[str, int, list[tuple[int, int]]]] = []

    @contextmanager
    def __call__(self, description: str, total: int) -> Iterator:
        updates: list[tuple[int, int]] = []
        self.bars.append((description, total, updates))
        yield lambda done, total_, loss=float("nan"): updates.append((done, total_))


def _moved_to_the_end(total: int, updates: list[tuple[int, int]]) -> None:
    assert total > 1 and len(updates) > 1, (total, updates)
    done = [d for d, _ in updates]
    assert done == sorted(done) and done[-1] == total and {t for _, t in updates} == {total}, updates


def test_progress_advances_per_pass_on_a_subset() -> None:
    """Two λ at σ = 0 (seconds): one unit per accuracy pass, ending at the total; the λ-independent numbers are
    the committed ones."""
    sigmas, lams = (0.0,), (0.1, 0.2)
    rec = Recorder()
    with counted(rec, "subset", mnist.eval_passes(sigmas, lams)) as tick:
        got = mnist._evaluate(unroll.load(NAME), tick, sigmas=sigmas, lams=lams)
    (_, total, updates), = rec.bars
    assert total == 1 + len(sigmas) * (2 * len(lams) + 2)
    _moved_to_the_end(total, updates)
    committed = get_spec(NAME).info()["metrics"]
    assert got["test_accuracy"] == committed["test_accuracy"]
    row, ref = got["robustness"][0], committed["robustness"][0]
    for key in ("sigma", "acc_train_lam", "acc_auto_lam", "mean_auto_lam"):
        assert row[key] == ref[key], key


@pytest.mark.slow
def test_eval_reproduces_the_committed_metrics_exactly_with_a_moving_bar() -> None:
    """What ``unroll eval sdnet-mnist --slice`` runs (the recipe's ``evaluate`` on its fixed slice, with the CLI's
    progress factory in its place): every number equals (to float32 rounding) the slice's in
    ``unroll/weights/sdnet-mnist.json``, and the bar went from 0 to its total, one unit per accuracy pass of the whole
    study (every σ, every λ)."""
    spec = get_spec(NAME)
    record = spec.info()
    rec = Recorder()
    result = recipe_module(NAME).evaluate(NAME, unroll.load(NAME), record, rec, slice=True)
    assert result.slice == record[SLICE_KEY]["slice"]
    # equal to float32 rounding: a mean of float32 values moves in its 7th digit with the machine's thread count
    assert close(result.metrics, record[SLICE_KEY]["metrics"], tol=0.0, rel=1e-6), \
        f"recomputed slice metrics differ from {spec.info_path}"
    (_, total, updates), = rec.bars
    assert total == mnist.eval_passes()
    _moved_to_the_end(total, updates)
