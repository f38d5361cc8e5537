"""The registry, ``unroll.load`` and the CLI, run as a user would (real subprocesses)."""

import json
import subprocess
import sys

import pytest
import torch

import unroll
from unroll.registry import REGISTRY

CLI = [sys.executable, "-m", "unroll.cli"]


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


@pytest.mark.parametrize("name", [n for n, s in REGISTRY.items() if s.task == "block"])
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
    out = subprocess.run([*CLI, "models"], capture_output=True, text=True, check=True)
    assert "csc-denoiser" in out.stdout
    bad = subprocess.run([*CLI, "eval", "no-such-model"], capture_output=True, text=True)
    assert bad.returncode != 0 and "unknown model" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_cli_train_smoke_both_demo_models(tmp_path) -> None:
    """A few steps of each training recipe: keeps the scripts alive (CI does not retrain)."""
    for name in ("sdnet-mnist", "csc-denoiser"):
        r = subprocess.run([*CLI, "train", name, "--steps", "3", "--skip-metrics", "--out", str(tmp_path)],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        assert (tmp_path / f"{name}.pt").exists()
        record = json.loads((tmp_path / f"{name}.json").read_text())
        assert record["name"] == name and record["recipe"]
