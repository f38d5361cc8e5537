"""TensorRT engine builder: profiles and dim ranges, the memory estimate, the lint, real parity gates, the CLI, and the
build flow against a stand-in generated from TensorRT's documented Python API; real engines on a GPU (``gpu``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import typer
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from unroll import gates
from unroll.app.trt_cli import build
from unroll.card import InputCard, ModelCard, from_onnx, write_to_onnx
from unroll.export import trt_build as tb
from unroll.export import trt_engine, trt_memory
from unroll.export.onnx_export import export_model
from unroll.export.quantize import to_fp16
from unroll.registry import get_spec, list_models

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trt_api  # noqa: E402 (tests/ is no package: the stand-in generator lives beside the tests)

ROOT = Path(__file__).resolve().parents[1]
AVAILABLE, WHY = tb.tensorrt_available()
SIZES = ((16, 16), (256, 256), (1024, 1024))
TRT_VERSIONS = [("10.13.3.9", 1 << 1), ("11.1.0", 0)]  # STRONGLY_TYPED = 1 in 10.x headers; 11.x passes no flag


@pytest.fixture(scope="module")
def onnx_dir(demo_onnx_dir: Path) -> Path:
    """The session's demo exports (the fp32 graphs `unroll build` reads); only read here."""
    return demo_onnx_dir


