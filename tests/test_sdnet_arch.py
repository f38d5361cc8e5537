"""SDNet architectures: state-dict keys/shapes equal the official ones; official checkpoints load strictly."""

from __future__ import annotations

import copy
import json
from functools import partial
from pathlib import Path
from unittest import mock

import pytest
import torch

import unroll.solvers.csc as csc
from unroll.models.sdnet import (
    SDNET_BUILDERS,
    SDNet,
    csc_layers,
    load_official_checkpoint,
    refresh_csc,
    sdnet18_cifar,
)

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "sdnet_state_dict_keys.json"  # copied from shared/fixtures

_cache: dict[str, SDNet] = {}


def build(name: str) -> SDNet:
    """Each architecture is built once per session (treat it as read-only; ``fresh`` gives a copy).

    The all-CSC models run 17 power iterations of 50 conv pairs each at construction (~7 CPU-s); a
    5-iteration estimate is enough for shape tests and keeps this file fast on a busy 2-core runner.
    """
    if name not in _cache:
        torch.manual_seed(0)
        with mock.patch.object(csc, "power_iteration", partial(csc.power_iteration, max_iters=5)):
            model = SDNET_BUILDERS[name]()
        # Calibrate BN running stats on one batch: with the initial (0, 1) stats, an untrained all-CSC
        # stack without shortcuts shrinks the codes to exactly zero and its output ignores the input.
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.momentum = None
        side = 32 if model.input_size[-1] == 32 else 64
        with torch.no_grad():
            model.train()(torch.randn(8, 3, side, side))
        _cache[name] = model.eval()
    return _cache[name]


def fresh(name: str) -> SDNet:
    """A copy of the cached model with every tensor zeroed, to prove a load really overwrites it."""
    model = copy.deepcopy(build(name))
    for v in model.state_dict().values():
        v.zero_()
    return model


@pytest.fixture(scope="module")
def official_keys() -> dict[str, dict[str, list[int]]]:
    return json.loads(FIXTURE.read_text())


@pytest.mark.parametrize("name", sorted(SDNET_BUILDERS))
def test_state_dict_matches_official(name: str, official_keys: dict[str, dict[str, list[int]]]) -> None:
    assert name in official_keys
    got = {k: list(v.shape) for k, v in build(name).state_dict().items()}
    expected = official_keys[name]
    assert set(got) == set(expected), (sorted(set(got) - set(expected)), sorted(set(expected) - set(got)))
    assert got == expected
    assert list(got) == list(expected)  # even the order matches the official module layout


def test_fixture_names_all_have_builders(official_keys: dict[str, dict[str, list[int]]]) -> None:
    assert set(official_keys) == set(SDNET_BUILDERS)


def test_model_metadata() -> None:
    cifar, imnet = build("sdnet18-cifar"), build("sdnet34-imagenet")
    assert (cifar.input_size, cifar.num_classes) == ((3, 32, 32), 10)
    assert (imnet.input_size, imnet.num_classes) == ((3, 224, 224), 1000)
    assert len(csc_layers(cifar)) == len(csc_layers(imnet)) == 1
    assert len(csc_layers(build("sdnet18all-cifar-shortcut1"))) == 17
    custom = sdnet18_cifar(num_classes=100, lmbd=0.3, n_steps=3)
    assert custom.linear.out_features == custom.num_classes == 100
    assert (custom.layer0[0].dn.lmbd, custom.layer0[0].dn.n_steps) == (0.3, 3)


