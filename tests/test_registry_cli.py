"""The registry, ``unroll.load`` and the CLI, run as a user would (real subprocesses)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from nested_close import close

import unroll
from unroll.registry import REGISTRY, get_spec, list_models

CLI = [sys.executable, "-m", "unroll.app.cli"]
ROOT = Path(__file__).resolve().parents[1]
#: Wide enough that rich tables do not wrap or cut cells.
ENV = {**os.environ, "COLUMNS": "250"}


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=ENV, **kw)


def test_list_models_has_conventions_names() -> None:
    names = unroll.list_models()
    for n in ["sdnet-mnist", "sdnet18-cifar", "sdnet18all-cifar", "sdnet18-imagenet", "sdnet34-imagenet",
              "csc-denoiser", "csc-fista", "vars-d", "vars-sd", "nmf-ham", "dic-attn"]:
        assert n in names


def test_pretrained_without_weights_is_a_clear_error() -> None:
    with pytest.raises(FileNotFoundError, match="no committed weights"):
        unroll.load("sdnet18-cifar")
    with pytest.raises(KeyError, match="unknown model"):
        unroll.load("resnet50")


@pytest.mark.parametrize("name", [n for n in list_models() if get_spec(n).task == "block"])
def test_blocks_build_seeded_and_run(name: str) -> None:
    a, b = unroll.load(name, pretrained=False), unroll.load(name, pretrained=False)
    x = torch.rand(2, *REGISTRY[name].input_shape)
    with torch.no_grad():
        ya, yb = a(x), b(x)
    assert torch.equal(ya, yb) and not a.training


def test_demo_models_load_committed_weights() -> None:
    for name in ("sdnet-mnist", "csc-denoiser"):
        spec = REGISTRY[name]
        assert spec.has_weights, f"{name} weights must be committed"
        model = unroll.load(name)
        assert not model.training
        info = spec.info()
        assert "metrics" in info and "recipe" in info


def test_sdnet18all_shortcut_option() -> None:
    keys_on = set(unroll.load("sdnet18all-cifar", pretrained=False).state_dict())
    keys_off = set(unroll.load("sdnet18all-cifar", pretrained=False, shortcut=False).state_dict())
    assert any("shortcut" in k for k in keys_on) and not any("shortcut" in k for k in keys_off)


def test_official_checkpoint_roundtrip_via_load(tmp_path) -> None:
    src = unroll.load("sdnet18-cifar", pretrained=False)
    path = tmp_path / "checkpoint.pth.tar"
    torch.save({"state_dict": src.state_dict()}, path)
    model = unroll.load("sdnet18-cifar", checkpoint=path)
    for k, v in src.state_dict().items():
        assert torch.allclose(model.state_dict()[k].float(), v.float(), atol=1e-6), k


def test_cli_models_and_errors() -> None:
    out = _cli("models", check=True)
    assert "csc-denoiser" in out.stdout
    bad = _cli("eval", "no-such-model")
    assert bad.returncode != 0 and "unknown model" in bad.stderr and "Traceback" not in bad.stderr


def test_cli_models_shows_card_facts() -> None:
    """Each row carries its card's facts: input name and layout, label count, λ/σ inputs (with the λ rule)."""
    out = _cli("models", check=True).stdout
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 4}
    for name in list_models():
        card = get_spec(name).card
        assert name in rows, f"{name} missing from `unroll models`:\n{out}"
        assert card.input.name in rows[name] and card.task in rows[name]
        if card.labels:
            assert f" {len(card.labels)} " in rows[name]
        if card.sigma is not None:
            assert card.sigma.input in rows[name]
        if card.lam is not None and card.lam.auto is not None:
            assert card.lam.auto in rows[name]


def test_cli_train_without_recipe_lists_the_models_with_one() -> None:
    without = next(n for n in list_models() if get_spec(n).recipe is None)
    have = [n for n in list_models() if get_spec(n).recipe is not None]
    assert have, "the registry should name at least one training recipe"
    r = _cli("train", without, "--steps", "1")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "no training recipe" in r.stderr and all(n in r.stderr for n in have), r.stderr


