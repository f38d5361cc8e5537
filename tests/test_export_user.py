"""Deploying the user's own model: official-layout checkpoints and plain-PyTorch modules, CLI and Python.

Real exports (torch.onnx → onnxslim → checker → TensorRT lint → ONNX Runtime parity) and real CLI
processes. Every failure is one clear line, a non-zero exit, and an empty output folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

import unroll
from unroll.card import CardError, from_onnx
from unroll.export.onnx_export import ExportError, export, export_model
from unroll.export.user_model import build_module, card_from_options, card_updates

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/ista_digits.py:ista_digits"
CIFAR = "sdnet18-cifar"
WORDS = ["plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "400"}  # one line per message, however long
    return subprocess.run([sys.executable, "-m", "unroll.app.cli", "export", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=timeout)


def _empty(folder: Path) -> bool:
    return not folder.exists() or not any(folder.iterdir())


def _one_clear_line(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode != 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "Torch IR graph" not in r.stdout + r.stderr, r.stderr
    line = next(ln for ln in r.stderr.splitlines() if "error" in ln)
    for needle in needles:
        assert needle in line, r.stderr


@pytest.fixture(scope="module")
def official_checkpoint(tmp_path_factory) -> Path:
    """Seeded SDNet-18 CIFAR weights, perturbed, in the official ``checkpoint.pth.tar`` layout."""
    model = unroll.load(CIFAR, pretrained=False)
    gen = torch.Generator().manual_seed(7)
    state = {}
    for k, v in model.state_dict().items():
        if v.is_floating_point() and k.rsplit(".", 1)[-1] in ("weight", "bias"):
            v = v + 0.5 * (v.std() if v.numel() > 1 else 1.0) * torch.randn(v.shape, generator=gen)
        state["module." + k] = v
    path = tmp_path_factory.mktemp("ckpt") / "checkpoint.pth.tar"
    torch.save({"epoch": 200, "arch": "sdnet18", "state_dict": state, "best_acc1": 0.5}, path)
    return path


@pytest.mark.slow
def test_cli_checkpoint_export_matches_pytorch_with_that_checkpoint(official_checkpoint, tmp_path) -> None:
    out = tmp_path / "onnx"
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(WORDS) + "\n")
    r = _cli(CIFAR, "--checkpoint", str(official_checkpoint), "--labels", str(labels), "--out", str(out))
    assert r.returncode == 0, r.stderr
    onnx_path = out / f"{CIFAR}.onnx"
    report = json.loads(onnx_path.with_suffix(".report.json").read_text())
    sha = hashlib.sha256(official_checkpoint.read_bytes()).hexdigest()
    assert report["checkpoint"] == {"path": str(official_checkpoint.resolve()), "sha256": sha,
                                    "bytes": official_checkpoint.stat().st_size}
    assert sha in r.stdout.replace("\n", "")
    card = from_onnx(onnx_path)
    assert list(card.labels) == WORDS

    x = np.random.default_rng(0).random((3, 3, 32, 32), dtype=np.float32)
    lam = np.full(3, card.lam.default, np.float32)
    got = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]).run(
        None, {"image": x, "lam": lam})[0]
    with torch.no_grad():
        ref = unroll.load(CIFAR, pretrained=False, checkpoint=official_checkpoint)(torch.from_numpy(x)).numpy()
        seeded = unroll.load(CIFAR, pretrained=False)(torch.from_numpy(x)).numpy()
    assert np.abs(got - ref).max() <= 1e-4
    # the checkpoint's weights, not the seeded ones: far beyond the parity tolerance
    assert np.abs(got - seeded).max() > 1e-3 and np.linalg.norm(got - seeded) > 0.1 * np.linalg.norm(seeded)


@pytest.fixture(scope="module")
def bad_checkpoints(official_checkpoint, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("bad")
    state = torch.load(official_checkpoint, weights_only=True)["state_dict"]
    dropped = next(k for k in state if k.endswith("conv1.weight"))
    wrong = {k: v for k, v in state.items() if k != dropped}
    wrong["module.extra.weight"] = torch.zeros(2)
    paths = {"wrong": folder / "model_best.pth.tar", "corrupt": folder / "corrupt.pth.tar"}
    torch.save(wrong, paths["wrong"])
    paths["corrupt"].write_bytes(official_checkpoint.read_bytes()[:4096])  # truncated download
    paths["dropped"] = dropped.removeprefix("module.")
    return paths


def test_cli_checkpoint_with_wrong_keys_names_them(bad_checkpoints, tmp_path) -> None:
    out = tmp_path / "onnx"
    r = _cli(CIFAR, "--checkpoint", str(bad_checkpoints["wrong"]), "--out", str(out))
    _one_clear_line(r, "missing keys", bad_checkpoints["dropped"], "unexpected keys", "extra.weight")
    assert _empty(out)


def test_cli_corrupt_or_missing_checkpoint_is_one_clear_error(bad_checkpoints, tmp_path) -> None:
    out = tmp_path / "onnx"
    r = _cli(CIFAR, "--checkpoint", str(bad_checkpoints["corrupt"]), "--out", str(out))
    _one_clear_line(r, "not a readable PyTorch checkpoint")
    r = _cli(CIFAR, "--checkpoint", str(tmp_path / "nowhere.pth.tar"), "--out", str(out))
    _one_clear_line(r, "does not exist")
    assert _empty(out)


def test_labels_must_match_the_logits(tmp_path) -> None:
    with pytest.raises(ExportError, match="3 labels but the model outputs 10 logits"):
        export_model(CIFAR, tmp_path, card_updates={"labels": ["a", "b", "c"]}, naive=False)
    assert _empty(tmp_path)


@pytest.mark.slow
def test_bad_card_option_is_a_clear_error_before_anything_is_written(tmp_path) -> None:
    out = tmp_path / "onnx"
    r = _cli("--model", EXAMPLE, "--input-shape", "1,28,28", "--mean", "0.1,0.2,0.3", "--out", str(out))
    _one_clear_line(r, "mean/std take 1 value or one per channel")
    r = _cli(CIFAR, "--mean", "0.5,0.5", "--out", str(out))
    _one_clear_line(r, "mean/std take 1 value or one per channel")
    r = _cli("--model", EXAMPLE, "--input-shape", "1,28,28", "--data-test", "no-such-set", "--out", str(out))
    _one_clear_line(r, "unknown dataset 'no-such-set'")
    assert _empty(out)
    with pytest.raises(CardError, match="mean/std"):
        card_from_options("m", "classification", (3, 32, 32), card_updates(mean=[0.5, 0.5]))
    with pytest.raises(CardError, match="mean/std"):
        export(torch.nn.Identity(), {"name": "m", "task": "block", "output": "y",
                                     "input": {"name": "x", "shape": [3, 8, 8], "mean": [0, 0]}}, out_dir=out)
    assert _empty(out)


@pytest.mark.slow
def test_cli_exports_the_plain_pytorch_example_with_its_card(tmp_path) -> None:
    out = tmp_path / "onnx"
    labels = tmp_path / "digits.txt"
    labels.write_text("\n".join(["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]))
    r = _cli("--model", EXAMPLE, "--name", "ista-digits", "--input-shape", "1,28,28", "--task", "classification",
             "--labels", str(labels), "--lam-input", "lam", "--lam-default", "0.1", "--data-train", "mnist-train",
             "--data-test", "mnist-test", "--resize", "pad-square", "--mean", "0.13", "--std", "0.31",
             "--out", str(out))
    assert r.returncode == 0, r.stderr
    path = out / "ista-digits.onnx"
    card = from_onnx(path)
    assert card.name == "ista-digits" and card.task == "classification" and card.labels[3] == "three"
    assert card.input.shape == (1, 28, 28) and card.input.colour == "gray" and card.input.resize == "pad-square"
    assert card.input.mean == (0.13,) and card.input.std == (0.31,)
    assert card.lam.input == "lam" and card.lam.default == 0.1
    assert card.data.train == "mnist-train" and card.data.test == "mnist-test"
    report = json.loads(path.with_suffix(".report.json").read_text())
    assert report["source"] == EXAMPLE and all(c["ok"] for c in report["parity"]["cases"])
    assert {c["batch"] for c in report["parity"]["cases"]} >= {1, 4}

    module = build_module(EXAMPLE)
    x = torch.rand(5, 1, 28, 28, generator=torch.Generator().manual_seed(3))
    lam = torch.tensor([0.0, 0.05, 0.1, 0.3, 1.0])
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {"image": x.numpy(), "lam": lam.numpy()})[0]
    with torch.no_grad():
        ref = module(x, lam).numpy()
    assert np.abs(got - ref).max() <= 1e-4


def test_python_export_takes_module_card_and_example_inputs(tmp_path) -> None:
    """The one public function: an nn.Module, example inputs and a card → the verified export."""
    module = build_module(EXAMPLE)
    card = {"name": "my-ista", "task": "classification", "output": "scores",
            "input": {"name": "pixels", "shape": [1, 28, 28], "colour": "gray"}, "lam": {"input": "lam",
                                                                                         "default": 0.2}}
    x = torch.rand(1, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    res = export(module, card, x, tmp_path)
    assert res.onnx_path == tmp_path / "my-ista.onnx" and res.report["model"] == "my-ista"
    cases = res.report["parity"]["cases"]
    assert [c["batch"] for c in cases] == [1, 2] and all(c["ok"] for c in cases)  # batch 2 added
    assert [i["name"] for i in res.report["inputs"]] == ["pixels", "lam"]
    assert from_onnx(res.onnx_path).lam.default == 0.2
    # Without example inputs they come from the card, as for registered models; λ can be baked in.
    baked = export(module, card, out_dir=tmp_path / "baked", name="my-ista-baked", lam_input=False)
    assert [i["name"] for i in baked.report["inputs"]] == ["pixels"] and from_onnx(baked.onnx_path).lam is None


WHILE_MODEL = '''
import torch


class UntilConverged(torch.nn.Module):
    """ISTA until the update is below a tolerance: the iteration count depends on the input."""

    def forward(self, x):
        z = torch.zeros_like(x)
        step = torch.ones(())
        while step > 1e-3:
            new = torch.sign(z + 0.5 * (x - z)) * torch.relu(torch.abs(z + 0.5 * (x - z)) - 0.01)
            step = (new - z).abs().max()
            z = new
        return z


class BranchOnValue(torch.nn.Module):
    def forward(self, x):
        if x.mean() > 0.5:
            return x * 2
        return x - 1


def until_converged():
    return UntilConverged()


def branch_on_value():
    return BranchOnValue()
'''


@pytest.fixture
def bad_models(tmp_path) -> Path:
    path = tmp_path / "bad_models.py"
    path.write_text(textwrap.dedent(WHILE_MODEL))
    return path


BLOCK = {"name": "bad", "task": "block", "output": "y", "input": {"name": "x", "shape": [1, -1, -1]}}


def test_tolerance_loop_is_refused_naming_cause_and_fix(bad_models, tmp_path) -> None:
    out = tmp_path / "onnx"
    with pytest.raises(ExportError, match=r"data-dependent loop at .*bad_models\.py:\d+ \(`while step > 1e-3:`\)"
                       r".*[Ff]ix the iteration count"):
        export(build_module(f"{bad_models}:until_converged"), BLOCK, out_dir=out)
    assert _empty(out)
    r = _cli("--model", f"{bad_models}:until_converged", "--input-shape", "1,-1,-1", "--task", "block",
             "--out", str(out))
    _one_clear_line(r, "data-dependent loop", "ix the iteration count")
    assert _empty(out)


def test_if_on_tensor_values_is_refused_naming_cause_and_fix(bad_models, tmp_path) -> None:
    out = tmp_path / "onnx"
    with pytest.raises(ExportError,
                       match=r"Python-side `if` on tensor values at .*`if x.mean\(\) > 0.5:`.*torch.where"):
        export(build_module(f"{bad_models}:branch_on_value"), BLOCK, out_dir=out)
    assert _empty(out)


def test_unsupported_op_gives_the_exporters_message(tmp_path) -> None:
    class Svd(torch.nn.Module):
        def forward(self, x):
            return torch.linalg.svdvals(x.flatten(2)).flatten(1)

    with pytest.raises(ExportError, match="aten::linalg_svdvals.*not supported; fix:"):
        export(Svd(), {**BLOCK, "input": {"name": "x", "shape": [3, 8, 8]}}, out_dir=tmp_path / "o")
    assert _empty(tmp_path / "o")


def test_model_reference_errors_are_clear(tmp_path) -> None:
    with pytest.raises(ExportError, match="no such file"):
        build_module(str(tmp_path / "missing.py") + ":f")
    with pytest.raises(ExportError, match="has no callable 'nope' .*ista_digits"):
        build_module("examples/ista_digits.py:nope")
    with pytest.raises(ExportError, match="FILE.py:FACTORY"):
        build_module("examples/ista_digits.py")
    r = _cli("--model", EXAMPLE, "--out", str(tmp_path / "o"))
    _one_clear_line(r, "--input-shape")