def _fake_official_state(model: SDNet) -> dict[str, torch.Tensor]:
    """A state dict as the official code saves it, with recognisable CSC values to check on load."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for k in state:
        if k.endswith("dn.step_size"):
            state[k] = torch.tensor(0.0123)
        elif k.endswith("dn.weight"):
            state[k] = state[k] * 2.0  # not unit-norm: loading re-normalises, as the official forward does
    return state


@pytest.mark.parametrize("layout", ["bare", "wrapped", "dataparallel"])
def test_load_official_checkpoint_layouts(layout: str, tmp_path: Path) -> None:
    src = build("sdnet18-cifar")
    state = _fake_official_state(src)
    if layout == "dataparallel":
        state = {f"module.{k}": v for k, v in state.items()}
    obj = state if layout == "bare" else {"epoch": 3, "state_dict": state, "perf": torch.tensor(91.0)}
    path = tmp_path / ("model_best.pth.tar" if layout == "bare" else "checkpoint.pth.tar")
    torch.save(obj, path)

    dst = load_official_checkpoint(fresh("sdnet18-cifar"), path)
    dn = dst.layer0[0].dn
    assert float(dn.step_size) == pytest.approx(0.0123)  # kept as stored, not recomputed
    torch.testing.assert_close(dn.weight.flatten(1).norm(dim=1), torch.ones(64))
    torch.testing.assert_close(dn.weight, src.layer0[0].dn.weight)
    loaded = dst.state_dict()
    for k, v in src.state_dict().items():
        if ".dn." not in k:
            torch.testing.assert_close(loaded[k], v, rtol=0, atol=0)


def test_load_recompute_step_size(tmp_path: Path) -> None:
    src = sdnet18_cifar()
    torch.save(_fake_official_state(src), tmp_path / "model_best.pth.tar")
    dst = load_official_checkpoint(fresh("sdnet18-cifar"), tmp_path / "model_best.pth.tar",
                                   recompute_step_size=True)
    torch.testing.assert_close(dst.layer0[0].dn.step_size, src.layer0[0].dn.step_size)


def test_load_all_csc_checkpoint(tmp_path: Path) -> None:
    name = "sdnet18all-cifar-shortcut1"
    torch.save({"state_dict": _fake_official_state(build(name))}, tmp_path / "checkpoint.pth.tar")
    model = load_official_checkpoint(fresh(name), tmp_path / "checkpoint.pth.tar")
    assert [float(dn.step_size) for dn in csc_layers(model)] == pytest.approx([0.0123] * 17)
    for a, b in zip(csc_layers(model), csc_layers(build(name)), strict=True):
        torch.testing.assert_close(a.weight, b.weight)


def test_refresh_csc_recomputes_step_sizes() -> None:
    model = sdnet18_cifar()
    dn = model.layer0[0].dn
    before = dn.step_size.clone()
    with torch.no_grad():
        dn.step_size.fill_(1.0)
        dn.weight.mul_(3.0)
    assert refresh_csc(model) == 1
    torch.testing.assert_close(dn.step_size, before)
    torch.testing.assert_close(dn.weight.flatten(1).norm(dim=1), torch.ones(64))


def test_load_mismatch_raises(tmp_path: Path) -> None:
    state = build("sdnet18-cifar").state_dict()
    del state["layer0.0.dn.step_size"]
    torch.save(state, tmp_path / "missing.pth.tar")
    with pytest.raises(ValueError, match=r"missing keys \['layer0\.0\.dn\.step_size'\]"):
        load_official_checkpoint(fresh("sdnet18-cifar"), tmp_path / "missing.pth.tar")

    state = dict(build("sdnet18-cifar").state_dict())
    state["layer0.0.running_c_loss"] = torch.tensor(0.0)  # the older official DictConv2d buffer
    torch.save(state, tmp_path / "extra.pth.tar")
    with pytest.raises(ValueError, match=r"unexpected keys \['layer0\.0\.running_c_loss'\]"):
        load_official_checkpoint(fresh("sdnet18-cifar"), tmp_path / "extra.pth.tar")

    torch.save(build("sdnet18-imagenet").state_dict(), tmp_path / "imagenet.pth.tar")
    with pytest.raises(ValueError, match=r"shape mismatches \['layer0\.0\.dn\.weight: checkpoint"):
        load_official_checkpoint(fresh("sdnet18-cifar"), tmp_path / "imagenet.pth.tar")

    torch.save([1, 2], tmp_path / "junk.pth.tar")
    with pytest.raises(ValueError, match="not a state dict"):
        load_official_checkpoint(fresh("sdnet18-cifar"), tmp_path / "junk.pth.tar")


@pytest.mark.parametrize("name", sorted(SDNET_BUILDERS))
def test_forward_shapes_lam_and_determinism(name: str) -> None:
    model = build(name)
    torch.manual_seed(1)
    side, n_cls = (32, 10) if model.input_size[-1] == 32 else (64, 1000)  # ImageNet: adaptive pooling
    x = torch.randn(2, 3, side, side)
    with torch.no_grad():
        out = model(x)
        assert out.shape == (2, n_cls)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(model(x), out, rtol=0, atol=0)  # eval mode is deterministic

        # λ = the default 0.1 reproduces the plain call; a larger λ changes the output; per-sample λ
        # acts per sample (eval BN keeps the samples independent).
        # λ as an input subtracts λt after the conv; baked λ rides in the conv bias: same maths, other rounding,
        # amplified through an untrained ResNet-34's BatchNorms (seen: 1.4e-5 abs).
        torch.testing.assert_close(model(x, torch.full((2,), 0.1)), out, rtol=1e-4, atol=1e-4)
        high = model(x, torch.full((2,), 0.8))
        assert (high - out).abs().max() > 1e-4
        mixed = model(x, torch.tensor([0.1, 0.8]))
        torch.testing.assert_close(mixed[0], out[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(mixed[1], high[1])


def test_imagenet_single_sample() -> None:
    with torch.no_grad():
        assert build("sdnet34-imagenet")(torch.randn(1, 3, 64, 64)).shape == (1, 1000)


def test_train_mode_backward() -> None:
    model = sdnet18_cifar().train()
    loss = model(torch.randn(2, 3, 32, 32), torch.tensor([0.1, 0.2])).logsumexp(1).sum()
    loss.backward()
    assert model.layer0[0].dn.weight.grad is not None
    assert model.linear.weight.grad is not None