def test_cli_recipe_options_come_from_the_recipe() -> None:
    """Options after NAME are the recipe's own: listed with --recipe-help, an unknown one is a clear error."""
    from unroll.train import recipe_module

    name = next(n for n in list_models() if get_spec(n).recipe is not None)
    options = recipe_module(name).TRAIN_OPTIONS
    listed = _cli("train", name, "--recipe-help", check=True).stdout
    assert all(o.flag in listed for o in options), listed
    bad = _cli("train", name, "--no-such-option", "3")
    assert bad.returncode != 0 and "unknown option '--no-such-option'" in bad.stderr and "Traceback" not in bad.stderr
    assert all(o.flag in bad.stderr for o in options), bad.stderr


@pytest.mark.slow
def test_recipe_evaluation_reproduces_the_committed_metrics() -> None:
    """Numbers only from code: every trained model's recipe recomputes its record's numbers, on the recipe's fixed
    slice (``unroll eval NAME --slice``, seconds): the record keeps that slice's numbers beside the whole
    evaluation's (``unroll eval NAME --slice --write``), measured by the same code on a part of the same data. The
    slice produces every field the whole evaluation does (BM3D fields need ``--bm3d``: they are checked to be exactly
    the fields that option writes)."""
    from contextlib import nullcontext

    from unroll.train import SLICE_KEY, recipe_module

    def progress(description: str, total: int):
        return nullcontext(lambda *a, **k: None)

    names = [n for n in list_models() if get_spec(n).recipe is not None and get_spec(n).has_weights]
    assert len(names) >= 7, names
    for name in names:
        spec = get_spec(name)
        record = spec.info()
        module = recipe_module(name)
        assert "slice" in {o.name for o in module.EVAL_OPTIONS}, f"{name}: its recipe has no --slice"
        result = module.evaluate(name, unroll.load(name), record, progress, slice=True)
        committed = record["metrics"]
        bm3d_only = {k for k in committed if k.startswith("bm3d_")}
        assert set(committed) - bm3d_only == set(result.metrics), f"{name}: fields no command produces"
        sliced = record[SLICE_KEY]
        assert sliced["slice"] == result.slice, f"{name}: {spec.info_path} records another slice"
        assert close(result.metrics, sliced["metrics"]), f"{name}: slice metrics differ from {spec.info_path}"


#: Where model names may be written: the registry and the architecture files (and tests).
NAME_HOMES = ("unroll/registry.py", "unroll/models/", "unroll/solvers/")
STAGE_DIRS = ("unroll", "export", "serving", "benchmarks")


def test_no_model_name_literals_outside_the_registry_and_architectures() -> None:
    """Everything model-specific comes from the card or the registry: no module names a registered model."""
    names = set(list_models())
    names |= {get_spec(n).card.lam.auto for n in list_models() if get_spec(n).card.lam and get_spec(n).card.lam.auto}
    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True)))
                         + r")(?![\w-])")
    hits = []
    for top in STAGE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(NAME_HOMES) or "/results/" in rel:
                continue
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                for m in pattern.finditer(line):
                    hits.append(f"{rel}:{i}: {m.group(1)}")
    assert not hits, f"{len(hits)} model-name literal(s) outside the registry/architecture files:\n" + "\n".join(hits)


@pytest.mark.slow
def test_cli_train_smoke_every_recipe(tmp_path) -> None:
    """A few steps of each training recipe: keeps the recipes alive (CI does not retrain)."""
    for name in (n for n in list_models() if get_spec(n).recipe is not None):
        r = _cli("train", name, "--steps", "3", "--skip-metrics", "--out", str(tmp_path), timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        assert (tmp_path / f"{name}.pt").exists()
        record = json.loads((tmp_path / f"{name}.json").read_text())
        assert record["name"] == name and record["recipe"]
        model = unroll.load(name, pretrained=False, **record.get("model", {}))
        model.load_state_dict(torch.load(tmp_path / f"{name}.pt", weights_only=True))


def test_no_stage_imports_the_training_recipes() -> None:
    """Training lives behind the CLI: export, serving and the benchmarks never import ``unroll.train``."""
    hits = [f"{p.relative_to(ROOT)}:{i}" for top in ("export", "serving", "benchmarks")
            for p in sorted((ROOT / top).rglob("*.py"))
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if re.search(r"\bunroll\.train\b|from unroll import train\b", line)]
    assert not hits, hits
