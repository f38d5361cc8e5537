"""FP16 / INT8 behind accuracy gates, and the one gate implementation (unroll.gates) they use."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from unroll import data, gates
from unroll.card import DataCard, InputCard, ModelCard, from_onnx, write_to_onnx
from unroll.errors import GateFailed, LintError
from unroll.export import quantize as quantize_module
from unroll.export.quantize import calibration_inputs, quantize
from unroll.export.trt_lint import lint

DEMOS = ("sdnet-mnist", "csc-denoiser")


@pytest.fixture(scope="module")
def onnx_dir(demo_onnx_dir: Path, tmp_path_factory) -> Path:
    """A private copy of the demo exports: quantize writes NAME.<precision>.onnx beside them."""
    d = tmp_path_factory.mktemp("q")
    for f in demo_onnx_dir.iterdir():
        shutil.copy(f, d / f.name)
    return d


@pytest.fixture(scope="module")
def cards(onnx_dir: Path) -> dict[str, ModelCard]:
    return {n: from_onnx(onnx_dir / f"{n}.onnx") for n in (*DEMOS, "sdnet-mnist-autolam")}


# ----------------------------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("name", DEMOS)
def test_fp16_passes_gate_with_fp32_io_and_carries_the_card(onnx_dir, cards, name: str) -> None:
    r = quantize(name, "fp16", onnx_dir)
    assert r["passed"] and not r["failures"]
    model = onnx.load(onnx_dir / f"{name}.fp16.onnx")
    assert all(i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT for i in model.graph.input)
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in model.graph.initializer)
    _same_card_with_its_own_ood_rule(from_onnx(model), cards[name], r, "fp16")  # build and repo read it here
    assert r["card"]["name"] == name and r["gate"] == cards[name].gate("fp16")
    assert r["trt_lint"]["ok"] and lint(model) == []  # TensorRT parses the FP16 graph too: it is linted
    if name == "sdnet-mnist":
        assert r["metrics"]["top1_agreement"] >= 0.999 and r["metrics"]["n"] == data.MNIST_VALIDATION
        assert r["metrics"]["accuracy_fp32"] > 0.95 and r["test"]["metrics"]["n"] == 1000  # test: reported only
    else:
        assert set(r["metrics"]["per_sigma"]) == {"15", "25", "50"}
        n = len(data.DENOISE_VALIDATION_IMAGES) + len(data.dataset("denoise-stress").load())  # the patterns too
        assert all(v["psnr_loss_db"] <= 0.02 and v["images"] == n for v in r["metrics"]["per_sigma"].values())
        assert r["metrics"]["psnr_loss_db_worst"] <= 0.02 and len(r["test"]["metrics"]["per_image"]) == 8


def _same_card_with_its_own_ood_rule(got: ModelCard, fp32: ModelCard, report: dict, precision: str) -> None:
    """The quantized graph carries the FP32 graph's card, except that a calibrated out-of-distribution rule keeps
    its signals, sides and weights and is measured again on the quantized graph's own outputs."""
    assert got.model_copy(update={"ood": fp32.ood}) == fp32
    if fp32.ood is None or not fp32.ood.calibrated:
        assert got.ood == fp32.ood and "ood" not in report
        return
    shape = [(t.signal, t.sided, t.weight) for t in fp32.ood.terms]
    assert [(t.signal, t.sided, t.weight) for t in got.ood.terms] == shape and got.ood.measured_on == precision
    assert fp32.ood.measured_on == "fp32" and got.ood.quantile == fp32.ood.quantile
    ood = report["ood"]
    assert ood["threshold"] == got.ood.threshold and ood["threshold_fp32"] == fp32.ood.threshold
    assert ood["samples"] == data.MNIST_VALIDATION and ood["verdict_agreement"] >= 0.98, ood
    assert ood["flagged"] == pytest.approx(1 - got.ood.quantile, abs=0.01), ood  # its own quantile of its own scores


