"""The small trained digit classifiers (issue 27): registered with their cards, committed weights that reproduce their
recorded accuracy, a seeded recipe that still runs, the tied solvers' iteration counts, and an export with parity."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import onnx
import pytest
import torch

import unroll
from unroll import data
from unroll.card import from_onnx
from unroll.evaluation import accuracy
from unroll.export.onnx_export import export_model
from unroll.registry import get_spec
from unroll.solvers.iterations import IterationsError, iteration_count
from unroll.train import TrainRun, recipe_module

TIED = ("vars-vit-mnist", "dic-vit-mnist", "ham-cnn-mnist")
PLAIN = ("vit-mnist", "cnn-mnist")
NAMES = TIED + PLAIN


def _quiet(description: str, total: int):
    return nullcontext(lambda *a, **k: None)


@pytest.mark.parametrize("name", NAMES)
def test_registered_with_a_digit_card_and_committed_weights(name: str) -> None:
    spec = get_spec(name)
    card = spec.card
    assert card.task == "classification" and card.output == "logits" and card.lam is None
    assert card.input.shape == (1, 28, 28) and card.input.colour == "gray" and card.input.resize == "pad-square"
    assert card.input.polarity == "light-on-dark" and card.labels == tuple(str(i) for i in range(10))
    d = card.data
    assert (d.train, d.validation, d.test, d.gate) == ("mnist-train", "mnist-validation", "mnist-test", "validation")
    assert spec.recipe == "unroll.train.digits" and spec.has_weights and not spec.served_by_default
    assert spec.weights_path.stat().st_size < 2_000_000
    record = spec.info()
    assert record["name"] == name and 50_000 <= record["parameters"] <= 300_000
    recipe = record["recipe"]
    assert recipe["seed"] == 0 and recipe["wall_time_s"] < 15 * 60 and recipe["split"]["test"] == 1000
    assert "validation" in recipe["selection"]["rule"] and recipe["selection"]["chosen_epoch"] <= recipe["epochs"]
    assert (card.iters is not None) == (name in TIED)


@pytest.mark.parametrize("name", NAMES)
def test_committed_weights_reproduce_the_recorded_accuracy(name: str) -> None:
    """Recomputed on the 1,000 test digits (and the validation digits): within 0.1 pp of the record."""
    model = unroll.load(name)
    metrics = get_spec(name).info()["metrics"]
    roles = data.mnist_roles()
    for role in ("test", "validation"):
        x, y = roles[role]
        got = accuracy(model, torch.from_numpy(x), y)
        assert abs(got - metrics[f"{role}_accuracy"]) <= 1e-3, (name, role, got)
    assert metrics["test_accuracy"] > 0.9, metrics


@pytest.mark.parametrize("name", TIED)
def test_tied_solvers_run_the_trained_count_the_card_serves(name: str) -> None:
    model = unroll.load(name)
    k = iteration_count(model)
    served = get_spec(name).card.iters.served
    record = get_spec(name).info()["metrics"]["iterations"]
    assert k == record["trained"] and k in served and 3 <= len(served) <= 4
    assert [r["iters"] for r in record["served"]] == sorted(served)
    # every count served is a working model, not only the trained one (it may lose some accuracy)
    assert all(r["validation_accuracy"] > 0.5 for r in record["served"]), record


@pytest.mark.parametrize("name", PLAIN)
def test_plain_baselines_have_no_iteration_count(name: str) -> None:
    with pytest.raises(IterationsError, match="no solver layer"):
        iteration_count(unroll.load(name))


@pytest.mark.parametrize("name", NAMES)
def test_recipe_smoke_run_is_seeded(name: str) -> None:
    """Two optimizer steps of the recipe, twice: the same weights (seeded), which load into the registered model."""
    recipe = recipe_module(name)
    run = TrainRun(name=name, seed=0, steps=2, metrics=False, progress=_quiet)
    a, record = recipe.train(run)
    b, _ = recipe.train(run)
    assert record["recipe"]["steps"] == 2 and "metrics" not in record
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    unroll.load(name, pretrained=False).load_state_dict(sa)


def test_export_of_a_tied_solver_model_matches_pytorch(tmp_path: Path) -> None:
    """The trained NMF model's graph and one sibling graph per other served iteration count answer like PyTorch
    (export verifies parity), each with its count in its card."""
    name = "ham-cnn-mnist"
    trained = iteration_count(unroll.load(name))
    iters = get_spec(name).card.iters.model_copy(update={"default": trained})  # as export resolves it
    result = export_model(name, tmp_path, naive=False)
    graphs = {name: result, **{r.onnx_path.stem: r for r in result.companions}}
    assert set(graphs) == {iters.graph(name, k) for k in iters.counts} and len(graphs) == len(iters.counts)
    for graph, r in graphs.items():
        cases = r.report["parity"]["cases"]
        assert cases and max(c["max_abs_err"] for c in cases) < 1e-4, graph
        card = from_onnx(onnx.load(r.onnx_path))
        assert card.name == graph and set(card.iters.counts) == set(get_spec(name).card.iters.served)
        assert card.iters.default == (trained if graph == name else int(graph.rsplit("iters", 1)[1]))