@pytest.fixture(scope="module")
def block_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Token blocks with a dynamic `tokens` axis (vars-d, dic-attn), exported once for this module (~2 s)."""
    out = tmp_path_factory.mktemp("blocks")
    for name in ("vars-d", "dic-attn"):
        export_model(name, out, naive=False)
    return out


def _card(onnx_dir: Path, name: str) -> ModelCard:
    return from_onnx(onnx_dir / f"{name}.onnx")


def _app() -> typer.Typer:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(build)
    return app


# ------------------------------------------------------------------------------------------ environment, CLI


def test_tensorrt_available_says_why_in_one_sentence() -> None:
    ok, why = tb.tensorrt_available()
    assert isinstance(ok, bool) and why and "\n" not in why
    if not ok:
        assert why.endswith(".") and ("TensorRT" in why or "GPU" in why)


@pytest.mark.skipif(AVAILABLE, reason="this machine can build engines")
def test_cli_without_gpu_or_tensorrt_prints_the_estimate_then_exits_2(onnx_dir: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "unroll.app.trt_cli", "sdnet-mnist", "--onnx-dir", str(onnx_dir)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [f"error: {WHY}"], r.stderr
    assert "Traceback" not in r.stderr
    # what needs no GPU was done first: the profile and its memory estimate
    assert "image  [1, 1, 28, 28] / [8, 1, 28, 28] / [32, 1, 28, 28]" in r.stdout, r.stdout
    assert "estimated GPU memory at the profile's max shapes" in r.stdout


def test_cli_help_documents_the_options() -> None:
    r = CliRunner().invoke(_app(), ["--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    for opt in ("--precision", "fp16", "int8", "--out", "--batch-max", "--min-size", "--max-size", "--workspace-gib",
                "--opt-level", "--timing-cache", "--no-verify", "strongly", "card", "unroll models", "--dim-range",
                "NAME=MIN:OPT:MAX", "dim_param", "INPUT[AXIS]", "trt_profile.dims", "--max-memory-gib"):
        assert opt in r.output, opt


@pytest.mark.parametrize("args, hint", [
    (["--precision", "fp64"], "precision"),
    (["--min-size", "16by16"], "min-size"),
    (["--batch-min", "8", "--batch-opt", "4"], "batch"),
    (["--batch-max", "2"], "batch"),  # below the card's opt batch
    (["--max-size", "8x8", "--opt-size", "8x8", "--min-size", "8x8"], "height"),  # below the card's min_size 16
    (["--max-size", "64x64"], "height"),  # below the card's opt size
    (["--opt-level", "6"], "opt-level"),
    (["--dim-range", "height"], "NAME=MIN:OPT:MAX"),
    (["--dim-range", "depth=1:2:3"], "dynamic axes are noisy[2], noisy[3], height, width"),
    (["--dim-range", "noisy[1]=1:1:1"], "fixed at 1"),
    (["--dim-range", "noisy[0]=1:2:3"], "batch axis"),
    (["--dim-range", "width=16:512:256"], "width (noisy[3])"),  # max < opt
    (["--dim-range", "width=8:16:64"], "16 ≤ min"),  # the card's min_size
    (["--dim-range", "height=16:64:512", "--max-size", "512x512"], "give one"),
    (["--max-memory-gib", "0"], "max-memory-gib"),
])
def test_cli_rejects_malformed_options(onnx_dir: Path, args: list[str], hint: str) -> None:
    r = CliRunner().invoke(_app(), ["csc-denoiser", "--onnx-dir", str(onnx_dir), *args], env={"COLUMNS": "300"})
    assert r.exit_code == 2 and hint in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_cli_unknown_model_exits_1_with_one_sentence(tmp_path: Path) -> None:
    r = CliRunner().invoke(_app(), ["no-such-model", "--onnx-dir", str(tmp_path)])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit)
    assert "unroll export no-such-model" in r.stderr and "unroll models" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def _fake_build(monkeypatch) -> dict:
    seen: dict = {}

    def fake_build(n, precision, **kw):
        seen.update(kw, name=n, precision=precision)
        raise tb.TrtUnavailableError("stand-in: nothing built.")

    monkeypatch.setattr(tb, "tensorrt_available", lambda: (True, "stand-in"))
    monkeypatch.setattr(tb, "build_engine", fake_build)
    return seen


@pytest.mark.parametrize("name, args, batch, ranges", [
    # the card's trt_profile
    ("csc-denoiser", [], (1, 4, 8), {"noisy[2]": (16, 256, 1024), "noisy[3]": (16, 256, 1024)}),
    ("csc-denoiser", ["--batch-max", "16", "--max-size", "512x768"], (1, 4, 16),
     {"noisy[2]": (16, 256, 512), "noisy[3]": (16, 256, 768)}),
    ("csc-denoiser", ["--dim-range", "width=16:128:640"], (1, 4, 8),
     {"noisy[2]": (16, 256, 1024), "noisy[3]": (16, 128, 640)}),
    ("sdnet-mnist", ["--max-size", "64x64"], (1, 8, 32), {}),  # fixed 28×28: sizes do not apply
])
def test_cli_profile_defaults_come_from_the_card(onnx_dir: Path, monkeypatch, name: str, args: list[str],
                                                 batch, ranges) -> None:
    seen = _fake_build(monkeypatch)
    r = CliRunner().invoke(_app(), [name, "--onnx-dir", str(onnx_dir), *args])
    assert r.exit_code == 2 and "stand-in: nothing built." in r.stderr, r.output
    assert seen["name"] == name and seen["batch"] == batch and seen["dim_ranges"] == ranges
    assert "estimated GPU memory" in r.stdout


@pytest.mark.parametrize("name", ["vars-d", "dic-attn"])
@pytest.mark.parametrize("args, tokens", [
    ([], (1, 64, 1024)),  # card.trt_profile.dims["0"]: the token axis, which the CLI used to leave without a range
    (["--dim-range", "tokens=16:64:256"], (16, 64, 256)),  # by the ONNX dim_param
    (["--dim-range", "x[1]=8:32:128"], (8, 32, 128)),  # by input and axis
])
def test_cli_token_blocks_reach_the_builder_with_token_ranges(block_dir: Path, monkeypatch, name: str,
                                                              args: list[str], tokens) -> None:
    seen = _fake_build(monkeypatch)
    r = CliRunner().invoke(_app(), [name, "--onnx-dir", str(block_dir), *args], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "stand-in: nothing built." in r.stderr, r.output
    assert seen["dim_ranges"] == {"x[1]": tokens} and seen["batch"] == (1, 8, 32)
    assert f"x  [1, {tokens[0]}, 64] / [8, {tokens[1]}, 64] / [32, {tokens[2]}, 64]" in r.stdout, r.stdout


def test_cli_unknown_dim_name_lists_the_valid_ones(block_dir: Path) -> None:
    r = CliRunner().invoke(_app(), ["vars-d", "--onnx-dir", str(block_dir), "--dim-range", "seq=1:2:3"],
                           env={"COLUMNS": "300"})
    assert r.exit_code == 2 and "no dynamic axis is called 'seq'" in r.output and "x[1], tokens" in r.output


@pytest.mark.parametrize("precision, command", [("fp32", "unroll export sdnet-mnist"),
                                                ("fp16", "unroll quantize sdnet-mnist --precision fp16"),
                                                ("int8", "unroll quantize sdnet-mnist --precision int8")])
def test_missing_onnx_names_the_command_that_writes_it(tmp_path: Path, precision: str, command: str) -> None:
    with pytest.raises(tb.MissingOnnxError, match=command) as e:
        tb.build_engine("sdnet-mnist", precision, onnx_dir=tmp_path, out_dir=tmp_path / "trt", timing_cache=None)
    assert "\n" not in str(e.value) and not (tmp_path / "trt").exists()


def test_onnx_path_per_precision() -> None:
    from unroll import artifacts

    assert artifacts.graph("csc-denoiser", "fp32") == Path("build/onnx/csc-denoiser.onnx")
    assert artifacts.graph("csc-denoiser", "int8", Path("x")) == Path("x/csc-denoiser.int8.onnx")
    with pytest.raises(ValueError, match="fp32, fp16, int8"):
        artifacts.graph("csc-denoiser", "bf16")


# ------------------------------------------------------------------------------------------ profiles


def test_profile_mnist_fixed_28x28_and_lam_follows_batch(onnx_dir: Path) -> None:
    model, card = onnx.load(onnx_dir / "sdnet-mnist.onnx"), _card(onnx_dir, "sdnet-mnist")
    assert not tb.has_dynamic_image(model) and tb.dynamic_axes(model) == {}
    p = tb.profile_shapes(model, card, (1, 8, 32), SIZES)  # image sizes are ignored: the resolution is fixed
    assert p == {"image": ((1, 1, 28, 28), (8, 1, 28, 28), (32, 1, 28, 28)), "lam": ((1,), (8,), (32,))}
    assert tb.profile_shapes(model, card, (2, 4, 16))["lam"] == ((2,), (4,), (16,))
    assert tb.profile_shapes(model, card)["lam"] == tuple((b,) for b in card.trt_profile.batch)


def test_profile_denoiser_dynamic_hw_and_sigma_follows_batch(onnx_dir: Path) -> None:
    model, card = onnx.load(onnx_dir / "csc-denoiser.onnx"), _card(onnx_dir, "csc-denoiser")
    assert tb.has_dynamic_image(model)
    assert tb.dynamic_axes(model) == {"noisy[2]": "height", "noisy[3]": "width"}
    p = tb.profile_shapes(model, card, (1, 8, 32), ((16, 24), (256, 320), (1024, 768)))
    assert p == {"noisy": ((1, 1, 16, 24), (8, 1, 256, 320), (32, 1, 1024, 768)),
                 "sigma": ((1,), (8,), (32,))}
    (b0, b1, b2), dims = card.trt_profile.batch, card.trt_profile.dims
    assert tb.profile_shapes(model, card) == {  # the card's profile
        "noisy": tuple((b, 1, dims["1"][i], dims["2"][i]) for i, b in enumerate((b0, b1, b2))),
        "sigma": ((b0,), (b1,), (b2,))}
    no_dims = card.model_copy(update={"trt_profile": card.trt_profile.model_copy(update={"dims": {}})})
    with pytest.raises(ValueError, match=r"'noisy'.*'height'.*card\.trt_profile\.dims\['1'\].*--dim-range height="):
        tb.profile_shapes(model, no_dims, (1, 8, 32), None)


def test_dim_ranges_by_dim_param_or_input_axis(onnx_dir: Path, block_dir: Path) -> None:
    model, card = onnx.load(block_dir / "vars-d.onnx"), _card(block_dir, "vars-d")
    assert tb.dynamic_axes(model) == {"x[1]": "tokens"} and tb.dim_range_names(model) == ["x[1]", "tokens"]
    assert tb.card_dim_ranges(model, card) == {"x[1]": (1, 64, 1024)}
    assert tb.profile_shapes(model, card) == {"x": ((1, 1, 64), (8, 64, 64), (32, 1024, 64))}
    for given in ({"tokens": (16, 64, 256)}, {"x[1]": [16, 64, 256]}):
        assert tb.profile_shapes(model, card, dim_ranges=given) == {"x": ((1, 16, 64), (8, 64, 64), (32, 256, 64))}
    with pytest.raises(tb.UnknownDimError, match=r"no dynamic axis is called 'seq'.*x\[1\], tokens"):
        tb.resolve_dim_ranges(model, {"seq": (1, 2, 3)})
    with pytest.raises(tb.UnknownDimError, match=r"x\[2\] is fixed at 64"):
        tb.resolve_dim_ranges(model, {"x[2]": (1, 2, 3)})
    with pytest.raises(tb.UnknownDimError, match="batch axis"):
        tb.resolve_dim_ranges(model, {"x[0]": (1, 2, 3)})
    with pytest.raises(ValueError, match="two ranges for x"):
        tb.resolve_dim_ranges(model, {"tokens": (1, 2, 3), "x[1]": (1, 2, 4)})
    with pytest.raises(ValueError, match="min ≤ opt ≤ max"):
        tb.profile_shapes(model, card, dim_ranges={"tokens": (64, 16, 256)})
    den, dcard = onnx.load(onnx_dir / "csc-denoiser.onnx"), _card(onnx_dir, "csc-denoiser")
    p = tb.profile_shapes(den, dcard, (1, 2, 4), dim_ranges={"width": (16, 64, 640)})
    assert p["noisy"] == ((1, 1, 16, 16), (2, 1, 256, 64), (4, 1, 1024, 640))  # height from the card
    with pytest.raises(ValueError, match="give one"):
        tb.profile_shapes(den, dcard, (1, 2, 4), SIZES, {"height": (16, 64, 512)})


@pytest.mark.parametrize("batch, sizes, match", [
    ((4, 2, 8), SIZES, "batch"),
    ((0, 1, 2), SIZES, "batch"),
    ((1, 8, 32), ((8, 8), (256, 256), (1024, 1024)), "height"),  # under the card's min_size
    ((1, 8, 32), ((16, 16), (256, 2048), (1024, 1024)), "width"),
])
def test_profile_rejects_inconsistent_ranges(onnx_dir: Path, batch, sizes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tb.profile_shapes(onnx.load(onnx_dir / "csc-denoiser.onnx"), _card(onnx_dir, "csc-denoiser"), batch, sizes)


def test_profile_token_axes_from_the_card() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "tokens", 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "tokens", 64])
    model = helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y]))
    card = ModelCard(name="b", task="block", input=InputCard(name="x", shape=(-1, 64)), output="y")
    with pytest.raises(ValueError, match=r"'x'.*'tokens'.*card\.trt_profile\.dims\['0'\].*--dim-range tokens="):
        tb.profile_shapes(model, card)
    assert tb.profile_shapes(model, card, (1, 2, 4), dim_ranges={"tokens": (16, 64, 256)}) == {
        "x": ((1, 16, 64), (2, 64, 64), (4, 256, 64))}
    card = card.model_copy(update={"trt_profile": card.trt_profile.model_copy(
        update={"batch": (1, 2, 4), "dims": {"0": (16, 64, 256)}})})
    assert tb.profile_shapes(model, card) == {"x": ((1, 16, 64), (2, 64, 64), (4, 256, 64))}


# ------------------------------------------------------------------------------------------ memory estimate


def test_memory_estimate_by_hand() -> None:
    """x [B,4,8,8] → Conv(8 filters 3×3, pad 1) → Relu → Conv(4 filters) → y: liveness over the node order."""
    w1 = numpy_helper.from_array(np.zeros((8, 4, 3, 3), np.float32), "w1")
    w2 = numpy_helper.from_array(np.zeros((4, 8, 3, 3), np.float16).astype(np.float32), "w2")
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="c1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["b"], name="r"),
             helper.make_node("Conv", ["b", "w2"], ["y"], name="c2", pads=[1, 1, 1, 1])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, 8, 8])], [w1, w2])
    est = trt_memory.estimate(helper.make_model(g), {"x": (16, 4, 8, 8)})
    x = y = 16 * 4 * 8 * 8 * 4
    a = b = 16 * 8 * 8 * 8 * 4
    # step c1: x, a; step r: x (no: x's last reader is c1), a, b; step c2: b, y (+ y stays to the end)
    assert est.activation_peak_bytes == max(x + a, a + b, b + y) == a + b and est.peak_node == "r"
    assert est.weights_bytes == (8 * 4 * 9 + 4 * 8 * 9) * 4 and est.io_bytes == x + y
    assert est.largest.name in ("a", "b") and est.largest.shape == (16, 8, 8, 8) and est.largest.bytes == a
    assert est.total_bytes == est.activation_peak_bytes + est.weights_bytes and est.unknown == ()
    js = est.to_json()
    assert js["total_bytes"] == est.total_bytes and js["largest_tensor"]["shape"] == [16, 8, 8, 8]
    with pytest.raises(trt_memory.MemoryBudgetError, match=r"more than --max-memory-gib 0.00001.*'a' \[16, 8, 8, 8\]"):
        trt_memory.check_budget(est, 1000, "--max-memory-gib 0.00001", "lower it")
    trt_memory.check_budget(est, est.total_bytes, "exactly enough", "")
    with pytest.raises(ValueError, match="missing"):
        trt_memory.estimate(helper.make_model(g), {})


#: Why 8 GiB: a default profile must build on a 16 GB GPU (T4, V100-16GB, A4000) next to TensorRT's default 4 GiB
#: workspace, the CUDA context and the tactic scratch; the estimate counts the unfused graph, so the engine's own
#: activation memory is lower still.
DEFAULT_PROFILE_BUDGET = 8 * trt_memory.GIB


def _profile_max_elements(name: str) -> int:
    """Elements of the card's largest input at its default profile's max (batch × the max of every axis)."""
    card = get_spec(name).card
    dims = card.trt_profile.dims
    n = card.trt_profile.batch[2]
    for i, d in enumerate(card.input.shape):
        n *= dims[str(i)][2] if str(i) in dims else d
    return n


def _weight_elements(name: str) -> int:
    """Parameters and buffers of the architecture: built on the meta device (no memory, no init) where the builder
    allows; a builder that runs a solver on its weights at init (a power iteration for the step size) is built."""
    spec = get_spec(name)
    try:
        with torch.device("meta"):
            model = spec.builder(**spec.defaults)
    except RuntimeError:  # Tensor.item() on a meta tensor: the builder computes from its weights
        model = spec.builder(**spec.defaults)
    return sum(t.numel() for t in (*model.parameters(), *model.buffers()))


def widest_of_each_family() -> list[str]:
    """One model per architecture family (the module whose builder registers it): the one with the largest input at
    its default profile's max, and of those the most weights. A family's members share a builder and differ in
    width, depth, attention or input size; the engine's memory is the activations (input-sized) plus the weights, so
    this one bounds its family (e.g. RVT-Base* of the 18 RVT graphs, SDNet-34 of the SDNets at 224², the Ham head of
    960 channels); weights are counted only among those tied on the input."""
    families: dict[str, list[str]] = {}
    for name in list_models():
        families.setdefault(get_spec(name).builder.__module__, []).append(name)
    chosen = []
    for members in families.values():
        top = max(map(_profile_max_elements, members))
        tied = [n for n in members if _profile_max_elements(n) == top]
        chosen.append(tied[0] if len(tied) == 1 else max(tied, key=_weight_elements))
    return chosen


def test_widest_of_each_family_covers_every_family_and_picks_the_widest() -> None:
    chosen = widest_of_each_family()
    modules = {get_spec(n).builder.__module__ for n in list_models()}
    assert sorted(get_spec(n).builder.__module__ for n in chosen) == sorted(modules)
    assert {"rvt-base-plus", "sdnet34-imagenet", "hamnet-light-small", "vars-d", "csc-denoiser"} <= set(chosen)


@pytest.mark.slow
def test_the_widest_default_profile_of_each_family_fits_the_budget(onnx_dir: Path, tmp_path: Path) -> None:
    """The widest model of each architecture family (:func:`widest_of_each_family`) fits its default profile in the
    budget; the rest of a family needs less."""
    rows = {}
    for name in widest_of_each_family():
        path = onnx_dir / f"{name}.onnx"
        if not path.exists():
            path = Path(export_model(name, tmp_path, naive=False, companions=False).onnx_path)
        model = onnx.load(path)
        card = from_onnx(model)
        profile = tb.profile_shapes(model, card)  # the card's profile: what `unroll build NAME` builds
        est = trt_memory.estimate(model, {n: hi for n, (_, _, hi) in profile.items()})
        rows[name] = est
        assert est.unknown == (), (name, est.unknown)
        assert 0 < est.total_bytes <= DEFAULT_PROFILE_BUDGET, (name, est.summary())
    print("\n".join(f"{n}: {e.summary()}" for n, e in rows.items()))
    # the issue's example: the denoiser's maps at batch 32 × 1024² would not fit; its card profile does
    den = onnx.load(onnx_dir / "csc-denoiser.onnx")
    big = trt_memory.estimate(den, {"noisy": (32, 1, 1024, 1024), "sigma": (32,)})
    assert big.total_bytes > DEFAULT_PROFILE_BUDGET > rows["csc-denoiser"].total_bytes


def test_cli_refuses_a_profile_over_the_memory_limit(onnx_dir: Path, monkeypatch) -> None:
    seen = _fake_build(monkeypatch)
    r = CliRunner().invoke(_app(), ["csc-denoiser", "--onnx-dir", str(onnx_dir), "--batch-max", "32",
                                    "--max-memory-gib", "4"], env={"COLUMNS": "400"})
    assert r.exit_code == 1 and not seen, r.output
    assert "--max-memory-gib 4" in r.stderr and "--batch-max" in r.stderr and "--max-size" in r.stderr
    assert "[32, 96, 520, 520]" in r.stderr  # the largest tensor, named
    monkeypatch.setattr(trt_memory, "gpu_total_bytes", lambda: (2 * trt_memory.GIB, "Stand-in 2 GB GPU"))
    r = CliRunner().invoke(_app(), ["csc-denoiser", "--onnx-dir", str(onnx_dir)], env={"COLUMNS": "400"})
    assert r.exit_code == 1 and "more than the GPU's 2.00 GiB (Stand-in 2 GB GPU)" in r.stderr and not seen
    r = CliRunner().invoke(_app(), ["csc-denoiser", "--onnx-dir", str(onnx_dir), "--max-size", "512x512"])
    assert r.exit_code == 2 and seen["dim_ranges"]["noisy[2]"] == (16, 256, 512), r.output  # fits: handed on
    assert "within the GPU's 2.00 GiB" in r.stdout


# ------------------------------------------------------------------------------------------ gates on real graphs


class _OrtRunner:
    """Stands in for the engine: ONNX Runtime on another graph (FP16, perturbed) than the reference."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        self.names = [o.name for o in self.sess.get_outputs()]

    def __call__(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.names, self.sess.run(None, feeds), strict=True))


