"""``unroll quantize``: FP16 and INT8 (explicit Q/DQ) ONNX behind accuracy gates, evaluated on CPU.

TensorRT 10 deprecated (and 11 removed) implicit INT8 calibration and the FP16/INT8 builder flags:
precision now lives in the graph and engines are built strongly typed. So this step rewrites the
verified FP32 export:

* **FP16** with ONNX Runtime's float16 converter (the maintained ``onnxconverter-common`` code, shipped
  in ``onnxruntime.transformers``), inputs/outputs kept FP32, and the numerically fragile ops kept in
  FP32: divisions, exponentials, reductions, softmax, square roots, top-k (NMF's ``/(… + 1e-6)``, the
  random-feature ``exp`` in VARS, the denoiser's σ-dependent thresholds and image mean).
* **INT8** with ONNX Runtime's static quantizer in QDQ format — symmetric, zero point 0, per-channel
  weights, what TensorRT accepts — calibrated on *training* data (MNIST training digits; noisy patches
  of the denoiser's training images). ONNX Runtime's tool was chosen over ModelOpt because it installs
  everywhere (no CUDA), and its QDQ output is exactly the explicit-precision form TensorRT consumes.
  Which convolutions stay in FP32 is chosen by measurement: candidates are tried from "quantize all"
  towards more FP32, and the first that passes the gate with a safety margin (by default a fifth of
  each tolerance left unused) is kept — a placement that scrapes through on the gate images will not
  hold on a user's. If none has that margin, the most quantized one that passes at all is kept and the
  report says so. All tries go in the report.

The gate runs the candidate and the FP32 graph in ONNX Runtime on held-out data; a failing model is
not written as a deployable artifact.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from unroll import data

FP16_KEEP_FP32 = ["Div", "Exp", "Log", "Pow", "Sqrt", "Reciprocal", "ReduceMean", "ReduceSum", "ReduceMax",
                  "ReduceL2", "Softmax", "TopK", "Min", "Max", "Range", "CumSum"]
DEFAULT_GATES = {"fp16": {"agreement": 0.999, "accuracy_loss": 0.001, "psnr_loss_db": 0.02},
                 "int8": {"agreement": 0.995, "accuracy_loss": 0.003, "psnr_loss_db": 0.15}}
GATE_SIGMAS = (15.0, 25.0, 50.0)
SUPPORTED = ("sdnet-mnist", "csc-denoiser")
#: Both are tried for each FP32 placement and the one with more slack in the gate is kept.
CALIBRATION_METHODS = ("percentile", "minmax")
#: Fraction of each gate tolerance an INT8 placement must leave unused to be accepted outright.
DEFAULT_SAFETY = 0.2


class GateFailed(RuntimeError):
    """The quantized model missed its accuracy gate (the report says by how much)."""


@dataclass
class GateResult:
    metrics: dict
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures


def _session(model: onnx.ModelProto | str | Path, threads: int = 2) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


# ----------------------------------------------------------------------------- data

def gate_inputs(name: str) -> list[dict[str, np.ndarray]]:
    """Held-out evaluation feeds: the 1,000 MNIST test digits, or the noisy held-out images."""
    if name == "sdnet-mnist":
        _, _, xte, _ = data.mnist_split()
        return [{"image": xte[i:i + 250], "lam": np.full(len(xte[i:i + 250]), 0.1, np.float32)}
                for i in range(0, len(xte), 250)]
    if name == "csc-denoiser":
        feeds = []
        for s in GATE_SIGMAS:
            for n, img in data.denoise_test_set().items():
                noisy = data.add_noise(img, s, data.noise_seed(n, s))
                feeds.append({"noisy": noisy[None, None], "sigma": np.array([s / 255], np.float32)})
        return feeds
    raise ValueError(f"no accuracy gate data for {name!r}; quantization supports {', '.join(SUPPORTED)}")


def calibration_inputs(name: str, n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Real calibration data from the *training* split only (never the gate's held-out data)."""
    rng = np.random.default_rng(seed)
    if name == "sdnet-mnist":
        xtr, _, _, _ = data.mnist_split()
        idx = rng.choice(len(xtr), size=min(n, len(xtr)), replace=False)
        lam = np.full(len(idx), 0.1, np.float32)  # the default λ the gateway serves
        return [{"image": xtr[idx[i:i + 32]], "lam": lam[i:i + 32]} for i in range(0, len(idx), 32)]
    if name == "csc-denoiser":
        imgs = list(data.denoise_train_set().values())
        feeds = []
        for _ in range(n):
            img = imgs[rng.integers(len(imgs))]
            y, x = rng.integers(0, img.shape[0] - 96), rng.integers(0, img.shape[1] - 96)
            s = float(rng.uniform(0, 55))
            patch = img[y:y + 96, x:x + 96] + rng.standard_normal((96, 96)).astype(np.float32) * s / 255
            feeds.append({"noisy": patch[None, None].astype(np.float32), "sigma": np.array([s / 255], np.float32)})
        return feeds
    raise ValueError(f"no calibration data for {name!r}; quantization supports {', '.join(SUPPORTED)}")


