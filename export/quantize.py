"""``unroll quantize``: FP16 and INT8 (explicit Q/DQ) ONNX graphs behind the card's accuracy gates, on the CPU.

TensorRT 10 deprecated implicit INT8 calibration and the precision builder flags, so precision lives in the graph.
FP16 keeps the numerically fragile ops (:data:`FP16_KEEP_FP32`) in FP32. INT8 uses ONNX Runtime's static QDQ
quantizer (it installs without CUDA) set up for TensorRT's explicit quantization (:data:`TRT_QDQ_OPTIONS`),
calibrated on the card's training data. Which layers stay FP32, the calibration method and the Q/DQ style are
searched from "all INT8" towards more FP32 on the validation + stress sets (never the test set, which is only
reported); the first candidate that passes every gate with the safety margin is kept, and every try is in the
report. Each graph is linted for TensorRT (:mod:`unroll.export.trt_lint`) before it is written.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from unroll import artifacts, tasks
from unroll import gates as gate
from unroll.card import CardError, ModelCard, from_onnx, write_to_onnx
from unroll.errors import GateFailed
from unroll.export.card_attach import NO_CARD_HINT, attach_card
from unroll.export.ood_calibration import recalibrate
from unroll.export.trt_lint import lint, lint_failure, lint_report

FP16_KEEP_FP32 = ["Div", "Exp", "Log", "Pow", "Sqrt", "Reciprocal", "ReduceMean", "ReduceSum", "ReduceMax",
                  "ReduceL2", "Softmax", "TopK", "Min", "Max", "Range", "CumSum"]
#: Both are tried for each FP32 placement and the one with more slack in the gate is kept.
CALIBRATION_METHODS = ("percentile", "minmax")
#: Fraction of each gate tolerance an INT8 placement must leave unused to be accepted outright.
DEFAULT_SAFETY = 0.2
#: Denoiser calibration: square training patches of this side, at σ uniform in [0, CALIB_SIGMA_MAX] (0–255
#: scale, a little past the largest gate level so the ranges cover what the gate and users send).
CALIB_PATCH = 96
CALIB_SIGMA_MAX = 55.0
CALIB_BATCH = 32
#: The weighted ops INT8 quantizes (their inputs: activation and weight).
INT8_OPS = ["Conv", "ConvTranspose", "Gemm", "MatMul"]
#: ONNX Runtime ``quantize_static`` extra options for TensorRT's explicit quantization (its rules:
#: :mod:`unroll.export.trt_lint`): symmetric INT8, since TensorRT takes zero point 0 only; one weight scale per
#: output channel (ModelOpt's Conv/ConvTranspose axes; MatMul's last axis, which ONNX Runtime's default misses for
#: a batched weight); FP32 biases (TensorRT's DequantizeLinear takes no int32); FP32 weights behind a Q/DQ pair
#: (TensorRT quantizes them at build time); a pair per consumer; no Q/DQ on the weighted ops' outputs.
TRT_QDQ_OPTIONS = {
    "ActivationSymmetric": True,
    "WeightSymmetric": True,
    "QuantizeBias": False,
    "AddQDQPairToWeight": True,
    "DedicatedQDQPair": True,
    "OpTypesToExcludeOutputQuantization": INT8_OPS,
    "QDQOpTypePerChannelSupportToAxis": {"Conv": 0, "ConvTranspose": 1, "MatMul": -1},
}
#: Per-axis Q/DQ (the ``axis`` attribute) needs this opset.
MIN_QDQ_OPSET = 13
#: Q/DQ styles tried for each FP32 placement: dedicated pairs (TensorRT's recommendation) first; shared pairs
#: where a reader needs the rounded tensor its neighbours read (NMF's multiplicative update). The gate decides.
QDQ_STYLES = {
    "dedicated": "dedicated Q/DQ on INT8-layer inputs",
    "shared": "shared Q/DQ pairs",
}


# ----------------------------------------------------------------------------- calibration data


def _calibration_role(card: ModelCard) -> str:
    """The card's data role INT8 calibrates on: ``calibration`` where the card names one, else ``train``."""
    return "calibration" if card.data.calibration is not None else "train"