def _crops(monkeypatch, side: int = 160) -> None:
    """The denoiser's validation/stress/test sets as a few centre crops: the INT8 search tries ten placements."""
    keep = {"denoise-validation": ("sklearn_china", "mpl_mri"),
            "denoise-stress": ("shepp_logan_phantom", "checkerboard"), "denoise-test": ("camera", "brick")}
    for ds_id, names in keep.items():
        full = data.dataset(ds_id)

        def load(f=full, n=names):
            return {k: gates._center_crop(v, (side, side)) for k, v in f.load().items() if k in n}

        monkeypatch.setitem(data.DATASETS, ds_id, data.Dataset(ds_id, "images", full.description, load))


@pytest.mark.slow
@pytest.mark.parametrize("name", DEMOS)
def test_int8_explicit_qdq_passes_gate(onnx_dir, cards, name: str, monkeypatch) -> None:
    if name == "csc-denoiser":
        _crops(monkeypatch)
    r = quantize(name, "int8", onnx_dir, calib=256 if name == "sdnet-mnist" else 32)
    assert r["passed"], r["failures"]
    model = onnx.load(onnx_dir / f"{name}.int8.onnx")
    _same_card_with_its_own_ood_rule(from_onnx(model), cards[name], r, "int8")
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("QuantizeLinear") > 0 and ops.count("DequantizeLinear") > 0
    inits = {t.name: t for t in model.graph.initializer}
    per_channel = False
    for n in model.graph.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear") and len(n.input) > 2 and n.input[2] in inits:
            zp = numpy_helper.to_array(inits[n.input[2]])
            assert zp.dtype == np.int8 and not zp.any(), "symmetric: zero point 0, int8"
            per_channel |= numpy_helper.to_array(inits[n.input[1]]).size > 1
    assert per_channel, "weights are quantized per channel"
    assert r["trt_lint"]["ok"] and lint(model) == [] and r["trt_lint"]["operator_table"]["tensorrt"] == "10.15"
    assert r["calibration"]["onnxruntime_extra_options"]["AddQDQPairToWeight"] is True
    # TensorRT's Q/DQ placement: a dedicated Q→DQ pair on each input of an INT8 layer and nowhere else (no
    # quantized outputs, no residual Sub/Add reading a rounded copy), weights FP32 behind their own pair
    assert r["calibration"]["qdq_style"] == "dedicated", r["chosen"]  # measured: both demos pass with it
    producers = {o: n for n in model.graph.node for o in n.output}
    for dq in (n for n in model.graph.node if n.op_type == "DequantizeLinear"):
        readers = [n.op_type for n in model.graph.node if dq.output[0] in n.input]
        assert readers in (["Conv"], ["ConvTranspose"], ["Gemm"], ["MatMul"]), (dq.name, readers)
        assert producers[dq.input[0]].op_type == "QuantizeLinear", dq.name
    dq_outputs = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    assert not dq_outputs & {o.name for o in model.graph.output}  # the model's output is never rounded to INT8
    # The kept placement is the first with the safety margin (or the report says none had it).
    margins = [t["margin"] for t in r["tries"]]
    k = next(i for i, t in enumerate(r["tries"]) if t["config"] == r["chosen"])
    assert margins[k] >= 0.2 or r["notes"], (r["chosen"], margins)
    first_try = next(i for i, t in enumerate(r["tries"]) if t["fp32_nodes"] == r["tries"][k]["fp32_nodes"])
    assert all(m < 0.2 for m in margins[:first_try]), "an earlier placement already had the margin"
    assert r["tries"][0]["qdq"] == "dedicated"  # TensorRT's recommended Q/DQ placement is tried first
    role = "calibration" if cards[name].data.calibration else "train"  # the denoiser's adds synthetic patterns
    assert f"card.data.{role} = " in r["calibration"]["source"], r["calibration"]["source"]
    if name == "sdnet-mnist":
        assert r["metrics"]["top1_agreement"] >= 0.995 and r["metrics"]["accuracy_loss"] <= 0.003
    else:
        assert all(v["psnr_loss_db"] <= 0.15 for v in r["metrics"]["per_sigma"].values())
        assert r["metrics"]["psnr_loss_db_worst"] <= 0.15  # on every validation and stress image