# ----------------------------------------------------------------------------- gate

def evaluate_gate(name: str, reference: ort.InferenceSession, candidate: ort.InferenceSession, precision: str,
                  gates: dict | None = None) -> GateResult:
    gate = {**DEFAULT_GATES[precision], **(gates or {})}
    feeds = gate_inputs(name)
    if name == "sdnet-mnist":
        _, _, _, yte = data.mnist_split()
        ref = np.concatenate([reference.run(None, f)[0] for f in feeds]).argmax(1)
        got = np.concatenate([candidate.run(None, f)[0] for f in feeds]).argmax(1)
        agreement = float((ref == got).mean())
        acc_ref, acc_got = float((ref == yte).mean()), float((got == yte).mean())
        m = {"top1_agreement": agreement, "accuracy_fp32": acc_ref, "accuracy": acc_got,
             "accuracy_loss": acc_ref - acc_got, "n": len(yte), "gate": gate}
        fails = []
        if agreement < gate["agreement"]:
            fails.append(f"top-1 agreement {agreement:.2%} < {gate['agreement']:.2%} "
                         f"(short by {gate['agreement'] - agreement:.2%})")
        if acc_ref - acc_got > gate["accuracy_loss"]:
            fails.append(f"accuracy loss {100 * (acc_ref - acc_got):.2f} points > {100 * gate['accuracy_loss']:.2f}")
        return GateResult(m, fails)
    from skimage.metrics import peak_signal_noise_ratio

    clean = list(data.denoise_test_set().values())
    per_sigma: dict[str, dict[str, float]] = {}
    for si, s in enumerate(GATE_SIGMAS):
        p_ref, p_got, worst = [], [], 0.0
        for j, img in enumerate(clean):
            f = feeds[si * len(clean) + j]
            a, b = reference.run(None, f)[0][0, 0], candidate.run(None, f)[0][0, 0]
            p_ref.append(peak_signal_noise_ratio(img, np.clip(a, 0, 1), data_range=1.0))
            p_got.append(peak_signal_noise_ratio(img, np.clip(b, 0, 1), data_range=1.0))
            worst = max(worst, float(np.abs(a - b).max()))
        per_sigma[f"{s:g}"] = {"psnr_fp32": float(np.mean(p_ref)), "psnr": float(np.mean(p_got)),
                               "psnr_loss_db": float(np.mean(p_ref) - np.mean(p_got)), "max_abs_diff": worst}
    fails = [f"σ={s}: PSNR loss {v['psnr_loss_db']:.3f} dB > {gate['psnr_loss_db']} dB "
             f"(over by {v['psnr_loss_db'] - gate['psnr_loss_db']:.3f} dB)"
             for s, v in per_sigma.items() if v["psnr_loss_db"] > gate["psnr_loss_db"]]
    return GateResult({"per_sigma": per_sigma, "gate": gate}, fails)


# ----------------------------------------------------------------------------- converters

def to_fp16(model: onnx.ModelProto, keep_fp32_ops: list[str] | None = None) -> onnx.ModelProto:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    return convert_float_to_float16(model, keep_io_types=True, op_block_list=keep_fp32_ops or FP16_KEEP_FP32)


