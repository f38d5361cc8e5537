"""FP16 / INT8 behind accuracy gates, evaluated with ONNX Runtime on held-out data."""

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from unroll.export.onnx_export import export_model
from unroll.export.quantize import GateFailed, calibration_inputs, gate_inputs, quantize


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("q")
    for name in ("sdnet-mnist", "csc-denoiser"):
        export_model(name, d, naive=False)
    return d


@pytest.mark.parametrize("name", ["sdnet-mnist", "csc-denoiser"])
def test_fp16_passes_gate_with_fp32_io(onnx_dir, name: str) -> None:
    r = quantize(name, "fp16", onnx_dir)
    assert r["passed"] and not r["failures"]
    model = onnx.load(onnx_dir / f"{name}.fp16.onnx")
    assert all(i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT for i in model.graph.input)
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in model.graph.initializer)
    if name == "sdnet-mnist":
        assert r["metrics"]["top1_agreement"] >= 0.999
    else:
        assert all(v["psnr_loss_db"] <= 0.02 for v in r["metrics"]["per_sigma"].values())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sdnet-mnist", "csc-denoiser"])
def test_int8_explicit_qdq_passes_gate(onnx_dir, name: str) -> None:
    r = quantize(name, "int8", onnx_dir, calib=256 if name == "sdnet-mnist" else 64)
    assert r["passed"], r["failures"]
    model = onnx.load(onnx_dir / f"{name}.int8.onnx")
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
    # The kept placement is the first with the safety margin (or the report says none had it).
    margins = [t["margin"] for t in r["tries"]]
    k = next(i for i, t in enumerate(r["tries"]) if t["config"] == r["chosen"])
    assert margins[k] >= 0.2 or r["notes"], (r["chosen"], margins)
    assert all(m < 0.2 for m in margins[:k - k % 2]), "an earlier placement already had the margin"
    if name == "sdnet-mnist":
        assert r["metrics"]["top1_agreement"] >= 0.995 and r["metrics"]["accuracy_loss"] <= 0.003
    else:
        assert all(v["psnr_loss_db"] <= 0.15 for v in r["metrics"]["per_sigma"].values())


def test_failed_gate_writes_no_artifact_and_says_why(onnx_dir) -> None:
    with pytest.raises(GateFailed, match=r"σ=\d+: PSNR loss .* dB > -1.0 dB \(over by"):
        quantize("csc-denoiser", "fp16", onnx_dir, gates={"psnr_loss_db": -1.0})
    assert not (onnx_dir / "csc-denoiser.fp16.onnx").exists()


def test_cli_gate_failure_exits_nonzero_with_the_metric(onnx_dir) -> None:
    r = subprocess.run([sys.executable, "-m", "unroll.cli", "quantize", "sdnet-mnist", "--precision", "fp16",
                        "--out", str(onnx_dir), "--min-agreement", "1.01"], capture_output=True, text=True)
    assert r.returncode != 0 and "agreement" in r.stderr and "Traceback" not in r.stderr


def test_calibration_never_uses_the_gate_data() -> None:
    gate = np.concatenate([f["image"] for f in gate_inputs("sdnet-mnist")]).reshape(-1, 784)
    calib = np.concatenate([f["image"] for f in calibration_inputs("sdnet-mnist", 256)]).reshape(-1, 784)
    gate_rows = {g.tobytes() for g in gate}
    assert not any(c.tobytes() in gate_rows for c in calib)
