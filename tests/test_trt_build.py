"""TensorRT engine builder: profiles, gate logic and the CLI here; real engines on a GPU (``gpu`` marker)."""

from __future__ import annotations

import enum
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import typer
from onnx import TensorProto, helper
from typer.testing import CliRunner
from unroll.export import gates
from unroll.export import trt_build as tb
from unroll.export.trt_cli import build

from unroll.card import InputCard, ModelCard, from_onnx

ROOT = Path(__file__).resolve().parents[1]
AVAILABLE, WHY = tb.tensorrt_available()
SIZES = ((16, 16), (256, 256), (1024, 1024))


@pytest.fixture(scope="module")
def onnx_dir(demo_onnx_dir: Path) -> Path:
    """The session's demo exports (the fp32 graphs `unroll build` reads); only read here."""
    return demo_onnx_dir


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
def test_cli_without_gpu_or_tensorrt_exits_2_with_one_sentence(onnx_dir: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "unroll.export.trt_cli", "sdnet-mnist", "--onnx-dir", str(onnx_dir)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [f"error: {WHY}"], r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_cli_help_documents_the_options() -> None:
    r = CliRunner().invoke(_app(), ["--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    for opt in ("--precision", "fp16", "int8", "--out", "--batch-max", "--min-size", "--max-size", "--workspace-gib",
                "--opt-level", "--timing-cache", "--no-verify", "strongly", "card", "unroll models"):
        assert opt in r.output, opt


@pytest.mark.parametrize("args, hint", [
    (["--precision", "fp64"], "precision"),
    (["--min-size", "16by16"], "min-size"),
    (["--batch-min", "8", "--batch-opt", "4"], "batch"),
    (["--batch-max", "2"], "batch"),  # below the card's opt batch
    (["--max-size", "8x8", "--opt-size", "8x8", "--min-size", "8x8"], "height"),  # below the card's min_size 16
    (["--max-size", "64x64"], "height"),  # below the card's opt size
    (["--opt-level", "6"], "opt-level"),
])
def test_cli_rejects_malformed_options(onnx_dir: Path, args: list[str], hint: str) -> None:
    r = CliRunner().invoke(_app(), ["csc-denoiser", "--onnx-dir", str(onnx_dir), *args], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and hint in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_cli_unknown_model_exits_1_with_one_sentence(tmp_path: Path) -> None:
    r = CliRunner().invoke(_app(), ["no-such-model", "--onnx-dir", str(tmp_path)])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit)
    assert "unroll export no-such-model" in r.stderr and "unroll models" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("name, args, batch, sizes", [
    ("csc-denoiser", [], (1, 4, 8), ((16, 16), (256, 256), (1024, 1024))),  # the card's trt_profile
    ("csc-denoiser", ["--batch-max", "16", "--max-size", "512x768"], (1, 4, 16), ((16, 16), (256, 256), (512, 768))),
    ("sdnet-mnist", ["--max-size", "64x64"], (1, 8, 32), None),  # fixed 28×28: sizes do not apply
])
def test_cli_profile_defaults_come_from_the_card(onnx_dir: Path, monkeypatch, name: str, args: list[str],
                                                 batch, sizes) -> None:
    seen = {}

    def fake_build(n, precision, **kw):
        seen.update(kw, name=n, precision=precision)
        raise tb.TrtUnavailableError("stand-in: nothing built.")

    monkeypatch.setattr(tb, "tensorrt_available", lambda: (True, "stand-in"))
    monkeypatch.setattr(tb, "build_engine", fake_build)
    r = CliRunner().invoke(_app(), [name, "--onnx-dir", str(onnx_dir), *args])
    assert r.exit_code == 2 and "stand-in: nothing built." in r.stderr
    assert seen["name"] == name and seen["batch"] == batch and seen["image_sizes"] == sizes


@pytest.mark.parametrize("precision, command", [("fp32", "unroll export sdnet-mnist"),
                                                ("fp16", "unroll quantize sdnet-mnist --precision fp16"),
                                                ("int8", "unroll quantize sdnet-mnist --precision int8")])
def test_missing_onnx_names_the_command_that_writes_it(tmp_path: Path, precision: str, command: str) -> None:
    with pytest.raises(tb.MissingOnnxError, match=command) as e:
        tb.build_engine("sdnet-mnist", precision, onnx_dir=tmp_path, out_dir=tmp_path / "trt", timing_cache=None)
    assert "\n" not in str(e.value) and not (tmp_path / "trt").exists()


def test_onnx_path_per_precision() -> None:
    assert tb.onnx_path_for("csc-denoiser", "fp32") == Path("build/onnx/csc-denoiser.onnx")
    assert tb.onnx_path_for("csc-denoiser", "int8", Path("x")) == Path("x/csc-denoiser.int8.onnx")
    with pytest.raises(ValueError, match="fp32, fp16, int8"):
        tb.onnx_path_for("csc-denoiser", "bf16")


# ------------------------------------------------------------------------------------------ profiles


def test_profile_mnist_fixed_28x28_and_lam_follows_batch(onnx_dir: Path) -> None:
    model, card = onnx.load(onnx_dir / "sdnet-mnist.onnx"), _card(onnx_dir, "sdnet-mnist")
    assert not tb.has_dynamic_image(model)
    p = tb.profile_shapes(model, card, (1, 8, 32), SIZES)  # image sizes are ignored: the resolution is fixed
    assert p == {"image": ((1, 1, 28, 28), (8, 1, 28, 28), (32, 1, 28, 28)), "lam": ((1,), (8,), (32,))}
    assert tb.profile_shapes(model, card, (2, 4, 16))["lam"] == ((2,), (4,), (16,))
    assert tb.profile_shapes(model, card)["lam"] == tuple((b,) for b in card.trt_profile.batch)


def test_profile_denoiser_dynamic_hw_and_sigma_follows_batch(onnx_dir: Path) -> None:
    model, card = onnx.load(onnx_dir / "csc-denoiser.onnx"), _card(onnx_dir, "csc-denoiser")
    assert tb.has_dynamic_image(model)
    p = tb.profile_shapes(model, card, (1, 8, 32), ((16, 24), (256, 320), (1024, 768)))
    assert p == {"noisy": ((1, 1, 16, 24), (8, 1, 256, 320), (32, 1, 1024, 768)),
                 "sigma": ((1,), (8,), (32,))}
    (b0, b1, b2), dims = card.trt_profile.batch, card.trt_profile.dims
    assert tb.profile_shapes(model, card) == {  # the card's profile
        "noisy": tuple((b, 1, dims["1"][i], dims["2"][i]) for i, b in enumerate((b0, b1, b2))),
        "sigma": ((b0,), (b1,), (b2,))}
    no_dims = card.model_copy(update={"trt_profile": card.trt_profile.model_copy(update={"dims": {}})})
    with pytest.raises(ValueError, match=r"'noisy'.*card\.trt_profile\.dims\['1'\].*image sizes"):
        tb.profile_shapes(model, no_dims, (1, 8, 32), None)


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
    with pytest.raises(ValueError, match=r"'x'.*'tokens'.*card\.trt_profile\.dims\['0'\]"):
        tb.profile_shapes(model, card)
    card = card.model_copy(update={"trt_profile": card.trt_profile.model_copy(
        update={"batch": (1, 2, 4), "dims": {"0": (16, 64, 256)}})})
    assert tb.profile_shapes(model, card) == {"x": ((1, 16, 64), (2, 64, 64), (4, 256, 64))}


# ------------------------------------------------------------------------------------------ gate logic


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
    assert len(cases) == 32 and max(len(c) for c in cases) == 32 and sum(len(c) for c in cases) == 1000
    assert source.startswith("card.data.test = mnist-test: 32 batches, 1000 samples")
    model, card = onnx.load(onnx_dir / "csc-denoiser.onnx"), _card(onnx_dir, "csc-denoiser")
    cases, source = tb.engine_gate_cases(card, tb.profile_shapes(model, card, (1, 2, 4), ((16, 16), (64, 64),
                                                                                            (200, 300))))
    assert {c.level for c in cases} == set(card.sigma.gate_levels) and "left out" not in source
    assert all(c.feeds["noisy"].shape[2] <= 200 and c.feeds["noisy"].shape[3] <= 300 for c in cases)  # cropped
    cases, source = tb.engine_gate_cases(card, tb.profile_shapes(model, card, (1, 2, 4), ((300, 300),) * 3))
    assert 0 < len(cases) < 24 and "smaller than the profile minimum left out" in source
    with pytest.raises(tb.TrtBuildError, match="none of the 24 gate cases"):
        tb.engine_gate_cases(card, tb.profile_shapes(model, card, (1, 2, 4), ((1500, 1500),) * 3))


class _OrtRunner:
    """Stands in for the engine: ONNX Runtime on the same graph, optionally perturbed."""

    def __init__(self, path: Path, noise: float = 0.0) -> None:
        self.sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.noise, self.rng = noise, np.random.default_rng(0)

    def __call__(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = self.sess.run(None, feeds)
        names = [o.name for o in self.sess.get_outputs()]
        return {n: v + self.noise * self.rng.standard_normal(v.shape).astype(np.float32)
                for n, v in zip(names, out, strict=True)}


def test_parity_check_classifier_on_mnist_digits(onnx_dir: Path) -> None:
    path, card = onnx_dir / "sdnet-mnist.onnx", _card(onnx_dir, "sdnet-mnist")
    cases, _ = tb.engine_gate_cases(card, tb.profile_shapes(onnx.load(path), card, (1, 8, 32)))
    assert np.allclose(cases[0].feeds["lam"], card.lam.default)  # the model's own λ, from the card
    same = tb.parity_check(_OrtRunner(path), path, card, cases[:2], bmin=1)
    assert same["top1_agreement"] == 1.0 and same["max_abs_diff"] == 0.0 and same["samples"] == 64
    assert same["accuracy_loss"] == 0.0 and same["accuracy_fp32"] > 0.9 and "onnxruntime" in same["reference"]
    assert gates.failures(same, card.gate("fp32")) == []
    noisy = tb.parity_check(_OrtRunner(path, noise=5.0), path, card, cases[:2], bmin=4)
    assert noisy["top1_agreement"] < 0.999 and gates.failures(noisy, card.gate("fp32"))


def test_parity_check_denoiser_psnr_at_the_gate_levels(onnx_dir: Path) -> None:
    path, card = onnx_dir / "csc-denoiser.onnx", _card(onnx_dir, "csc-denoiser")
    cases, _ = tb.engine_gate_cases(card, tb.profile_shapes(onnx.load(path), card, (1, 8, 32),
                                                            ((16, 16), (256, 256), (512, 512))))
    small = [c for c in cases if c.label.startswith("text")]
    same = tb.parity_check(_OrtRunner(path), path, card, small, bmin=2)
    assert set(same["per_sigma"]) == {"15", "25", "50"}
    assert all(r["psnr_loss_db"] == 0.0 and r["psnr_fp32"] > 20 for r in same["per_sigma"].values())
    noisy = tb.parity_check(_OrtRunner(path, noise=0.02), path, card, small)
    assert any(f.startswith("psnr_loss_db") for f in gates.failures(noisy, card.gate("int8")))


def test_parity_check_rejects_an_output_of_another_shape(onnx_dir: Path) -> None:
    path, card = onnx_dir / "sdnet-mnist.onnx", _card(onnx_dir, "sdnet-mnist")
    cases = gates.gate_cases(card, max_batch=4)[:1]
    with pytest.raises(tb.TrtBuildError, match=r"candidate output shape \(4, 9\)"):
        tb.parity_check(lambda f: {"logits": np.zeros((4, 9), np.float32)}, path, card, cases)


# ------------------------------------------------------------------------------ build flow, stand-in TensorRT


def _stand_in_tensorrt(version: str, calls: list) -> types.ModuleType:
    """The slice of the TensorRT Python API that build_engine uses, as documented, recording the calls.

    It checks this module's build flow (flags per major version, profile, config, timing cache, JSON,
    plan kept or removed) on a CPU; that the real API behaves as documented is what the gpu tests check.
    """
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version

    class ILogger:
        Severity = enum.IntEnum("Severity", "INTERNAL_ERROR ERROR WARNING INFO VERBOSE", start=0)

        def __init__(self) -> None:
            pass

    class Network:
        inputs: list[str] = []
        num_inputs = property(lambda self: len(self.inputs))

        def get_input(self, i: int) -> types.SimpleNamespace:
            return types.SimpleNamespace(name=self.inputs[i])

    class OnnxParser:
        num_errors = 0

        def __init__(self, network: Network, logger: ILogger) -> None:
            self.network = network

        def parse_from_file(self, path: str) -> bool:
            self.network.inputs = [v.name for v in tb.graph_inputs(onnx.load(path))]
            self.network.path = path
            return True

    class Config:
        def __init__(self) -> None:
            self.profiles, self.cache = [], None

        def __setattr__(self, key: str, value) -> None:
            calls.append(("config." + key, value)) if key == "builder_optimization_level" else None
            object.__setattr__(self, key, value)

        def set_memory_pool_limit(self, pool, size: int) -> None:
            calls.append(("set_memory_pool_limit", pool, size))

        def clear_flag(self, flag) -> None:
            calls.append(("clear_flag", flag))

        def add_optimization_profile(self, profile) -> int:
            self.profiles.append(profile)
            return len(self.profiles) - 1

        def create_timing_cache(self, blob: bytes) -> types.SimpleNamespace:
            calls.append(("create_timing_cache", bytes(blob)))
            return types.SimpleNamespace(serialize=lambda: b"cache v1")

        def set_timing_cache(self, cache, ignore_mismatch: bool) -> bool:
            self.cache = cache
            return True

        def get_timing_cache(self):
            return self.cache

    class Profile(dict):
        def set_shape(self, name: str, lo, mid, hi) -> None:
            self[name] = (tuple(lo), tuple(mid), tuple(hi))

    class Builder:
        def __init__(self, logger: ILogger) -> None:
            pass

        def create_network(self, flags: int = 0) -> Network:
            calls.append(("create_network", flags))
            return Network()

        create_builder_config = staticmethod(Config)
        create_optimization_profile = staticmethod(Profile)

        def build_serialized_network(self, network: Network, config: Config) -> bytes:
            calls.append(("profile", dict(config.profiles[0])))
            return network.path.encode()  # the stand-in "plan" names the graph its runner executes

    trt.ILogger, trt.OnnxParser, trt.Builder = ILogger, OnnxParser, Builder
    trt.NetworkDefinitionCreationFlag = enum.IntEnum("NetworkDefinitionCreationFlag", "EXPLICIT_BATCH STRONGLY_TYPED",
                                                     start=0)
    trt.MemoryPoolType = enum.IntEnum("MemoryPoolType", "WORKSPACE", start=0)
    trt.BuilderFlag = enum.IntEnum("BuilderFlag", "TF32", start=7)
    return trt


class _PlanRunner(_OrtRunner):
    """EngineRunner stand-in: the stand-in plan is the path of the graph to run."""

    def __init__(self, plan: bytes, noise: float = 0.0) -> None:
        super().__init__(Path(bytes(plan).decode()), noise)

    def io_info(self) -> list[dict]:
        return [{"name": i.name, "mode": "input"} for i in self.sess.get_inputs()]


@pytest.mark.parametrize("version, flags", [("10.13.3.9", 1 << 1), ("11.1.0.2", 0)])
def test_build_flow_with_a_stand_in_tensorrt(onnx_dir: Path, tmp_path: Path, monkeypatch, version: str,
                                             flags: int) -> None:
    import torch

    calls: list = []
    monkeypatch.setitem(sys.modules, "tensorrt", _stand_in_tensorrt(version, calls))
    monkeypatch.setattr(tb, "tensorrt_available", lambda: (True, "stand-in"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _d=0: "Stand-in GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d=0: (9, 0))
    real = tb.engine_gate_cases
    monkeypatch.setattr(tb, "engine_gate_cases", lambda card, profile: (real(card, profile)[0][:2], "first batches"))
    monkeypatch.setattr(tb, "EngineRunner", _PlanRunner)
    cache = tmp_path / "timing.cache"

    report = tb.build_engine("sdnet-mnist", onnx_dir=onnx_dir, out_dir=tmp_path, batch=(1, 8, 32), opt_level=4,
                             timing_cache=cache)
    assert ("create_network", flags) in calls  # STRONGLY_TYPED on 10.x; 11.x is always strongly typed
    assert ("set_memory_pool_limit", 0, 4 << 30) in calls and ("config.builder_optimization_level", 4) in calls
    assert ("clear_flag", 7) in calls and ("create_timing_cache", b"") in calls  # TF32 off; a new timing cache
    assert ("profile", {"image": ((1, 1, 28, 28), (8, 1, 28, 28), (32, 1, 28, 28)),
                        "lam": ((1,), (8,), (32,))}) in calls
    assert cache.read_bytes() == b"cache v1" and (tmp_path / "sdnet-mnist.fp32.plan").exists()
    on_disk = json.loads((tmp_path / "sdnet-mnist.fp32.json").read_text())
    assert on_disk == report and report["passed"] and report["parity"]["top1_agreement"] == 1.0
    assert report["gate"] == {"top1_agreement": 0.999, "accuracy_loss": 0.001}  # card.gate("fp32")
    assert report["card"]["name"] == "sdnet-mnist"
    assert report["gate_data"] == "first batches" and report["task"] == "classification"
    assert report["tensorrt"] == version and report["gpu"] == {"name": "Stand-in GPU", "compute_capability": "9.0"}
    assert report["profiles"][0]["lam"] == {"min": [1], "opt": [8], "max": [32]} and report["max_batch_size"] == 32

    tb.build_engine("sdnet-mnist", onnx_dir=onnx_dir, out_dir=tmp_path, timing_cache=cache)  # reuses the cache
    card_batch = _card(onnx_dir, "sdnet-mnist").trt_profile.batch
    assert calls[-1] == ("profile", {"image": tuple((b, 1, 28, 28) for b in card_batch),  # the card's batch range
                                     "lam": tuple((b,) for b in card_batch)})
    assert ("create_timing_cache", b"cache v1") in calls

    monkeypatch.setattr(tb, "EngineRunner", lambda plan: _PlanRunner(plan, noise=5.0))
    with pytest.raises(tb.GateError, match=r"top1_agreement \d+\.\d+% < 99\.90%"):
        tb.build_engine("sdnet-mnist", onnx_dir=onnx_dir, out_dir=tmp_path, timing_cache=cache)
    assert not (tmp_path / "sdnet-mnist.fp32.plan").exists()  # the earlier plan went with the failed build
    assert json.loads((tmp_path / "sdnet-mnist.fp32.json").read_text())["passed"] is False


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
