"""Hamburger (NMF) as the official model: golden parity in PyTorch and ONNX, the bases policies, the official head's
state-dict layout and checkpoint loading, and the draw-spread benchmark that picks the serving default.

Golden: ``tests/fixtures/ham_nmf_golden.npz``, outputs of the official ``NMF2D`` (Gsunshine/Enjoy-Hamburger
d9b51f6f, ``seg/HamNet/hamburger/ham.py``) with the bases it drew stored as ``bases0``; see its ``meta``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from readme_blocks import generated
from torch import nn

import unroll
from unroll.benchmarks import ham_draws
from unroll.errors import ExportError
from unroll.export.onnx_export import export
from unroll.models.hamnet import LightHamHead
from unroll.solvers.nmf import BASES_POLICIES, DEFAULT_BASES, NMFHam, draw_bases

FIXTURE = Path(__file__).parent / "fixtures" / "ham_nmf_golden.npz"
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "ham_draws.json"
TOL = 1e-4  # relative L2; the fixture's meta puts float32 vs float64 at ~5e-7


@pytest.fixture(scope="module")
def golden() -> dict:
    with np.load(FIXTURE) as z:
        out = {k: z[k] for k in z.files}
    out["meta"] = json.loads(str(out["meta"]))
    return out


def _rel(a: np.ndarray | torch.Tensor, b: np.ndarray) -> float:
    a = np.asarray(a, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _ham(golden: dict, **kw) -> NMFHam:
    m = golden["meta"]["defaults"]
    return NMFHam(m["MD_D"], rank=m["MD_R"], train_steps=m["TRAIN_STEPS"], eval_steps=m["EVAL_STEPS"], **kw)


# ----------------------------------------------------------------------------------------------- PyTorch parity


def test_given_bases_reproduce_the_official_outputs(golden: dict) -> None:
    x, b0 = torch.from_numpy(golden["x"]), torch.from_numpy(golden["bases0"])
    ham = _ham(golden).eval()
    with torch.no_grad():
        assert _rel(ham(x, bases=b0), golden["y_eval7"]) <= TOL
        bases, coef = ham.decompose(x, b0)
        assert _rel(bases, golden["bases_final"]) <= TOL and _rel(coef, golden["coef_final"]) <= TOL
        assert _rel(ham.train()(x, bases=b0), golden["y_eval6"]) <= TOL  # train mode: TRAIN_STEPS updates
    stored = _ham(golden, bases="given", given=b0).eval()
    with torch.no_grad():
        assert _rel(stored(x), golden["y_eval7"]) <= TOL
        assert torch.equal(stored(x), stored(x))  # the given-bases path is deterministic


def test_official_random_is_the_official_draw_and_per_sample_reproduces_it(golden: dict) -> None:
    """Seeded as the fixture was (global seed + 1 right before the call), ``official-random`` draws ``bases0``
    exactly; ``per-sample`` with that seed reproduces it without touching the global RNG."""
    x, seed = torch.from_numpy(golden["x"]), golden["meta"]["seed"] + 1
    b, d, r = golden["bases0"].shape
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        assert np.array_equal(draw_bases(b, d, r).numpy(), golden["bases0"])
        torch.manual_seed(seed)
        with torch.no_grad():
            y = _ham(golden, bases="official-random").eval()(x)
        again = _ham(golden, bases="official-random").eval()(x)  # the global RNG moved on: a new draw
    assert _rel(y, golden["y_eval7"]) <= TOL and _rel(again, golden["y_eval7"]) > 1e-2
    state = torch.random.get_rng_state()
    with torch.no_grad():
        assert _rel(_ham(golden, bases="per-sample", seed=seed).eval()(x), golden["y_eval7"]) <= TOL
    assert torch.equal(state, torch.random.get_rng_state())


def test_policy_options_are_checked() -> None:
    with pytest.raises(ValueError, match="choose one of"):
        NMFHam(8, rank=2, bases="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs given"):
        NMFHam(8, rank=2, bases="given")
    with pytest.raises(ValueError, match="do not fit"):
        NMFHam(8, rank=2, bases="given", given=torch.rand(3, 8, 3))
    ham = NMFHam(8, rank=2, bases="given", given=torch.rand(3, 8, 2)).eval()
    with pytest.raises(ValueError, match="with B = 2"):
        ham(torch.rand(2, 8, 4))
    assert set(BASES_POLICIES) == {"seeded", "given", "per-sample", "official-random"}
    assert "bases" not in NMFHam(8, rank=2, persistent=False).state_dict()


# ----------------------------------------------------------------------------------------------- ONNX parity


class _Golden(nn.Module):
    """The fixture's four outputs from one input, flattened and concatenated into the graph's one output."""

    def __init__(self, golden: dict) -> None:
        super().__init__()
        b0 = torch.from_numpy(golden["bases0"])
        self.eval7 = _ham(golden, bases="given", given=b0)
        self.eval6 = _ham(golden, bases="given", given=b0)
        self.eval6.eval_steps = golden["meta"]["defaults"]["TRAIN_STEPS"]  # train mode's count, in an eval graph

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bases, coef = self.eval7.decompose(x)
        return torch.cat([self.eval7(x).flatten(1), self.eval6(x).flatten(1), bases.flatten(1), coef.flatten(1)], 1)


def test_exported_onnx_reproduces_the_official_outputs(golden: dict, tmp_path: Path) -> None:
    x = torch.from_numpy(golden["x"])
    card = dict(name="ham-golden", task="block", output="y",
                input=dict(name="x", shape=list(x.shape[1:])), description="NMF with the official draw")
    result = export(_Golden(golden), card, {"x": x}, tmp_path)
    assert all(c["ok"] for c in result.report["parity"]["cases"])
    sess = ort.InferenceSession(str(result.onnx_path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": golden["x"]})[0]
    b = x.shape[0]
    parts, start = {}, 0
    for key in ("y_eval7", "y_eval6", "bases_final", "coef_final"):
        n = golden[key][0].size
        parts[key] = got[:, start:start + n].reshape(golden[key].shape)
        start += n
    assert start == got.shape[1] and got.shape[0] == b
    for key, value in parts.items():
        assert _rel(value, golden[key]) <= TOL, key


def test_random_policies_refuse_export(tmp_path: Path) -> None:
    card = dict(name="ham-random", task="block", output="y", input=dict(name="x", shape=[16, 4, 4]))
    for policy in ("official-random", "per-sample"):
        with pytest.raises(ExportError, match=f"{policy}.*cannot be exported"):
            export(NMFHam(16, rank=4, bases=policy), card, {"x": torch.rand(2, 16, 4, 4)}, tmp_path)
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------------------------- the official head

#: The official LightHamHead's state-dict keys (mmcv ConvModule with the configs' GroupNorm; NMF2D has no state).
OFFICIAL_KEYS = ["conv_seg.weight", "conv_seg.bias", "squeeze.conv.weight", "squeeze.gn.weight", "squeeze.gn.bias",
                 "hamburger.ham_in.conv.weight", "hamburger.ham_in.conv.bias", "hamburger.ham_out.conv.weight",
                 "hamburger.ham_out.gn.weight", "hamburger.ham_out.gn.bias", "align.conv.weight", "align.gn.weight",
                 "align.gn.bias"]


def _official_state(c_in: int, ham: int, channels: int, classes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"conv_seg.weight": (classes, channels, 1, 1), "conv_seg.bias": (classes,),
              "squeeze.conv.weight": (ham, c_in, 1, 1), "squeeze.gn.weight": (ham,), "squeeze.gn.bias": (ham,),
              "hamburger.ham_in.conv.weight": (ham, ham, 1, 1), "hamburger.ham_in.conv.bias": (ham,),
              "hamburger.ham_out.conv.weight": (ham, ham, 1, 1), "hamburger.ham_out.gn.weight": (ham,),
              "hamburger.ham_out.gn.bias": (ham,), "align.conv.weight": (channels, ham, 1, 1),
              "align.gn.weight": (channels,), "align.gn.bias": (channels,)}
    assert list(shapes) == OFFICIAL_KEYS
    return {k: torch.randn(s, generator=g) * 0.05 for k, s in shapes.items()}


def test_head_has_the_official_state_dict_keys() -> None:
    head = unroll.load("hamnet-light-tiny", pretrained=False)
    assert isinstance(head, LightHamHead) and sorted(head.state_dict()) == sorted(OFFICIAL_KEYS)
    assert head.hamburger.ham.policy == DEFAULT_BASES


@pytest.mark.parametrize("wrap", ["bare", "state_dict", "model-module", "mmseg-segmentor"])
def test_official_checkpoint_loads_strictly(wrap: str, tmp_path: Path) -> None:
    state = _official_state(480, 480, 512, 150)
    if wrap == "state_dict":
        obj = {"state_dict": state}
    elif wrap == "model-module":
        obj = {"model": {f"module.{k}": v for k, v in state.items()}}
    elif wrap == "mmseg-segmentor":  # the whole EncoderDecoder: backbone + decode_head, as mmcv saves it
        obj = {"meta": {"mmseg_version": "0.x"}, "state_dict": {
            "backbone.patch_embed1.proj.weight": torch.zeros(3), **{f"decode_head.{k}": v for k, v in state.items()}}}
    else:
        obj = state
    path = tmp_path / "official.pth"
    torch.save(obj, path)
    head = unroll.load("hamnet-light-tiny", checkpoint=path)
    for k, v in state.items():
        assert torch.equal(head.state_dict()[k], v), k
    assert not head.training


def test_wrong_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    state = _official_state(480, 480, 512, 150)
    state.pop("align.gn.bias")
    state["hamburger.cheese.conv.weight"] = torch.zeros(1)
    path = tmp_path / "wrong.pth"
    torch.save({"state_dict": state}, path)
    with pytest.raises(ValueError, match=r"missing keys \['align.gn.bias'\].*unexpected keys "
                                         r"\['hamburger.cheese.conv.weight'\]"):
        unroll.load("hamnet-light-tiny", checkpoint=path)
    small = _official_state(960, 512, 512, 150)
    torch.save(small, path)
    with pytest.raises(ValueError, match="shape mismatches"):
        unroll.load("hamnet-light-tiny", checkpoint=path)
    unroll.load("hamnet-light-small", checkpoint=path)  # the same file is the small head's


def test_rand_init_false_checkpoint_brings_its_warm_bases(tmp_path: Path) -> None:
    state = _official_state(480, 480, 512, 150)
    warm = F.normalize(torch.rand(1, 480, 64), dim=1)
    torch.save({**state, "hamburger.ham.bases": warm}, tmp_path / "warm.pth")
    head = unroll.load("hamnet-light-tiny", checkpoint=tmp_path / "warm.pth")
    assert torch.equal(head.hamburger.ham.bases, warm[0])


def test_head_forward_is_the_official_composition() -> None:
    """The head against the official forward written with functional ops (mmcv ConvModule: conv → GN → ReLU)."""
    head = LightHamHead(in_channels=(16, 32), ham_channels=64, channels=32, num_classes=5).eval()
    head.load_state_dict(_official_state(48, 64, 32, 5, seed=3))
    s = head.state_dict()
    levels = [torch.rand(2, 16, 8, 10), torch.rand(2, 32, 4, 5)]

    def conv_gn(x: torch.Tensor, name: str, relu: bool) -> torch.Tensor:
        y = F.group_norm(F.conv2d(x, s[f"{name}.conv.weight"]), 32, s[f"{name}.gn.weight"], s[f"{name}.gn.bias"])
        return torch.relu(y) if relu else y

    with torch.no_grad():
        x = torch.cat([levels[0], F.interpolate(levels[1], size=(8, 10), mode="bilinear", align_corners=False)], 1)
        x = conv_gn(x, "squeeze", True)
        enjoy = torch.relu(F.conv2d(x, s["hamburger.ham_in.conv.weight"], s["hamburger.ham_in.conv.bias"]))
        enjoy = head.hamburger.ham(enjoy, bases=head.hamburger.ham.bases)
        x = torch.relu(x + conv_gn(enjoy, "hamburger.ham_out", False))
        ref = F.conv2d(conv_gn(x, "align", True), s["conv_seg.weight"], s["conv_seg.bias"])
        got = head.forward_levels(levels)
    assert got.shape == (2, 5, 8, 10)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_head_exports_with_the_default_bases(tmp_path: Path) -> None:
    from unroll.export.onnx_export import export_model

    result = export_model("hamnet-light-tiny", out_dir=tmp_path)
    rep = result.report
    assert all(c["ok"] for c in rep["parity"]["cases"]) and rep["outputs"][0]["name"] == "logits"
    head = unroll.load("hamnet-light-tiny", pretrained=False)
    x = torch.rand(2, 480, 24, 20, generator=torch.Generator().manual_seed(5))  # another H×W than traced
    got = ort.InferenceSession(str(result.onnx_path), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    with torch.no_grad():
        ref = head(x).numpy()
    assert _rel(got, ref) <= 1e-5


def test_head_with_official_random_bases_refuses_export(tmp_path: Path) -> None:
    head = unroll.load("hamnet-light-tiny", pretrained=False, bases="official-random")
    card = unroll.registry.get_spec("hamnet-light-tiny").card.model_dump()
    with pytest.raises(ExportError, match="official-random.*cannot be exported"):
        export(head, card, {"x": torch.rand(2, 480, 16, 16)}, tmp_path)


# ----------------------------------------------------------------------------------------------- the draw spread


def test_benchmark_input_is_the_golden_input(golden: dict) -> None:
    x = ham_draws.golden_input()
    assert np.array_equal(x.numpy(), golden["x"]) and ham_draws.GOLDEN_SEED == golden["meta"]["seed"]


def test_draw_spread_benchmark(tmp_path: Path) -> None:
    p = ham_draws.run(n_draws=4, calibration_inputs=2, out_dir=tmp_path)
    assert (tmp_path / "ham_draws.json").is_file()
    assert "Chosen serving default" in (tmp_path / "ham_draws.md").read_text()
    b = p["input"]["shape"][0]
    for stats in (p["draw_pairs"], p["single_draw_to_mean"]):
        assert len(stats["mean"]) == len(stats["max"]) == b
        assert all(0 < m <= mx for m, mx in zip(stats["mean"], stats["max"], strict=True))  # draws really differ
    names = [r["candidate"] for r in p["candidates"]]
    assert names[:2] == ["seeded", "per-sample"] and p["chosen"] in names
    assert all(len(r["rel_to_official_mean"]) == b and min(r["rel_to_official_mean"]) > 0 for r in p["candidates"])
    again = ham_draws.run(n_draws=4, calibration_inputs=2, out_dir=None)
    assert again["draw_pairs"] == p["draw_pairs"]  # seeded draws: reproducible


def test_serving_default_is_the_measured_choice() -> None:
    committed = json.loads(RESULTS.read_text())
    assert committed["chosen"] == DEFAULT_BASES
    assert committed["n_draws"] >= 16


def test_readme_draw_spread_table_is_generated_from_the_committed_results() -> None:
    """The docs quote the committed ham_draws.json through its generated block, never by hand."""
    for block in generated(ham_draws.README_BEGIN, ham_draws.README_END):
        assert block == ham_draws.readme_block(json.loads(RESULTS.read_text())).strip()
