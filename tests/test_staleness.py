"""One staleness rule: ``unroll serve`` and ``unroll repo`` plan the same steps, exactly the ones that depend on
what changed (each stage's report records the hashes of its inputs: card, weights, upstream graph, options).

A built tree (the demo classifier with its λ-rule companion, exported and written into a repository) is copied
per test; one input changes, and both commands' plans must list exactly the dependent steps and nothing else.
Running a plan leaves nothing stale.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import onnx
import pytest

from unroll import artifacts, pipeline
from unroll.app.serve import serve_plan
from unroll.app.triton_cli import repo_plan
from unroll.registry import REGISTRY

MODEL, RULE = "sdnet-mnist", "sdnet-mnist-autolam"
#: MODEL's graphs: itself, its λ rule and one graph per other served iteration count (tests/test_iterations.py)
GRAPHS = tuple(pipeline.graphs_of([MODEL]))
REPO = {("repo", g) for g in GRAPHS}
EXPORT = {("export", MODEL)} | REPO


@pytest.fixture(scope="module")
def built(demo_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``onnx/`` (the shared demo exports of MODEL's graphs) and ``repo/`` written from them by serve's plan."""
    root = tmp_path_factory.mktemp("staleness")
    (root / "onnx").mkdir()
    for g in GRAPHS:
        for src in (artifacts.graph(g, onnx_dir=demo_onnx_dir), artifacts.graph_report(g, onnx_dir=demo_onnx_dir)):
            shutil.copy2(src, root / "onnx" / src.name)
    steps = serve_plan([MODEL], root / "onnx", root / "repo")
    assert {s.key for s in steps} == REPO, steps  # the exports are up to date
    pipeline.run(steps, progress=None)
    return root


@pytest.fixture
def tree(built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the built tree, with MODEL's weights and training record (its ood rule) read from a copy too (so a
    test may change them)."""
    shutil.copytree(built, tmp_path / "t")
    spec = REGISTRY[MODEL]
    if not spec.has_weights:
        pytest.skip(f"{MODEL} has no committed weights")
    weights = tmp_path / "weights"
    weights.mkdir()
    shutil.copy2(spec.weights_path, weights / spec.weights_path.name)
    shutil.copy2(spec.info_path, weights / spec.info_path.name)
    monkeypatch.setitem(REGISTRY, MODEL, dataclasses.replace(spec, weights_dir=weights))
    return tmp_path / "t"


def _plans(tree: Path, options: pipeline.RepoOptions | None = None) -> tuple[set, set]:
    """The keys of the plan ``unroll serve`` makes and of the one ``unroll repo`` makes (with ``options``)."""
    onnx_dir, repo = tree / "onnx", tree / "repo"
    return ({s.key for s in serve_plan([MODEL], onnx_dir, repo)},
            {s.key for s in repo_plan([MODEL], repo, onnx_dir, options=options)})


def _change_card(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = REGISTRY[MODEL]
    card = spec.card.model_copy(update={"description": spec.card.description + " (edited)"})
    monkeypatch.setitem(REGISTRY, MODEL, dataclasses.replace(spec, card=card))


def _change_weights() -> None:
    import torch

    path = REGISTRY[MODEL].weights_path
    state = torch.load(path, map_location="cpu", weights_only=True)
    key = next(k for k, v in state.items() if v.is_floating_point())
    state[key] = state[key] + 1e-3
    torch.save(state, path)


def _change_graph(tree: Path) -> None:
    path = artifacts.graph(MODEL, onnx_dir=tree / "onnx")
    model = onnx.load(path)
    model.doc_string = "edited after export"
    onnx.save(model, path)


def test_nothing_is_stale_after_building(tree: Path) -> None:
    assert _plans(tree) == (set(), set())


@pytest.mark.parametrize("change", ["card", "weights", "graph"])
def test_both_commands_plan_exactly_what_depends_on_a_changed_input(
        tree: Path, change: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A card field or the weights: re-export the model (its companion comes along) and rewrite both model
    directories; the served graph alone: rewrite its directory only."""
    if change == "card":
        _change_card(monkeypatch)
    elif change == "weights":
        _change_weights()
    else:
        _change_graph(tree)
    expected = EXPORT if change != "graph" else {("repo", MODEL)}
    assert _plans(tree) == (expected, expected)


def test_a_repository_option_rewrites_the_directories_only(tree: Path) -> None:
    """`unroll repo --threads 3` rewrites every directory (nothing is re-exported); afterwards serve's default
    options are the changed input, so serve plans the same rewrites back, and repo with --threads 3 nothing."""
    threads = pipeline.RepoOptions(threads=3)
    serve, repo = _plans(tree, threads)
    assert (serve, repo) == (set(), REPO)
    pipeline.run(repo_plan([MODEL], tree / "repo", tree / "onnx", options=threads), progress=None)
    assert _plans(tree, threads) == (REPO, set())


def test_a_precision_quantizes_first(tree: Path) -> None:
    """`unroll repo --precision fp16` plans the quantized graphs (missing) before the directories that serve them."""
    _, repo = _plans(tree, pipeline.RepoOptions(precision="fp16"))
    assert repo == {("quantize", g) for g in GRAPHS} | REPO


def test_an_edited_model_directory_is_rewritten(tree: Path) -> None:
    """A file of a written directory edited by hand (or by an older unroll) is stale for both commands."""
    model_py = tree / "repo" / RULE / "1" / "model.py"
    model_py.write_text(model_py.read_text() + "\n# edited\n")
    assert _plans(tree) == ({("repo", RULE)}, {("repo", RULE)})


def test_running_a_plan_leaves_nothing_stale(tree: Path) -> None:
    """The served graph changed: after serve's plan runs, neither command finds anything to do."""
    _change_graph(tree)
    pipeline.run(serve_plan([MODEL], tree / "onnx", tree / "repo"), progress=None)
    assert _plans(tree) == (set(), set())


@pytest.mark.slow
def test_after_a_re_export_nothing_is_stale(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Card and weights changed: one re-export and a rewrite per graph, then both commands find nothing to do."""
    _change_card(monkeypatch)
    _change_weights()
    steps = repo_plan([MODEL], tree / "repo", tree / "onnx")
    assert {s.key for s in steps} == EXPORT
    pipeline.run(steps, progress=None)
    assert _plans(tree) == (set(), set())