class _Reader:
    """ONNX Runtime calibration reader over a list of feeds."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self._it = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)


def int8_candidates(model: onnx.ModelProto) -> list[tuple[str, list[str]]]:
    """Exclusion sets to try, from most quantized to least: (description, FP32 node names)."""
    convs = [n.name for n in model.graph.node if n.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul")]
    if not convs:
        return [("all weighted ops in INT8", [])]
    out = [("all weighted ops in INT8", []), ("first layer in FP32", convs[:1])]
    scope = convs[0].rsplit("/", 1)[0]
    front = [c for c in convs if c.rsplit("/", 1)[0] == scope]
    if scope and 1 < len(front) < len(convs):  # the whole first solver layer (e.g. SDNet's CSC front end)
        out.append(("CSC front end (first solver layer) in FP32", front))
    out += [("first and last layers in FP32", [convs[0], convs[-1]]),
            ("first two and last layers in FP32", convs[:2] + [convs[-1]])]
    return out


def to_int8(model_path: Path, feeds: list[dict[str, np.ndarray]], exclude: list[str], out_path: Path,
            method: str = "minmax") -> onnx.ModelProto:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    with tempfile.TemporaryDirectory() as tmp:
        pre = Path(tmp) / "pre.onnx"
        quant_pre_process(str(model_path), str(pre), skip_symbolic_shape=True)
        quantize_static(
            str(pre), str(out_path), _Reader(feeds), quant_format=QuantFormat.QDQ,
            op_types_to_quantize=["Conv", "ConvTranspose", "Gemm", "MatMul"], per_channel=True,
            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, nodes_to_exclude=exclude,
            calibrate_method={"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
                              "percentile": CalibrationMethod.Percentile}[method],
            # Biases stay FP32: TensorRT takes Q/DQ on int8 tensors, not int32-quantized biases.
            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True, "QuantizeBias": False})
    return onnx.load(out_path)


# ----------------------------------------------------------------------------- entry point

def _margin(res: GateResult) -> float:
    """How far inside its gate a candidate is, as the tightest metric's unused fraction of its tolerance.

    1 means no loss at all, 0 exactly on the gate, negative a failure. Relative, so one safety fraction
    fits PSNR (dB) and agreement/accuracy (fractions) alike.
    """
    m, g = res.metrics, res.metrics["gate"]
    if "top1_agreement" in m:
        return min((m["top1_agreement"] - g["agreement"]) / max(1.0 - g["agreement"], 1e-9),
                   (g["accuracy_loss"] - m["accuracy_loss"]) / max(g["accuracy_loss"], 1e-9))
    return min((g["psnr_loss_db"] - v["psnr_loss_db"]) / max(g["psnr_loss_db"], 1e-9)
               for v in m["per_sigma"].values())


def quantize(name: str, precision: str, onnx_dir: Path = Path("build/onnx"), calib: int = 256,
             gates: dict | None = None, progress=None, safety: float = DEFAULT_SAFETY) -> dict:
    """Write ``NAME.<precision>.onnx`` + report if the gate passes; raise :class:`GateFailed` otherwise.

    ``safety``: for INT8, the fraction of every tolerance a placement must leave unused to be taken
    without trying more FP32 (0 takes the first that passes at all).
    """
    if not 0.0 <= safety < 1.0:
        raise ValueError(f"safety must be in [0, 1), not {safety}")
    if precision not in ("fp16", "int8"):
        raise ValueError(f"precision must be fp16 or int8, not {precision!r}")
    if name not in SUPPORTED:
        raise ValueError(f"accuracy gates exist for {', '.join(SUPPORTED)}; {name!r} has no gate data")
    src = Path(onnx_dir) / f"{name}.onnx"
    if not src.exists():
        raise FileNotFoundError(f"{src} not found: run `unroll export {name}` first")
    t0 = time.perf_counter()
    fp32 = onnx.load(src)
    reference = _session(fp32)
    out = Path(onnx_dir) / f"{name}.{precision}.onnx"
    report_path = out.with_suffix(".report.json")
    tries: list[dict] = []
    notes: list[str] = []
    chosen: tuple[onnx.ModelProto, GateResult, str, list[str]] | None = None
    if precision == "fp16":
        cand = to_fp16(fp32)
        res = evaluate_gate(name, reference, _session(cand), precision, gates)
        tries.append({"config": "fp16 with fragile ops in fp32", "keep_fp32_ops": FP16_KEEP_FP32,
                      "metrics": res.metrics, "failures": res.failures})
        chosen = (cand, res, tries[-1]["config"], FP16_KEEP_FP32)
    else:
        feeds = calibration_inputs(name, calib)
        first_pass = None  # most quantized placement that passes, in case none has the safety margin
        with tempfile.TemporaryDirectory() as tmp:
            for i, (desc, exclude) in enumerate(int8_candidates(fp32)):
                best = None
                for method in CALIBRATION_METHODS:
                    if progress:
                        progress(f"INT8 ({method} calibration): {desc}")
                    path = Path(tmp) / f"q{i}_{method}.onnx"
                    cand = to_int8(src, feeds, exclude, path, method=method)
                    res = evaluate_gate(name, reference, _session(cand), precision, gates)
                    margin = _margin(res)
                    tries.append({"config": f"{desc}; {method} calibration", "fp32_nodes": exclude,
                                  "metrics": res.metrics, "failures": res.failures, "margin": round(margin, 4)})
                    if best is None or margin > best[0]:
                        best = (margin, (cand, res, tries[-1]["config"], exclude))
                chosen = best[1]
                if chosen[1].passed and first_pass is None:
                    first_pass = chosen
                if chosen[1].passed and best[0] >= safety:
                    break
            else:
                if first_pass is not None:
                    chosen = first_pass
                    notes.append(f"no placement passed with the {safety:.0%} safety margin; kept the most "
                                 "quantized one that passes")
    assert chosen is not None
    model, res, desc, kept = chosen
    hist: dict[str, int] = {}
    for n in model.graph.node:
        hist[n.op_type] = hist.get(n.op_type, 0) + 1
    report = {"model": name, "precision": precision, "source": str(src), "passed": res.passed, "chosen": desc,
              "kept_in_higher_precision": kept, "metrics": res.metrics, "failures": res.failures, "tries": tries,
              "notes": notes,
              "calibration": (None if precision == "fp16" else
                              {"samples": calib, "source": "training split only", "safety_margin": safety,
                               "format": "QDQ, symmetric int8, zero point 0, per-channel weights"}),
              "op_histogram": dict(sorted(hist.items())), "seconds": round(time.perf_counter() - t0, 1),
              "versions": {"onnxruntime": ort.__version__, "onnx": onnx.__version__}}
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    if not res.passed:
        out.unlink(missing_ok=True)
        raise GateFailed(f"{name} {precision} failed its accuracy gate: " + "; ".join(res.failures) +
                         f" (details in {report_path})")
    tmp_out = out.with_suffix(".onnx.tmp")
    onnx.save(model, tmp_out)
    os.replace(tmp_out, out)
    return report