def test_a_graph_failing_the_trt_lint_is_not_written_and_names_the_nodes(onnx_dir, monkeypatch) -> None:
    """Asymmetric INT8 activations (a zero point other than 0) pass ONNX Runtime's gate but not TensorRT."""
    monkeypatch.setattr(quantize_module, "TRT_QDQ_OPTIONS",
                        {**quantize_module.TRT_QDQ_OPTIONS, "ActivationSymmetric": False})
    with pytest.raises(LintError, match=r"sdnet-mnist int8 \(.*\) fails the TensorRT lint:\nTensorRT 10\.15 "
                                        r"would reject:\n  node '.*QuantizeLinear' \(QuantizeLinear\): "
                                        r"zero point .* is not 0"):
        quantize("sdnet-mnist", "int8", onnx_dir, calib=32)
    assert not (onnx_dir / "sdnet-mnist.int8.onnx").exists()
    report = json.loads((onnx_dir / "sdnet-mnist.int8.report.json").read_text())
    assert not report["trt_lint"]["ok"] and all("is not 0" in i for i in report["trt_lint"]["issues"])


def test_failed_gate_writes_no_artifact_and_says_why(onnx_dir) -> None:
    with pytest.raises(GateFailed, match=r"psnr_loss_db -?\d\.\d{3} dB > -1\.000 dB at σ=\d+ \(over by \d\.\d{3} dB\)"):
        quantize("csc-denoiser", "fp16", onnx_dir, gates={"psnr_loss_db": -1.0})
    assert not (onnx_dir / "csc-denoiser.fp16.onnx").exists()


@pytest.mark.parametrize("gates_, match", [({"agreement": 0.9}, "unknown gate metric 'agreement'"),
                                           ({"psnr_loss_db": 0.1}, "does not apply to sdnet-mnist")])