def _denoising_calibration(card: ModelCard, n: int, rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    role = _calibration_role(card)
    ds = gate.role_dataset(card, role)
    if ds.kind != "images":
        raise CardError(f"{card.name}: {card.field_hint('data', role, value=ds.id)} holds {ds.kind}, "
                         "denoiser calibration needs images")
    side = max(CALIB_PATCH, card.input.min_size)
    imgs = [img for img in ds.load().values() if min(img.shape) > side]
    if not imgs:
        raise CardError(f"{card.name}: no image in {card.field_hint('data', role, value=ds.id)} is larger than "
                         f"{side}×{side}")
    channels = card.input.shape[0]
    feeds = []
    for _ in range(n):
        img = imgs[rng.integers(len(imgs))]
        y, x = rng.integers(0, img.shape[0] - side), rng.integers(0, img.shape[1] - side)
        s = float(rng.uniform(0, CALIB_SIGMA_MAX))
        patch = img[y:y + side, x:x + side] + rng.standard_normal((side, side)).astype(np.float32) * s / 255
        feeds.append({card.input.name: np.repeat(patch[None, None], channels, axis=1).astype(np.float32),
                      card.sigma.input: np.array([s / card.sigma.scale], np.float32)})
    return feeds


def calibration_inputs(card: ModelCard, n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Real calibration data from the card's calibration data (``card.data.calibration``, else its training data;
    never the gate's held-out split).

    Classifiers and λ rules: ``n`` random samples of that set (λ at its default); denoisers:
    ``n`` random noisy patches of its images at σ uniform in [0, 55]; blocks: their training data,
    or, for a feature/token block without data, the export's example inputs (see :mod:`unroll.gates`).
    """
    rng = np.random.default_rng(seed)
    if tasks.get(card.task).data == "noisy":
        return _denoising_calibration(card, n, rng)
    x, _, _ = gate.real_inputs(card, _calibration_role(card))
    idx = np.sort(rng.choice(len(x), size=min(n, len(x)), replace=False))
    if len(idx) > CALIB_BATCH:  # equal batches: ONNX Runtime's histogram calibrators stack them (a ragged last
        idx = idx[:len(idx) - len(idx) % CALIB_BATCH]  # one fails with "inhomogeneous shape")
    feeds = []
    for i in range(0, len(idx), CALIB_BATCH):
        part = x[idx[i:i + CALIB_BATCH]]
        lam = ({} if card.lam is None else
               {card.lam.input: np.full(len(part), card.lam.default, np.float32)})
        feeds.append({card.input.name: part, **lam})
    return feeds


def _calibration_source(card: ModelCard) -> str:
    if card.data.calibration is not None:
        return f"card.data.calibration = {card.data.calibration} (calibration data only)"
    if card.data.train is not None:
        return f"card.data.train = {card.data.train} (training data only)"
    return "the export's example inputs (the block has no training data of its own)"


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


def fp32_matmuls(model: onnx.ModelProto) -> list[str]:
    """MatMuls that are not 2-D weighted layers: products of two computed tensors (attention's ``q·kᵀ``, a solver's
    ``DᵀD``) and batched ones with a weight of rank > 2 (VARS's per-head random-feature matrix). They stay FP32:
    ONNX Runtime's CPU kernel cannot run either quantized per channel ("b zero point is not valid")."""
    ranks = {i.name: len(i.dims) for i in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].HasField("t"):
            ranks[n.output[0]] = len(n.attribute[0].t.dims)
    return [n.name for n in model.graph.node
            if n.op_type == "MatMul" and not any(ranks.get(i) == 2 for i in n.input)]


def int8_candidates(model: onnx.ModelProto) -> list[tuple[str, list[str]]]:
    """Exclusion sets to try, from most quantized to least: (description, FP32 node names); weighted layers only
    (:func:`fp32_matmuls` are never quantized)."""
    products = set(fp32_matmuls(model))
    convs = [n.name for n in model.graph.node
             if n.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul") and n.name not in products]
    if not convs:
        return [("all weighted ops in INT8", [])]
    out = [("all weighted ops in INT8", []), ("first layer in FP32", convs[:1])]
    if len(convs) > 2:  # the layer that writes the output (a denoiser's decoder: INT8 codes blur sharp edges)
        out.append(("last layer in FP32", convs[-1:]))
    scope = convs[0].rsplit("/", 1)[0]
    front = [c for c in convs if c.rsplit("/", 1)[0] == scope]
    if scope and 1 < len(front) < len(convs):  # the whole first solver layer (e.g. SDNet's CSC front end)
        out.append(("CSC front end (first solver layer) in FP32", front))
    out += [("first and last layers in FP32", [convs[0], convs[-1]]),
            ("first two and last layers in FP32", convs[:2] + [convs[-1]])]
    return out


def to_int8(model_path: Path, feeds: list[dict[str, np.ndarray]], exclude: list[str], out_path: Path,
            method: str = "minmax", style: str = "dedicated") -> onnx.ModelProto:
    """Static INT8 QDQ quantization of ``model_path`` for TensorRT (:data:`TRT_QDQ_OPTIONS`).

    ``exclude``: nodes kept FP32; ``style``: a key of :data:`QDQ_STYLES` — ``dedicated`` puts a Q/DQ pair on
    each input of an INT8 layer and nowhere else (:func:`qdq_on_weighted_inputs_only`), ``shared`` lets
    every reader of a quantized tensor read the one dequantized copy.
    """
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    if style not in QDQ_STYLES:
        raise ValueError(f"style must be one of {', '.join(QDQ_STYLES)}, not {style!r}")
    opset = next((o.version for o in onnx.load(model_path, load_external_data=False).opset_import
                  if o.domain in ("", "ai.onnx")), 0)
    if opset < MIN_QDQ_OPSET:
        raise ValueError(f"{model_path} is opset {opset}: per-channel Q/DQ needs opset {MIN_QDQ_OPSET} or newer "
                         "(re-export with --opset 17)")
    with tempfile.TemporaryDirectory() as tmp:
        pre = Path(tmp) / "pre.onnx"
        quant_pre_process(str(model_path), str(pre), skip_symbolic_shape=True)
        quantize_static(
            str(pre), str(out_path), _Reader(feeds), quant_format=QuantFormat.QDQ,
            op_types_to_quantize=INT8_OPS, per_channel=True, reduce_range=False,
            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
            nodes_to_exclude=[*exclude, *fp32_matmuls(onnx.load(pre, load_external_data=False))],
            calibrate_method={"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
                              "percentile": CalibrationMethod.Percentile}[method],
            extra_options=qdq_options(style))
    model = onnx.load(out_path)
    if style == "dedicated":
        model = qdq_on_weighted_inputs_only(model)
        onnx.save(model, out_path)
    return model


def qdq_options(style: str = "dedicated") -> dict:
    """ONNX Runtime ``extra_options`` for a Q/DQ style: :data:`TRT_QDQ_OPTIONS`, shared pairs for ``shared``."""
    return {**TRT_QDQ_OPTIONS, **({"DedicatedQDQPair": False} if style == "shared" else {})}


def _int8_layer(node: onnx.NodeProto, producers: dict[str, onnx.NodeProto]) -> bool:
    """A weighted op whose weight is dequantized, i.e. one TensorRT runs in INT8."""
    w = producers.get(node.input[1]) if node.op_type in INT8_OPS and len(node.input) > 1 else None
    return w is not None and w.op_type == "DequantizeLinear"


def qdq_on_weighted_inputs_only(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every Q/DQ pair feeds exactly one INT8 layer; every other reader gets the float tensor.

    ONNX Runtime's ``DedicatedQDQPair`` splits a pair only among the nodes it quantized: a tensor with
    one quantized reader (the first convolution) and a float one (the solver's residual ``Sub``) still
    rewires *both* to the dequantized copy, and a weight shared by two convolutions shares one pair. Here
    each INT8 layer (a Conv/ConvTranspose/Gemm/MatMul with a dequantized weight) gets its own copy of the
    pair, with the same scale, and every other reader reads the tensor the ``QuantizeLinear`` took — so
    rounding happens only where TensorRT runs INT8, on weighted-op inputs.
    """
    g = model.graph
    producers = {o: n for n in g.node for o in n.output}
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for n in g.node:
        for i, t in enumerate(n.input):
            readers.setdefault(t, []).append((n, i))
    graph_outputs = {o.name for o in g.output}
    extra: dict[str, list[onnx.NodeProto]] = {}  # DQ name -> copies inserted right after it
    for dq in [n for n in g.node if n.op_type == "DequantizeLinear"]:
        q = producers.get(dq.input[0])
        users = readers.get(dq.output[0], [])
        if q is None or q.op_type != "QuantizeLinear" or dq.output[0] in graph_outputs or len(users) < 2:
            continue
        int8 = [(n, i) for n, i in users if _int8_layer(n, producers)]
        for n, i in users:
            if (n, i) not in int8:
                n.input[i] = q.input[0]  # a float reader: the unquantized tensor
        for k, (n, i) in enumerate(int8[1:], start=2):
            q2, dq2 = onnx.NodeProto(), onnx.NodeProto()
            q2.CopyFrom(q)
            dq2.CopyFrom(dq)
            q2.name, dq2.name = f"{q.name}_{k}", f"{dq.name}_{k}"
            q2.output[0] = dq2.input[0] = f"{q.output[0]}_{k}"
            dq2.output[0] = f"{dq.output[0]}_{k}"
            n.input[i] = dq2.output[0]
            extra.setdefault(dq.name, []).extend([q2, dq2])
    nodes = []
    for n in g.node:
        nodes.append(n)
        nodes.extend(extra.get(n.name, []))
    del g.node[:]
    g.node.extend(_without_dead_pairs(nodes, graph_outputs))
    return model


def _without_dead_pairs(nodes: list[onnx.NodeProto], graph_outputs: set[str]) -> list[onnx.NodeProto]:
    """``nodes`` less the Q/DQ pairs nothing reads any more (every reader of a pair was a float one, rewired to the
    unquantized tensor: e.g. a solver code read only by the residual's reconstruction and the next solver step)."""
    read = {t for n in nodes for t in n.input} | graph_outputs
    dead = {id(n) for n in nodes if n.op_type == "DequantizeLinear" and n.output[0] not in read}
    read = {t for n in nodes if id(n) not in dead for t in n.input} | graph_outputs
    dead |= {id(n) for n in nodes if n.op_type == "QuantizeLinear" and n.output[0] not in read}
    return [n for n in nodes if id(n) not in dead]


# ----------------------------------------------------------------------------- entry point


def _source(name: str, onnx_dir: Path, card: str | Path | None = None) -> tuple[Path, ModelCard]:
    src = artifacts.graph(name, onnx_dir=onnx_dir)
    if not src.exists():
        raise FileNotFoundError(f"{src} not found: run `unroll export {name}` first")
    if card is not None:  # a third-party graph: its card comes from the command line (validated, name = NAME)
        return src, attach_card(src, card, name)
    try:
        return src, from_onnx(src)
    except CardError as e:
        raise CardError(f"{e}, {NO_CARD_HINT}") from None


def _try(desc: str, res: gate.GateResult, **extra) -> dict:
    """One candidate's row in the report."""
    return {"config": desc, **extra, "metrics": res.metrics, "failures": res.failures,
            "margin": round(res.margin, 4)}


def quantize_inputs(src: Path, precision: str, calib: int = 256, gates: dict | None = None,
                    safety: float = DEFAULT_SAFETY) -> dict:
    """What ``NAME.PRECISION.onnx`` is built from, as hashes (its report's ``built_from``; :mod:`unroll.pipeline`
    re-quantizes when they differ): the FP32 graph (its card inside) and the options that change the result."""
    return artifacts.built_from(upstream=src, options={"precision": precision, "calib": calib, "gates": gates,
                                                       "safety": safety})


def quantize(name: str, precision: str, onnx_dir: Path = artifacts.ONNX_DIR, calib: int = 256,
             gates: dict | None = None, progress=None, safety: float = DEFAULT_SAFETY,
             card: str | Path | None = None) -> dict:
    """Write ``NAME.<precision>.onnx`` + report if the gate passes; raise :class:`GateFailed` otherwise.

    Everything model-specific comes from the card in ``onnx_dir/NAME.onnx``: the gate data and
    tolerances (``card.gate(precision)``, then ``gates`` — ``{metric: tolerance}`` with the metric names
    of :data:`unroll.gates.METRICS`), and the calibration data (``card.data.calibration`` or ``.train``).
    ``safety``: for INT8, the fraction of every tolerance a placement must leave unused to be taken
    without trying more FP32 (0 takes the first that passes at all).
    ``card``: a card JSON file attached to ``NAME.onnx`` first (a third-party graph that has none, or to
    replace the one it has; see :func:`unroll.export.card_attach.attach_card`).
    """
    if not 0.0 <= safety < 1.0:
        raise ValueError(f"safety must be in [0, 1), not {safety}")
    if precision not in ("fp16", "int8"):
        raise ValueError(f"precision must be fp16 or int8, not {precision!r}")
    src, card = _source(name, onnx_dir, card)
    tol = gate.tolerances(card, precision, gates)
    t0 = time.perf_counter()
    cases = gate.gate_cases(card)  # validation + stress: every choice below is made on these
    fp32 = onnx.load(src)
    refs = gate.reference_outputs(cases, gate.onnxruntime_run(fp32, card.output))

    def judge(candidate: onnx.ModelProto) -> gate.GateResult:
        return gate.evaluate(card, cases, refs, gate.onnxruntime_run(candidate, card.output), tol)

    out = artifacts.graph(name, precision, onnx_dir)
    report_path = artifacts.report_of(out)
    tries: list[dict] = []
    notes: list[str] = []
    if precision not in card.precisions:
        notes.append(f"the card lists {', '.join(card.precisions)} as worth building, not {precision}")
    if precision == "fp16":
        chosen = _choose_fp16(fp32, judge, tries)
    else:
        chosen = _choose_int8(src, fp32, calibration_inputs(card, calib), safety, judge, tries, notes, progress)
    model, res, desc, kept, style = chosen
    if res.unmeasured:
        notes.append(f"not measured (the gate data has no labels): {', '.join(res.unmeasured)}")
    card, ood = recalibrate(card, fp32, model, cases, precision) if res.passed else (card, None)
    write_to_onnx(model, card)  # the converters do not all keep metadata_props: the card travels on explicitly
    issues = lint(model)  # TensorRT parses this graph: lint it like the FP32 export, before anything is written
    report = _quantize_report(name, precision, src, card, fp32, model, res, desc, kept, style, tol, cases, tries,
                              notes, issues, {"calib": calib, "gates": gates, "safety": safety}, t0)
    if ood is not None:
        report["ood"] = ood
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    if issues:
        out.unlink(missing_ok=True)
        raise lint_failure(f"{name} {precision} ({desc}; report in {report_path})", issues)
    if not res.passed:
        out.unlink(missing_ok=True)
        raise GateFailed(f"{name} {precision} failed its accuracy gate: " + "; ".join(res.failures) +
                         f" (details in {report_path})")
    tmp_out = out.with_suffix(".onnx.tmp")
    onnx.save(model, tmp_out)
    os.replace(tmp_out, out)
    return report


Chosen = tuple[onnx.ModelProto, gate.GateResult, str, list[str], str | None]  # graph, result, config, kept, style


def _choose_fp16(fp32: onnx.ModelProto, judge: Callable[[onnx.ModelProto], gate.GateResult],
                 tries: list[dict]) -> Chosen:
    """FP16 with the fragile ops kept in FP32: one candidate, judged and recorded in ``tries``."""
    cand = to_fp16(fp32)
    res = judge(cand)
    tries.append(_try("fp16 with fragile ops in fp32", res, keep_fp32_ops=FP16_KEEP_FP32))
    return cand, res, tries[-1]["config"], FP16_KEEP_FP32, None


def _choose_int8(src: Path, fp32: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], safety: float,
                 judge: Callable[[onnx.ModelProto], gate.GateResult], tries: list[dict], notes: list[str],
                 progress: Callable[[str], None] | None) -> Chosen:
    """The most quantized INT8 placement that passes with the ``safety`` margin (each placement tried in every
    QDQ style and calibration method until one has it), else the most quantized that passes at all, else the
    last one tried; every candidate is recorded in ``tries``."""
    chosen: Chosen | None = None
    first_pass = None  # most quantized placement that passes, in case none has the safety margin
    with tempfile.TemporaryDirectory() as tmp:
        for i, (desc, exclude) in enumerate(int8_candidates(fp32)):
            best = None
            for style, style_desc in QDQ_STYLES.items():  # the next style only if this one has no margin
                for method in CALIBRATION_METHODS:
                    if progress:
                        progress(f"INT8 ({style_desc}; {method} calibration): {desc}")
                    cand = to_int8(src, feeds, exclude, Path(tmp) / f"q{i}_{style}_{method}.onnx",
                                   method=method, style=style)
                    res = judge(cand)
                    tries.append(_try(f"{desc}; {style_desc}; {method} calibration", res, fp32_nodes=exclude,
                                      qdq=style))
                    if best is None or res.margin > best[1].margin:
                        best = (cand, res, tries[-1]["config"], exclude, style)
                if best[1].passed and best[1].margin >= safety:
                    break
            chosen = best
            if chosen[1].passed and first_pass is None:
                first_pass = chosen
            if chosen[1].passed and chosen[1].margin >= safety:
                break
        else:
            if first_pass is not None:
                chosen = first_pass
                notes.append(f"no placement passed with the {safety:.0%} safety margin; kept the most "
                             "quantized one that passes")
    assert chosen is not None
    return chosen


def _quantize_report(name: str, precision: str, src: Path, card: ModelCard, fp32: onnx.ModelProto,
                     model: onnx.ModelProto, res: gate.GateResult, desc: str, kept: list[str], style: str | None,
                     tol: dict, cases: list[gate.GateCase], tries: list[dict], notes: list[str], issues: list,
                     options: dict, t0: float) -> dict:
    """The JSON beside ``NAME.PRECISION.onnx``: what was chosen and why, every try, the lint, the test set."""
    calib, gates, safety = options["calib"], options["gates"], options["safety"]
    hist: dict[str, int] = {}
    for n in model.graph.node:
        hist[n.op_type] = hist.get(n.op_type, 0) + 1
    test = _test_report(card, fp32, model, tol)
    return {"model": name, "precision": precision, "source": str(src),
           artifacts.BUILT_FROM_KEY: quantize_inputs(src, precision, calib, gates, safety),
           "passed": res.passed, "chosen": desc,
           "kept_in_higher_precision": kept, "gate": tol, "gate_data": gate.gate_source(card, cases),
           "metrics": res.metrics, "failures": res.failures, "margin": round(res.margin, 4), "test": test,
           "tries": tries,
           "notes": notes,
           "calibration": (None if precision == "fp16" else
                           {"samples": calib, "source": _calibration_source(card), "safety_margin": safety,
                            "format": "QDQ, symmetric int8, zero point 0, per-channel weights along the "
                                      "output-channel axis, FP32 biases and weights (Q→DQ pairs), no "
                                      f"quantized outputs of weighted ops; {QDQ_STYLES[style]}",
                            "qdq_style": style, "onnxruntime_extra_options": qdq_options(style)}),
           "trt_lint": lint_report(model, issues),
           "op_histogram": dict(sorted(hist.items())), "seconds": round(time.perf_counter() - t0, 1),
           "versions": {"onnxruntime": ort.__version__, "onnx": onnx.__version__},
           "card": card.model_dump(mode="json")}


def _test_report(card: ModelCard, fp32: onnx.ModelProto, model: onnx.ModelProto, tol: dict) -> dict | None:
    """The chosen graph on the card's *test* set, for the report only (nothing is chosen or gated on it);
    ``None`` when the card has no test set or gates on it already."""
    if card.data.test is None or card.data.gate == "test":
        return None
    cases = gate.gate_cases(card, "test")
    res = gate.evaluate(card, cases, gate.onnxruntime_run(fp32, card.output),
                        gate.onnxruntime_run(model, card.output), tol)
    return {"data": gate.gate_source(card, cases, "test"), "metrics": res.metrics,
            "within_gate_tolerances": res.passed, "note": "reported only: nothing was chosen or gated on the test set"}