def _largest_weight_scaled(model: onnx.ModelProto, scale: float) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    w = max(out.graph.initializer, key=lambda t: int(np.prod(t.dims)) if t.dims else 0)
    w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w) * np.float32(scale), w.name))
    return out


def _classes_swapped(model: onnx.ModelProto, a: int = 3, b: int = 5) -> onnx.ModelProto:
    """The final layer's rows of two classes swapped: an engine that mixes up two outputs."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    gemm = [n for n in out.graph.node if n.op_type == "Gemm"][-1]
    for t in out.graph.initializer:
        if t.name in gemm.input[1:]:
            arr = numpy_helper.to_array(t).copy()
            arr[[a, b]] = arr[[b, a]]
            t.CopyFrom(numpy_helper.from_array(arr, t.name))
    return out


def _measure(path: Path, candidate: onnx.ModelProto, cases) -> dict:
    card = from_onnx(path)
    return tb.parity_check(_OrtRunner(candidate), path, card, cases, bmin=1)


def test_classifier_gate_on_fp16_and_on_a_wrong_graph(onnx_dir: Path) -> None:
    path, card = onnx_dir / "sdnet-mnist.onnx", _card(onnx_dir, "sdnet-mnist")
    fp32 = onnx.load(path)
    cases, _ = tb.engine_gate_cases(card, tb.profile_shapes(fp32, card, (1, 8, 32)))
    cases = cases[:8]  # 256 test digits
    assert np.allclose(cases[0].feeds["lam"], card.lam.default)  # the model's own λ, from the card
    half = _measure(path, to_fp16(fp32), cases)
    assert 0 < half["rel_err"] < 1e-2 and half["max_abs_diff"] > 0  # a genuinely different graph…
    assert gates.failures(half, card.gate("fp16")) == []  # …inside the FP16 gate
    assert not any(f.startswith(("top1", "accuracy")) for f in gates.failures(half, card.gate("fp32")))  # no flips
    assert [f.split()[0] for f in gates.failures(half, card.gate("fp32"))] == ["rel_err"]  # but its logits drift
    assert half["samples"] == 256 and "onnxruntime" in half["reference"]
    wrong = _measure(path, _classes_swapped(fp32), cases)
    failed = gates.failures(wrong, card.gate("fp32"))
    assert wrong["top1_agreement"] < 0.9 and any(f.startswith("top1_agreement") for f in failed), failed
    assert any(f.startswith("accuracy_loss") for f in failed)


def test_denoiser_gate_on_fp16_and_on_a_perturbed_graph(onnx_dir: Path) -> None:
    path, card = onnx_dir / "csc-denoiser.onnx", _card(onnx_dir, "csc-denoiser")
    fp32 = onnx.load(path)
    cases, _ = tb.engine_gate_cases(card, tb.profile_shapes(fp32, card, (1, 8, 32), ((16, 16), (64, 64), (512, 512))))
    small = [c for c in cases if c.image == "mpl_mri"]  # a validation image, 256×256
    assert {c.level for c in small} == set(card.sigma.gate_levels)
    half = _measure(path, to_fp16(fp32), small)
    assert set(half["per_sigma"]) == {"15", "25", "50"} and half["max_abs_diff"] > 0
    assert gates.failures(half, card.gate("fp16")) == [] and gates.failures(half, card.gate("fp32")) == []
    wrong = _measure(path, _largest_weight_scaled(fp32, 1.03), small)
    failed = gates.failures(wrong, card.gate("fp32"))
    assert failed and all(f.startswith("psnr_loss_db") for f in failed), wrong


@pytest.mark.parametrize("name", ["vars-d", "dic-attn"])
def test_block_gate_is_rel_err_and_fails_for_fp16_at_fp32_and_for_a_perturbed_graph(block_dir: Path,
                                                                                     name: str) -> None:
    path, card = block_dir / f"{name}.onnx", _card(block_dir, name)
    assert card.task == "block" and set(card.gate("fp32")) == {"rel_err"}
    fp32 = onnx.load(path)
    cases, source = tb.engine_gate_cases(card, tb.profile_shapes(fp32, card))
    assert "example inputs" in source and sum(len(c) for c in cases) == 3
    same = _measure(path, fp32, cases)
    assert same["rel_err"] == 0.0 and gates.failures(same, card.gate("fp32")) == []
    half = _measure(path, to_fp16(fp32), cases)
    assert 1e-4 < half["rel_err"] < 1e-2  # measured: ~4e-4 (vars-d), ~6e-4 (dic-attn)
    assert gates.failures(half, card.gate("fp16")) == []
    assert [f.split()[0] for f in gates.failures(half, card.gate("fp32"))] == ["rel_err"]
    wrong = _measure(path, _largest_weight_scaled(fp32, 1.01), cases)
    assert wrong["rel_err"] > 1e-3 and gates.failures(wrong, card.gate("fp32"))


def test_engine_gate_uses_the_cards_tolerances(onnx_dir: Path) -> None:
    card = _card(onnx_dir, "csc-denoiser")
    assert gates.tolerances(card, "fp32") == {"psnr_loss_db": 0.01}  # card.gate("fp32"), the engine's fp32 gate
    assert gates.failures({"psnr_loss_db": 0.012, "worst_sigma": "σ=25"}, gates.tolerances(card, "fp32")) == [
        "psnr_loss_db 0.012 dB > 0.010 dB at σ=25 (over by 0.002 dB)"]
    assert gates.failures({"psnr_loss_db": 0.012}, gates.tolerances(card, "fp32", {"psnr_loss_db": 0.02})) == []


def test_failed_gate_writes_json_and_keeps_no_plan(tmp_path: Path) -> None:
    plan, tmp_plan, js = tmp_path / "m.int8.plan", tmp_path / ".m.int8.plan.partial", tmp_path / "m.int8.json"
    plan.write_bytes(b"old plan")  # a previous build's plan must not stay beside a JSON that says "failed"
    tmp_plan.write_bytes(b"new plan")
    with pytest.raises(tb.GateError, match="psnr_loss_db 0.300 dB > 0.150 dB at σ=50") as e:
        tb._finish(tmp_plan, plan, js, {"model": "m", "precision": "int8"},
                   ["psnr_loss_db 0.300 dB > 0.150 dB at σ=50 (over by 0.150 dB)"])
    assert "no plan was written" in str(e.value) and not plan.exists() and not tmp_plan.exists()
    assert json.loads(js.read_text())["passed"] is False and e.value.report["failures"]
    tmp_plan.write_bytes(b"new plan")
    tb._finish(tmp_plan, plan, js, {"model": "m", "precision": "int8"}, [])
    assert plan.read_bytes() == b"new plan" and json.loads(js.read_text())["passed"] is True


def test_engine_gate_cases_fit_the_profile(onnx_dir: Path) -> None:
    model, card = onnx.load(onnx_dir / "sdnet-mnist.onnx"), _card(onnx_dir, "sdnet-mnist")
    cases, source = tb.engine_gate_cases(card, tb.profile_shapes(model, card, (1, 8, 32)))
    assert len(cases) == 16 and max(len(c) for c in cases) == 32 and sum(len(c) for c in cases) == 500
    assert source.startswith("card.data.validation = mnist-validation: 16 batches, 500 samples")
    model, card = onnx.load(onnx_dir / "csc-denoiser.onnx"), _card(onnx_dir, "csc-denoiser")
    cases, source = tb.engine_gate_cases(card, tb.profile_shapes(model, card, (1, 2, 4), ((16, 16), (64, 64),
                                                                                            (200, 300))))
    assert {c.level for c in cases} == set(card.sigma.gate_levels) and "left out" not in source
    assert all(c.feeds["noisy"].shape[2] <= 200 and c.feeds["noisy"].shape[3] <= 300 for c in cases)  # cropped
    every = len(gates.gate_cases(card))  # validation and stress images × the gate's σ levels
    cases, source = tb.engine_gate_cases(card, tb.profile_shapes(model, card, (1, 2, 4), ((300, 300),) * 3))
    assert 0 < len(cases) < every and "smaller than the profile minimum left out" in source
    with pytest.raises(tb.TrtBuildError, match=f"none of the {every} gate cases"):
        tb.engine_gate_cases(card, tb.profile_shapes(model, card, (1, 2, 4), ((1500, 1500),) * 3))


def test_parity_check_rejects_an_output_of_another_shape(onnx_dir: Path) -> None:
    path, card = onnx_dir / "sdnet-mnist.onnx", _card(onnx_dir, "sdnet-mnist")
    cases = gates.gate_cases(card, max_batch=4)[:1]
    with pytest.raises(tb.TrtBuildError, match=r"candidate output shape \(4, 9\)"):
        tb.parity_check(lambda f: {"logits": np.zeros((4, 9), np.float32)}, path, card, cases)


# ------------------------------------------------------------------------------------------ the documented API


@pytest.mark.parametrize("version", [v for v, _ in TRT_VERSIONS])
def test_stand_in_accepts_only_the_documented_api(version: str) -> None:
    trt, seen = trt_api.make_tensorrt(version)

    class Logger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.msgs: list = []

        def log(self, severity, msg) -> None:
            self.msgs.append((severity, msg))

    builder = trt.Builder(Logger())
    config = builder.create_builder_config()
    config.set_memory_pool_limit(pool=trt.MemoryPoolType.WORKSPACE, pool_size=1 << 20)  # documented keywords
    with pytest.raises(TypeError, match="match no documented signature"):
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, size=1 << 20)  # a wrong keyword
    with pytest.raises(TypeError, match="match no documented signature"):
        config.set_timing_cache(config.create_timing_cache(b""))  # ignore_mismatch has no default
    with pytest.raises(trt_api.UndocumentedError):
        config.set_workspace_size(1 << 20)  # not in TensorRT's API
    with pytest.raises(trt_api.UndocumentedError):
        _ = trt.BuilderFlag.TF_32  # a misspelt enum member
    with pytest.raises(trt_api.UndocumentedError):
        config.max_workspace_size = 1  # gone since 10.0
    assert not hasattr(builder, "build_engine")  # probing is recorded too
    with pytest.raises(TypeError, match="No constructor"):
        trt.IBuilderConfig()
    if version.startswith("10."):
        assert int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) == 1 and trt.BuilderFlag.FP16 is not None
    else:  # TensorRT 11 removed weak typing and explicit-batch flags
        with pytest.raises(trt_api.UndocumentedError):
            _ = trt.BuilderFlag.FP16
        with pytest.raises(trt_api.UndocumentedError):
            _ = trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH
        with pytest.raises(trt_api.UndocumentedError):
            config.int8_calibrator = None
        assert int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) == 0
    assert trt.BuilderFlag.TF32 in list(trt.BuilderFlag)  # 11.x keeps TF32
    assert {u.split(".")[-1] for u in seen.undocumented} >= {"set_workspace_size", "TF_32", "build_engine"}
    assert ("IBuilderConfig.set_memory_pool_limit", {"pool": trt.MemoryPoolType.WORKSPACE, "pool_size": 1 << 20}) \
        in seen.calls


def test_fixture_names_its_sources_and_the_simulators_follow_it() -> None:
    fx = trt_api.load_fixture()
    for major in fx["versions"]:
        api = trt_api.surface(major)
        for cname, spec in api["classes"].items():
            assert spec["source"] in fx["sources"] and spec["doc"] in fx["sources"], cname
        for ename, spec in api["enums"].items():
            assert spec["source"] in fx["sources"] and spec["members"], ename
    for src in fx["sources"].values():
        assert src["url"] and src["tensorrt"] and src["what"]
    ten = trt_api.surface("10")
    # every method a simulator implements is documented, with the documented parameter names
    for cname, sim in {**trt_api.SIMULATORS, **trt_api.HANDED_OUT}.items():
        spec = ten["classes"][cname]
        for name, fn in vars(sim).items():
            if name.startswith("_") or not callable(fn):
                continue
            assert name in spec.get("methods", {}), f"{cname}.{name} is simulated but not documented"
            params = [p for p in list(__import__("inspect").signature(fn).parameters)[1:]]
            assert any(params == [p.rstrip("=") for p in o] for o in spec["methods"][name]), (cname, name, params)


# ------------------------------------------------------------------------------ build flow, generated stand-in


@pytest.fixture
def stand_in(monkeypatch, tmp_path: Path):
    """``make(version, perturb=None)`` installs a generated stand-in `tensorrt` and a stand-in GPU; returns what it
    records."""
    import torch

    for module in (tb, trt_engine):  # what the CLI asks, and what require_tensorrt asks
        monkeypatch.setattr(module, "tensorrt_available", lambda: (True, "stand-in"))
    monkeypatch.setattr(tb, "ENGINE_DEVICE", "cpu")  # host buffers: the stand-in engine reads them by address
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _d=0: "Stand-in GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d=0: (9, 0))
    monkeypatch.setattr(trt_memory, "gpu_total_bytes", lambda: (16 * trt_memory.GIB, "Stand-in GPU"))

    def make(version: str, perturb=None) -> trt_api.StandIn:
        module, seen = trt_api.make_tensorrt(version, perturb=perturb, workdir=tmp_path)
        monkeypatch.setitem(sys.modules, "tensorrt", module)
        return seen

    return make


@pytest.mark.parametrize("version, flags", TRT_VERSIONS)
def test_build_flow_against_the_documented_api(onnx_dir: Path, tmp_path: Path, monkeypatch, stand_in,
                                               version: str, flags: int) -> None:
    seen = stand_in(version)
    real = tb.engine_gate_cases
    monkeypatch.setattr(tb, "engine_gate_cases", lambda card, profile: (real(card, profile)[0][:2], "first batches"))
    cache = tmp_path / "timing.cache"
    out = tmp_path / "trt"

    report = tb.build_engine("sdnet-mnist", onnx_dir=onnx_dir, out_dir=out, batch=(1, 8, 32), opt_level=4,
                             timing_cache=cache)
    assert seen.undocumented == []
    assert seen.called("Builder.create_network") == [{"flags": flags}]  # STRONGLY_TYPED on 10.x; none on 11.x
    wp = trt_api.surface(version.split(".")[0])  # what was passed is what the documented enums hold
    assert seen.called("IBuilderConfig.set_memory_pool_limit")[0]["pool_size"] == 4 << 30
    assert seen.called("IBuilderConfig.set_memory_pool_limit")[0]["pool"].name == "WORKSPACE"
    assert seen.called("IBuilderConfig.builder_optimization_level=") == [{"value": 4}]
    assert [a["flag"].name for a in seen.called("IBuilderConfig.clear_flag")] == ["TF32"] and "TF32" in \
        wp["enums"]["BuilderFlag"]["members"]
    assert seen.called("IOptimizationProfile.set_shape") == [
        {"input": "image", "min": (1, 1, 28, 28), "opt": (8, 1, 28, 28), "max": (32, 1, 28, 28)},
        {"input": "lam", "min": (1,), "opt": (8,), "max": (32,)}]
    assert seen.called("IBuilderConfig.create_timing_cache") == [{"serialized_timing_cache": b""}]
    assert seen.called("IBuilderConfig.set_timing_cache")[0]["ignore_mismatch"] is False
    assert seen.called("IExecutionContext.execute_async_v3") == [{"stream_handle": 0}] * 2  # two gate batches
    assert cache.read_bytes().startswith(b"unroll-standin-timing-cache " + version.encode())
    on_disk = json.loads((out / "sdnet-mnist.fp32.json").read_text())
    assert on_disk == report and report["passed"] and (out / "sdnet-mnist.fp32.plan").exists()
    assert report["parity"]["top1_agreement"] == 1.0 and report["parity"]["max_abs_diff"] == 0.0
    assert report["gate"] == {"top1_agreement": 0.999, "accuracy_loss": 0.001, "rel_err": 1e-4}  # card.gate("fp32")
    assert report["tensorrt"] == version and report["gpu"] == {"name": "Stand-in GPU", "compute_capability": "9.0"}
    assert report["profiles"][0]["lam"] == {"min": [1], "opt": [8], "max": [32]} and report["max_batch_size"] == 32
    assert report["io"] == [{"name": "image", "mode": "input", "dtype": "float32", "shape": [-1, 1, 28, 28]},
                            {"name": "lam", "mode": "input", "dtype": "float32", "shape": [-1]},
                            {"name": "logits", "mode": "output", "dtype": "float32", "shape": [-1, 10]},
                            {"name": "solver_fit", "mode": "output", "dtype": "float32", "shape": [-1, 2]}]  # ood
    assert report["lint"] == {"checker": "unroll.export.trt_lint", "issues": []}
    assert report["memory"]["input_shapes"] == {"image": [32, 1, 28, 28], "lam": [32]}
    assert 0 < report["memory"]["total_bytes"] < report["memory"]["budget"]["bytes"] == 16 * trt_memory.GIB

    tb.build_engine("sdnet-mnist", onnx_dir=onnx_dir, out_dir=out, timing_cache=cache)  # reuses the cache
    assert seen.called("IBuilderConfig.create_timing_cache")[-1]["serialized_timing_cache"] == cache.read_bytes()
    card_batch = _card(onnx_dir, "sdnet-mnist").trt_profile.batch
    assert seen.called("IOptimizationProfile.set_shape")[-1] == {"input": "lam", **dict(zip(
        ("min", "opt", "max"), ((b,) for b in card_batch), strict=True))}
    assert seen.undocumented == []


@pytest.mark.parametrize("version, flags", TRT_VERSIONS)
def test_a_block_engine_builds_with_its_token_profile_and_a_wrong_one_fails_its_gate(block_dir: Path, tmp_path: Path,
                                                                                      stand_in, version: str,
                                                                                      flags: int) -> None:
    seen = stand_in(version)
    out = tmp_path / "trt"
    report = tb.build_engine("vars-d", onnx_dir=block_dir, out_dir=out, timing_cache=None,
                             dim_ranges={"tokens": (16, 64, 256)})
    assert seen.undocumented == [] and report["passed"] and report["task"] == "block"
    assert report["gate"] == {"rel_err": 1e-4} and report["parity"]["rel_err"] == 0.0
    assert seen.called("IOptimizationProfile.set_shape") == [
        {"input": "x", "min": (1, 16, 64), "opt": (8, 64, 64), "max": (32, 256, 64)}]
    assert report["memory"]["input_shapes"] == {"x": [32, 256, 64]}

    seen = stand_in(version, perturb=lambda m: _largest_weight_scaled(m, 1.01))  # an engine computing something else
    with pytest.raises(tb.GateError, match=r"rel_err \d\.\d\de-0[23] > 1\.00e-04") as e:
        tb.build_engine("vars-d", onnx_dir=block_dir, out_dir=out, timing_cache=None)
    assert not (out / "vars-d.fp32.plan").exists()  # the earlier plan went with the failed build
    assert json.loads((out / "vars-d.fp32.json").read_text())["passed"] is False
    assert e.value.report["failures"][0].startswith("rel_err") and seen.undocumented == []


def test_a_wrong_classifier_engine_fails_its_gate(onnx_dir: Path, tmp_path: Path, monkeypatch, stand_in) -> None:
    stand_in("11.1.0", perturb=_classes_swapped)
    real = tb.engine_gate_cases
    monkeypatch.setattr(tb, "engine_gate_cases", lambda card, profile: (real(card, profile)[0][:4], "first batches"))
    with pytest.raises(tb.GateError, match=r"top1_agreement \d+\.\d+% < 99\.90%"):
        tb.build_engine("sdnet-mnist", onnx_dir=onnx_dir, out_dir=tmp_path, timing_cache=None)
    assert not (tmp_path / "sdnet-mnist.fp32.plan").exists()


@pytest.mark.parametrize("mutation, error", [
    # what the builder would do wrong, and how the documented API answers
    (lambda trt: 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH), trt_api.UndocumentedError),  # 11.x: gone
    (lambda trt: int(trt.NetworkDefinitionCreationFlag.STRONG_TYPED), trt_api.UndocumentedError),  # misspelt
], ids=["EXPLICIT_BATCH on 11.x", "misspelt STRONGLY_TYPED"])
def test_the_stand_in_catches_a_builder_that_leaves_the_documented_api(onnx_dir: Path, tmp_path: Path, monkeypatch,
                                                                       stand_in, mutation, error) -> None:
    seen = stand_in("11.1.0")
    monkeypatch.setattr(tb, "_network_flags", mutation)
    with pytest.raises(error):
        tb.build_engine("sdnet-mnist", onnx_dir=onnx_dir, out_dir=tmp_path, timing_cache=None)
    assert seen.undocumented


def test_the_stand_in_catches_a_wrong_keyword(onnx_dir: Path, tmp_path: Path, monkeypatch, stand_in) -> None:
    seen = stand_in("10.13.3.9")

    def load_with_a_typo(config, path):
        cache = config.create_timing_cache(b"")
        config.set_timing_cache(cache, ignore_mismatches=False)  # the documented keyword is ignore_mismatch
        return cache, "new"

    monkeypatch.setattr(tb, "_load_timing_cache", load_with_a_typo)
    with pytest.raises(TypeError, match="ignore_mismatches"):
        tb.build_engine("sdnet-mnist", onnx_dir=onnx_dir, out_dir=tmp_path, timing_cache=tmp_path / "c")
    assert seen.undocumented == ["IBuilderConfig.set_timing_cache(call matching no documented signature)"]


def test_lint_runs_before_tensorrt_sees_the_graph(onnx_dir: Path, tmp_path: Path, stand_in) -> None:
    seen = stand_in("10.13.3.9")
    src = tmp_path / "onnx"
    src.mkdir()
    model = onnx.load(onnx_dir / "sdnet-mnist.onnx")
    relu = next(n for n in model.graph.node if n.op_type == "Relu")
    relu.domain, relu.op_type = "com.example", "FancyRelu"  # a custom op: TensorRT would need a plugin
    model.opset_import.add(domain="com.example", version=1)
    write_to_onnx(model, from_onnx(onnx_dir / "sdnet-mnist.onnx"))
    onnx.save(model, src / "sdnet-mnist.onnx")
    with pytest.raises(tb.LintError, match="breaks 1 TensorRT ONNX parser rule") as e:
        tb.build_engine("sdnet-mnist", onnx_dir=src, out_dir=tmp_path / "trt", timing_cache=None, verify=False)
    assert len(e.value.issues) == 1 and relu.name in e.value.issues[0] and "FancyRelu" in e.value.issues[0]
    assert relu.name in str(e.value) and seen.calls == []  # TensorRT was not touched
    r = CliRunner().invoke(_app(), ["sdnet-mnist", "--onnx-dir", str(src), "--no-verify"], env={"COLUMNS": "300"})
    assert r.exit_code == 1 and relu.name in r.stderr and "FancyRelu" in r.stderr, r.output


def test_memory_budget_is_checked_before_tensorrt_is_touched(onnx_dir: Path, tmp_path: Path, stand_in) -> None:
    seen = stand_in("11.1.0")
    with pytest.raises(tb.ProfileMemoryError, match=r"more than --max-memory-gib 0\.5.*--batch-max.*--max-size"):
        tb.build_engine("csc-denoiser", onnx_dir=onnx_dir, out_dir=tmp_path, timing_cache=None, max_memory_gib=0.5)
    assert seen.calls == []


def test_cli_builds_a_token_block_through_the_stand_in(block_dir: Path, tmp_path: Path, stand_in) -> None:
    seen = stand_in("11.1.0")
    r = CliRunner().invoke(_app(), ["dic-attn", "--onnx-dir", str(block_dir), "--out", str(tmp_path),
                                    "--no-timing-cache", "--dim-range", "tokens=16:64:256"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "dic-attn.fp32.json").read_text())
    assert report["profiles"] == [{"x": {"min": [1, 16, 64], "opt": [8, 64, 64], "max": [32, 256, 64]}}]
    assert report["passed"] and "rel_err" in report["parity"] and seen.undocumented == []
    assert "passed its gate" in r.stdout


# ------------------------------------------------------------------------------------------ on a GPU

gpu = pytest.mark.skipif(not AVAILABLE, reason=WHY)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["sdnet-mnist", "csc-denoiser"])
def test_fp32_engine_builds_and_matches_onnxruntime(onnx_dir: Path, tmp_path: Path, name: str) -> None:
    sizes = ((16, 16), (256, 256), (768, 768))
    report = tb.build_engine(name, "fp32", onnx_dir=onnx_dir, out_dir=tmp_path, batch=(1, 8, 32), image_sizes=sizes,
                             workspace_gib=2.0, timing_cache=tmp_path / "timing.cache")
    plan, js = tmp_path / f"{name}.fp32.plan", tmp_path / f"{name}.fp32.json"
    assert plan.exists() and js.exists() and (tmp_path / "timing.cache").stat().st_size > 0
    on_disk = json.loads(js.read_text())
    assert on_disk["passed"] is True and on_disk["plan_bytes"] == plan.stat().st_size
    assert on_disk["tensorrt"].split(".")[0] in {"10", "11"} and on_disk["gpu"]["compute_capability"]
    assert on_disk["profiles"][0] == {n: {"min": list(a), "opt": list(b), "max": list(c)}
                                      for n, (a, b, c) in tb.profile_shapes(onnx.load(onnx_dir / f"{name}.onnx"),
                                                                            _card(onnx_dir, name), (1, 8, 32),
                                                                            sizes).items()}
    assert on_disk["memory"]["budget"]["source"].startswith("the GPU's")
    parity = report["parity"]
    if name == "sdnet-mnist":
        assert parity["samples"] == 1000 and parity["top1_agreement"] >= 0.999
    else:
        assert set(parity["per_sigma"]) == {"15", "25", "50"}
        assert all(r["psnr_loss_db"] <= 0.01 for r in parity["per_sigma"].values())
    assert parity["max_abs_diff"] < 1e-2
    # the runner on its own, at a batch and size inside the profile
    feeds = ({"image": np.random.default_rng(0).random((5, 1, 28, 28), np.float32),
              "lam": np.full(5, 0.1, np.float32)} if name == "sdnet-mnist" else
             {"noisy": np.random.default_rng(0).random((3, 1, 40, 56), np.float32),
              "sigma": np.array([0.05, 0.1, 0.2], np.float32)})
    got = tb.run_engine(plan, feeds)
    ref = ort.InferenceSession(str(onnx_dir / f"{name}.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    (out,) = got.values()
    assert out.shape == ref.shape and np.max(np.abs(out - ref)) < 1e-2


@pytest.mark.gpu
@gpu
def test_token_block_engine_passes_its_rel_err_gate(block_dir: Path, tmp_path: Path) -> None:
    report = tb.build_engine("vars-d", "fp32", onnx_dir=block_dir, out_dir=tmp_path, timing_cache=None,
                             dim_ranges={"tokens": (16, 64, 256)}, workspace_gib=2.0)
    assert report["passed"] and report["parity"]["rel_err"] <= 1e-4
    assert report["profiles"][0]["x"]["max"] == [32, 256, 64]