def test_gate_overrides_are_checked(onnx_dir, gates_: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        quantize("sdnet-mnist", "fp16", onnx_dir, gates=gates_)


def test_cli_gate_failure_exits_nonzero_with_the_metric(onnx_dir) -> None:
    r = subprocess.run([sys.executable, "-m", "unroll.app.cli", "quantize", "sdnet-mnist", "--precision", "fp16",
                        "--out", str(onnx_dir), "--min-agreement", "1.01"], capture_output=True, text=True)
    assert r.returncode != 0 and "agreement" in r.stderr and "Traceback" not in r.stderr


def test_calibration_never_uses_the_gate_data(cards) -> None:
    card = cards["sdnet-mnist"]
    gate = np.concatenate([c.feeds["image"] for c in gates.gate_cases(card)]).reshape(-1, 784)
    feeds = calibration_inputs(card, 256)
    calib = np.concatenate([f["image"] for f in feeds]).reshape(-1, 784)
    assert len(calib) == 256 and np.allclose(np.concatenate([f["lam"] for f in feeds]), card.lam.default)
    gate_rows = {g.tobytes() for g in gate}
    assert not any(c.tobytes() in gate_rows for c in calib)


def test_denoiser_calibration_is_noisy_training_patches(cards) -> None:
    card = cards["csc-denoiser"]
    feeds = calibration_inputs(card, 20)
    assert len(feeds) == 20 and all(f["noisy"].shape == (1, 1, 96, 96) for f in feeds)
    sig = np.array([f["sigma"][0] for f in feeds]) * card.sigma.scale
    assert sig.min() >= 0 and sig.max() <= 55 and sig.std() > 5


def test_a_model_without_data_names_the_card_field(onnx_dir, cards, tmp_path) -> None:
    bare = cards["sdnet-mnist"].model_copy(update={"data": DataCard()})
    with pytest.raises(ValueError, match=r"card\.data\.train"):
        calibration_inputs(bare, 8)
    model = onnx.load(onnx_dir / "sdnet-mnist.onnx")
    write_to_onnx(model, bare)
    onnx.save(model, tmp_path / "sdnet-mnist.onnx")
    with pytest.raises(ValueError, match=r"card\.data\.test"):
        quantize("sdnet-mnist", "fp16", tmp_path)


# ----------------------------------------------------------------------------------------------- gates


def test_tolerances_merge_task_defaults_card_overrides_and_arguments(cards) -> None:
    card = cards["sdnet-mnist"].model_copy(update={"gates": {"int8": {"top1_agreement": 0.99}}})
    assert gates.tolerances(card, "int8") == {"top1_agreement": 0.99, "accuracy_loss": 0.003}
    assert gates.tolerances(card, "fp16") == {"top1_agreement": 0.999, "accuracy_loss": 0.001}
    assert gates.tolerances(card, "int8", {"accuracy_loss": 0.01}) == {"top1_agreement": 0.99, "accuracy_loss": 0.01}
    assert gates.tolerances(cards["sdnet-mnist-autolam"], "fp32") == {"rel_err": 1e-4}
    with pytest.raises(ValueError, match="known: top1_agreement, accuracy_loss, psnr_loss_db, psnr_loss_db_worst, "
                                         "rel_err"):
        gates.tolerances(card, "int8", {"psnr": 1.0})


def _flip(logits: np.ndarray, every: int) -> np.ndarray:
    """Logits whose top-1 class changes on every ``every``-th sample."""
    out = logits.copy()
    rows = np.arange(0, len(out), every)
    out[rows] = np.roll(out[rows], 1, axis=1)
    return out


def test_a_candidate_that_flips_labels_fails_top1_agreement(onnx_dir, cards) -> None:
    card = cards["sdnet-mnist"]
    cases = gates.gate_cases(card)  # the validation digits: choices are made there, the test set is reported
    assert sum(len(c) for c in cases) == data.MNIST_VALIDATION and all(c.labels is not None for c in cases)
    assert all(np.all(c.feeds["lam"] == card.lam.default) for c in cases)
    run = gates.onnxruntime_run(onnx_dir / "sdnet-mnist.onnx", card.output)
    refs = gates.reference_outputs(cases, run)
    same = gates.evaluate(card, cases, refs, run, card.gate("int8"))
    assert same.passed and same.metrics["top1_agreement"] == 1.0 and same.margin == pytest.approx(1.0)
    flipped = gates.evaluate(card, cases, refs, lambda f: _flip(run(f), 50), card.gate("int8"))
    agreement = flipped.metrics["top1_agreement"]
    assert agreement == pytest.approx(0.98, abs=1e-3)  # 10 of 500 (5 per batch of 250)
    assert not flipped.passed and flipped.margin < 0
    short = 100 * (0.995 - agreement)
    assert flipped.failures[0] == f"top1_agreement {100 * agreement:.2f}% < 99.50% (short by {short:.2f}%)"
    assert flipped.failures[1].startswith("accuracy_loss ") and "> 0.30 points (over by" in flipped.failures[1]


def test_failures_and_margin_by_the_metric_table() -> None:
    tol = {"top1_agreement": 0.995, "accuracy_loss": 0.003}
    assert gates.failures({"top1_agreement": 0.996, "accuracy_loss": 0.002}, tol) == []
    assert gates.margin({"top1_agreement": 0.999, "accuracy_loss": 0.0}, tol) == pytest.approx(0.8)
    assert gates.failures({"top1_agreement": 0.996}, tol) == [] and gates.unmeasured({"top1_agreement": 1}, tol) == [
        "accuracy_loss"]  # no labels: agreement only, and the report says what was not measured
    bad = gates.failures({"psnr_loss_db": 0.3, "worst_sigma": "σ=50"}, {"psnr_loss_db": 0.15})
    assert bad == ["psnr_loss_db 0.300 dB > 0.150 dB at σ=50 (over by 0.150 dB)"]
    assert gates.failures({"rel_err": 2e-4, "finite": False}, {"rel_err": 1e-4}) == [
        "rel_err 2.00e-04 > 1.00e-04 (over by 1.00e-04)", "the candidate produced NaN or Inf"]
    assert gates.failures({"rel_err": float("nan")}, {"rel_err": 1.0})  # NaN never passes
    assert gates.margin({"rel_err": 0.5e-4}, {"rel_err": 1e-4}) == pytest.approx(0.5)
    assert gates.margin({"rel_err": 0.0, "finite": False}, {"rel_err": 1e-4}) == -math.inf
    assert set(gates.METRICS) == {"top1_agreement", "accuracy_loss", "psnr_loss_db", "psnr_loss_db_worst", "rel_err"}


def test_denoiser_gate_cases_are_the_seeded_held_out_images(cards) -> None:
    card = cards["csc-denoiser"]
    cases = gates.gate_cases(card, "test", max_hw=(128, 160))
    images = data.denoise_test_set()
    assert len(cases) == len(images) * len(card.sigma.gate_levels)
    c = next(c for c in cases if c.label.startswith("camera") and c.level == 25)
    full = data.add_noise(images["camera"], 25, data.noise_seed("camera", 25))
    h, w = full.shape
    top, left = (h - 128) // 2, (w - 160) // 2
    assert c.feeds["noisy"].shape == (1, 1, 128, 160) and c.clean.shape == (1, 1, 128, 160)
    assert np.array_equal(c.feeds["noisy"][0, 0], full[top:top + 128, left:left + 160])  # a crop of the same noise
    assert c.feeds["sigma"].tolist() == [pytest.approx(25 / card.sigma.scale)]


def test_denoiser_gate_catches_a_blurring_candidate(onnx_dir, cards) -> None:
    card = cards["csc-denoiser"]
    cases = gates.gate_cases(card, max_hw=(96, 96))
    run = gates.onnxruntime_run(onnx_dir / "csc-denoiser.onnx", card.output)

    def worse(feeds):
        y = run(feeds)
        return 0.8 * y + 0.2 * y.mean()

    res = gates.evaluate(card, cases, run, worse, card.gate("int8"))
    assert not res.passed and res.metrics["psnr_loss_db"] > 0.15
    assert res.metrics["worst_sigma"] == "σ=" + max(res.metrics["per_sigma"], key=lambda s: res.metrics["per_sigma"][
        s]["psnr_loss_db"])
    assert "psnr_loss_db" in res.failures[0] and res.metrics["worst_sigma"] in res.failures[0]


def _token_block(path: Path, weight: np.ndarray) -> ModelCard:
    """A tiny registered-nowhere block ``y = x @ W`` on ``[B, tokens, 64]`` with its card."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "tokens", 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "tokens", 64])
    w = numpy_helper.from_array(weight.astype(np.float32), "W")
    model = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g", [x], [y], [w]),
                              opset_imports=[helper.make_opsetid("", 17)])
    card = ModelCard(name="tiny-block", task="block", input=InputCard(name="x", shape=(-1, 64)), output="y",
                     trt_profile=dict(batch=(1, 2, 4), dims={"0": (1, 49, 256)}))
    write_to_onnx(model, card)
    onnx.save(model, path)
    return card


def test_a_block_gate_catches_a_perturbed_graph(tmp_path: Path) -> None:
    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    card = _token_block(tmp_path / "ref.onnx", w)
    _token_block(tmp_path / "bad.onnx", w * (1 + 1e-2 * np.random.default_rng(1).standard_normal(w.shape)))
    cases = gates.gate_cases(card)
    assert [c.feeds["x"].shape for c in cases] == [(3, 49, 64)]  # photo patches as tokens, the card's opt size
    ref = gates.onnxruntime_run(tmp_path / "ref.onnx", "y")
    same = gates.evaluate(card, cases, ref, ref, card.gate("fp32"))
    assert same.passed and same.metrics["rel_err"] == 0.0
    bad = gates.evaluate(card, cases, ref, gates.onnxruntime_run(tmp_path / "bad.onnx", "y"), card.gate("fp32"))
    assert not bad.passed and 1e-3 < bad.metrics["rel_err"] < 1e-1
    assert bad.failures[0].startswith("rel_err ") and "> 1.00e-04 (over by" in bad.failures[0]
    assert gates.evaluate(card, cases, ref, gates.onnxruntime_run(tmp_path / "bad.onnx", "y"),
                          {"rel_err": 0.1}).passed


def test_a_block_with_a_dynamic_axis_and_no_range_names_the_card_field() -> None:
    card = ModelCard(name="b", task="block", input=InputCard(name="x", shape=(-1, 64)), output="y")
    with pytest.raises(ValueError, match=r"card\.trt_profile\.dims\['0'\]"):
        gates.gate_cases(card)


def test_lambda_rule_gate_is_rel_err_on_the_classifier_images(onnx_dir, cards) -> None:
    card = cards["sdnet-mnist-autolam"]
    cases = gates.gate_cases(card, max_batch=250)  # the classifier's validation digits (its companion's card says so)
    assert [list(c.feeds) for c in cases] == [["image"], ["image"]]
    assert sum(len(c) for c in cases) == data.MNIST_VALIDATION
    run = gates.onnxruntime_run(onnx_dir / "sdnet-mnist-autolam.onnx", card.output)
    assert gates.evaluate(card, cases, run, run, card.gate("fp32")).passed
    res = gates.evaluate(card, cases, run, lambda f: run(f) * 1.01, card.gate("fp32"))
    assert res.metrics["rel_err"] == pytest.approx(0.01, rel=1e-3) and not res.passed


def test_the_repository_serves_a_quantized_graph_with_the_rule_measured_on_it(demo_onnx_dir: Path, cards,
                                                                               tmp_path: Path) -> None:
    """``unroll repo --precision fp16`` puts the FP16 graph's own out-of-distribution rule on the served card (the
    gateway judges by it); a quantized graph that carries the FP32 rule is refused with the command that fixes it."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    from unroll.card import CARD_KEY
    from unroll.errors import RepositoryError
    from unroll.serving.repository import write_repository

    name = "sdnet-mnist"
    src = tmp_path / "onnx"
    src.mkdir()
    for f in demo_onnx_dir.glob(f"{name}.*"):
        shutil.copy(f, src / f.name)
    r = subprocess.run([sys.executable, "-m", "unroll.app.cli", "quantize", name, "--precision", "fp16", "--out",
                        str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "out-of-distribution rule measured again on this graph" in " ".join(r.stdout.split()), r.stdout
    write_repository("cpu", [name], tmp_path / "repo", precision="fp16", onnx_dir=src)
    cfg = mc.ModelConfig()
    text_format.Parse((tmp_path / "repo" / name / "config.pbtxt").read_text(), cfg)
    served = ModelCard.from_json(cfg.parameters[CARD_KEY].string_value)
    fp16 = from_onnx(src / f"{name}.fp16.onnx")
    assert served.ood == fp16.ood and served.ood.measured_on == "fp16" and served.ood != cards[name].ood
    # what `unroll bench ood` reports of it: each graph judged by its own rule on the test data
    from unroll import ood_sets
    from unroll.benchmarks import ood_precisions

    sets = {"validation": {}, "test": ood_sets.ood_sets("test")}
    rows = ood_precisions.measure([name], sets, src, digits=200, precisions=("fp16",))[name]
    assert list(rows) == ["fp32", "fp16"] and rows["fp16"]["measured_on"] == "fp16"
    assert rows["fp32"]["threshold"] == cards[name].ood.threshold and rows["fp16"]["threshold"] == fp16.ood.threshold
    assert rows["fp16"]["verdict_agreement"] >= 0.98 and rows["fp32"]["verdict_agreement"] == 1.0
    assert set(rows["fp16"]["sets"]) == set(ood_sets.KINDS)
    assert all(abs(rows["fp16"]["sets"][k] - rows["fp32"]["sets"][k]) < 0.02 for k in ood_sets.KINDS), rows
    assert ood_precisions.markdown({name: rows})[0].startswith("## Quantized graphs")
    stale = onnx.load(src / f"{name}.fp16.onnx")
    write_to_onnx(stale, cards[name])  # as `unroll quantize` wrote it before it measured the rule again
    onnx.save(stale, src / f"{name}.fp16.onnx")
    with pytest.raises(RepositoryError, match=f"re-run `unroll quantize {name} --precision fp16`"):
        write_repository("cpu", [name], tmp_path / "repo", precision="fp16", onnx_dir=src)
