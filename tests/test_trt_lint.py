"""The TensorRT lint: TensorRT's own operator table and Q/DQ rules, and unroll's serving-graph policy, kept apart."""

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from unroll.card import from_onnx
from unroll.errors import LintError
from unroll.export.quantize import calibration_inputs, to_int8
from unroll.export.trt_lint import (
    OPS_FILE,
    POLICY,
    LintIssue,
    check,
    lint,
    lint_failure,
    lint_report,
    op_table,
    policy_issues,
    tensorrt_issues,
)

TRT = "TensorRT 10.15"


def _model(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _vi(name, elem=TensorProto.FLOAT, shape=(1, 4, 8, 8)):
    return helper.make_tensor_value_info(name, elem, None if shape is None else list(shape))


def _init(name, arr):
    return numpy_helper.from_array(np.asarray(arr), name)


def _qdq_conv(*, x_scale=0.02, x_zp=np.int8(0), w_scale=None, w_axis=0, w_zp=None, scale_as_input=False,
              opset=17) -> onnx.ModelProto:
    """x -> Q -> DQ -> Conv <- DQ <- Q <- W (TensorRT's explicit-quantization form), parameters as given."""
    w = np.random.default_rng(0).standard_normal((4, 4, 3, 3)).astype(np.float32)
    w_scale = np.full(4, 0.01, np.float32) if w_scale is None else np.asarray(w_scale, np.float32)
    w_zp = np.zeros(w_scale.shape, np.int8) if w_zp is None else w_zp
    inits = [_init("W", w), _init("w_scale", w_scale), _init("w_zp", w_zp), _init("x_zp", np.asarray(x_zp))]
    inputs = [_vi("x")]
    if scale_as_input:
        inputs.append(_vi("x_scale", shape=()))
    else:
        inits.append(_init("x_scale", np.asarray(x_scale, np.float32)))
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zp"], ["xq"], name="x_q"),
        helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zp"], ["xd"], name="x_dq"),
        helper.make_node("QuantizeLinear", ["W", "w_scale", "w_zp"], ["wq"], name="w_q", axis=w_axis),
        helper.make_node("DequantizeLinear", ["wq", "w_scale", "w_zp"], ["wd"], name="w_dq", axis=w_axis),
        helper.make_node("Conv", ["xd", "wd"], ["y"], name="conv", pads=[1, 1, 1, 1]),
    ]
    return _model(nodes, inputs, [_vi("y")], inits, opset)


def _reasons(model, node: str) -> list[str]:
    return [i.reason for i in lint(model) if i.node == node]


# ----------------------------------------------------------------------------------------------- the table


def test_the_op_table_is_tensorrts_own_list_with_its_source() -> None:
    t = op_table()
    assert OPS_FILE.parent.name == "export" and t.tensorrt_version == "10.15" and t.opset_range == (9, 24)
    assert t.commit == "fa5aa9f61e7781d2ca8f5351d42c1f19525a6124" and t.commit in t.source_url
    assert t.source_url == f"https://github.com/onnx/onnx-tensorrt/blob/{t.commit}/docs/operators.md"
    ops = t.operators
    assert len(ops) == 200 and sum(not o["supported"] for o in ops.values()) == 42
    for parsed in ("Loop", "If", "Scan", "NonZero", "RandomNormal", "Conv", "QuantizeLinear", "DequantizeLinear"):
        assert ops[parsed]["supported"], parsed  # TensorRT parses these: never "not supported by TensorRT"
    for refused in ("Compress", "DFT", "Unique", "ConvInteger", "QLinearConv", "SequenceConstruct", "Bernoulli"):
        assert not ops[refused]["supported"], refused
    assert ops["DequantizeLinear"]["types"] == ["INT8", "FP8", "FP4", "INT4"]
    assert "`x_zero_point` must be zero" in ops["DequantizeLinear"]["restrictions"]
    # unroll's policy covers only what TensorRT parses: its refusals are unroll's, never worded as TensorRT's
    assert all(ops[op]["supported"] for op in POLICY)


def test_an_op_marked_n_is_not_supported_by_that_tensorrt_version() -> None:
    x = _vi("x", shape=(2,))
    nodes = [helper.make_node("Compress", ["x", "c"], ["y"], name="my_compress"),
             helper.make_node("DFT", ["x"], ["z"], name="my_dft"),
             helper.make_node("Swish", ["x"], ["s"], name="my_swish")]
    model = _model(nodes, [x, _vi("c", TensorProto.BOOL, (2,))], [_vi("y", shape=(None,))], opset=24)
    issues = {i.node: i for i in lint(model)}
    assert set(issues) == {"my_compress", "my_dft", "my_swish"}
    assert issues["my_compress"].reason == f"Compress is not supported by {TRT}"
    assert str(issues["my_dft"]) == f"node 'my_dft' (DFT): DFT is not supported by {TRT}"
    assert issues["my_swish"].reason == f"Swish is not in {TRT}'s ONNX operator list"
    assert all(i.rule == "tensorrt" and i.message == i.reason for i in issues.values())


def test_loop_is_parsed_by_tensorrt_but_refused_by_unrolls_policy() -> None:
    body = helper.make_graph([helper.make_node("Identity", ["cond_in"], ["cond_out"]),
                              helper.make_node("Add", ["v_in", "v_in"], ["v_out"])], "body",
                             [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                              helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                              _vi("v_in", shape=(2,))],
                             [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
                              _vi("v_out", shape=(2,))])
    loop = helper.make_node("Loop", ["n", "cond", "v0"], ["v"], name="fista_loop", body=body)
    model = _model([loop], [helper.make_tensor_value_info("n", TensorProto.INT64, []),
                            helper.make_tensor_value_info("cond", TensorProto.BOOL, []), _vi("v0", shape=(2,))],
                   [_vi("v", shape=(2,))])
    assert tensorrt_issues(model) == []  # TensorRT 10.15 parses Loop
    (issue,) = lint(model)
    assert issue == policy_issues(model)[0] and issue.rule == "unroll" and issue.node == "fista_loop"
    assert issue.reason.startswith("unroll policy: control flow in a serving graph: unroll the iterations")
    assert f"({TRT} parses Loop; unroll does not serve it)" in issue.reason and "not supported" not in issue.reason
    with pytest.raises(LintError) as e:
        check(model, "fista.onnx")
    msg = str(e.value)
    assert msg.startswith("fista.onnx fails the TensorRT lint:\n"
                          "unroll's serving-graph policy refuses:\n  node 'fista_loop' (Loop): unroll policy:")
    assert f"{TRT} would reject" not in msg and e.value.issues == [issue]


def test_random_and_data_dependent_ops_are_unrolls_policy_not_tensorrts() -> None:
    x = _vi("x", shape=(2,))
    nodes = [helper.make_node("RandomNormalLike", ["x"], ["r"], name="noise"),
             helper.make_node("NonZero", ["x"], ["nz"], name="nz")]
    model = _model(nodes, [x], [_vi("r", shape=(2,)), helper.make_tensor_value_info("nz", TensorProto.INT64, None)])
    assert tensorrt_issues(model) == []
    issues = {i.node: i for i in lint(model)}
    assert "freeze the sample into an initializer" in issues["noise"].reason
    assert "data-dependent output shape" in issues["nz"].reason
    assert all(i.rule == "unroll" and i.reason.startswith("unroll policy: ") for i in issues.values())


def test_restrictions_from_the_table_name_the_node() -> None:
    x = _vi("x")
    nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["m"], name="mean_dyn_axes"),
             helper.make_node("Resize", ["x", "", "scales"], ["r"], name="cubic", mode="cubic"),
             helper.make_node("TopK", ["x", "k"], ["v", "i"], name="topk_unsorted", sorted=0),
             helper.make_node("MaxPool", ["x"], ["p"], name="dilated_pool", kernel_shape=[2, 2], dilations=[2, 2])]
    model = _model(nodes, [x, helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
                   [_vi("m", shape=None), _vi("r", shape=None), _vi("v", shape=None), _vi("p", shape=None)],
                   [_init("scales", np.array([1, 1, 2, 2], np.float32)), _init("k", np.array([2], np.int64))], opset=18)
    by_node = {}
    for i in lint(model):
        by_node.setdefault(i.node, []).append(i.reason)
    assert by_node["mean_dyn_axes"] == [f"{TRT}: `axes` of ReduceMean must be an initializer"]
    assert by_node["cubic"] == [f"{TRT}: Resize mode 'cubic' is unsupported (supported: nearest, linear)"]
    assert by_node["topk_unsorted"] == [f"{TRT}: TopK needs `sorted` = 1"]
    assert by_node["dilated_pool"] == [f"{TRT}: MaxPool `dilations` must be empty or all ones (is [2, 2])"]


def test_types_outside_the_tables_column_are_named() -> None:
    bias = _init("bias_q", np.arange(4, dtype=np.int32))
    nodes = [helper.make_node("DequantizeLinear", ["bias_q", "s"], ["b"], name="bias_dq")]
    model = _model(nodes, [], [_vi("b", shape=(4,))], [bias, _init("s", np.float32(0.1))])
    assert _reasons(model, "bias_dq") == [f"DequantizeLinear on INT32 ('bias_q') is not supported by {TRT} "
                                          "(supported: INT8, FP8, FP4, INT4)"]
    io = _model([helper.make_node("Identity", ["x"], ["y"], name="id")], [_vi("x", TensorProto.STRING, (2,))],
                [_vi("y", TensorProto.STRING, (2,))])
    assert {(i.node, i.op) for i in lint(io)} >= {("x", "graph I/O"), ("y", "graph I/O")}


# ----------------------------------------------------------------------------------------------- Q/DQ rules


def test_a_tensorrt_ready_qdq_conv_is_clean() -> None:
    model = _qdq_conv()
    onnx.checker.check_model(model, full_check=True)
    assert lint(model) == []
    rep = check(model, "conv")
    assert rep["ok"] and rep["issues"] == [] and rep["operator_table"]["tensorrt"] == "10.15"


def test_asymmetric_zero_point_is_rejected() -> None:
    model = _qdq_conv(x_zp=np.int8(3))
    for node in ("x_q", "x_dq"):
        assert _reasons(model, node) == [f"zero point 'x_zp' is not 0 (values [3]): {TRT} supports symmetric "
                                         "quantization only (zero point 0)"]


def test_uint8_zero_point_is_rejected_even_at_zero() -> None:
    model = _qdq_conv(x_zp=np.uint8(0))
    reasons = _reasons(model, "x_q")
    assert reasons == [f"zero point 'x_zp' is UINT8: {TRT} quantizes to INT8 (or FP8/INT4/FP4); asymmetric UINT8 "
                       "quantization runs only on DLA"]
    assert any("DequantizeLinear on UINT8" in r for r in _reasons(model, "x_dq"))


def test_a_quantize_without_zero_point_is_uint8_in_onnx_and_int8_in_tensorrt() -> None:
    model = _qdq_conv()
    for n in model.graph.node:
        if n.name in ("x_q", "x_dq"):
            del n.input[2]
    assert _reasons(model, "x_q") == [f"no zero point: ONNX quantizes to UINT8 then, {TRT} to INT8 (its parser's "
                                      "default), so ONNX Runtime and TensorRT would compute different values; give "
                                      "it an INT8 zero point of 0"]
    assert _reasons(model, "x_dq") == [f"DequantizeLinear on UINT8 ('xq') is not supported by {TRT} (supported: "
                                       "INT8, FP8, FP4, INT4)"]


def test_int32_zero_point_is_rejected() -> None:
    assert any("is INT32" in r and "INT32 is not a quantized type" in r
               for r in _reasons(_qdq_conv(x_zp=np.int32(0)), "x_q"))


def test_scale_must_be_a_positive_finite_constant() -> None:
    dyn = _qdq_conv(scale_as_input=True)
    assert _reasons(dyn, "x_q") == [f"scale 'x_scale' is not a build-time constant: {TRT} needs an initializer or "
                                    "Constant"]
    neg = _qdq_conv(w_scale=[0.01, -0.01, 0.01, 0.01])
    assert any("not finite and positive (min -0.01)" in r for r in _reasons(neg, "w_q"))
    inf = _qdq_conv(x_scale=np.inf)
    assert any("not finite and positive" in r for r in _reasons(inf, "x_dq"))


def test_a_2d_scale_is_rejected() -> None:
    model = _qdq_conv(w_scale=np.full((4, 4), 0.01), w_zp=np.zeros((4, 4), np.int8))
    assert any(r.startswith("scale 'w_scale' has shape [4, 4]: for INT8 TensorRT 10.15 takes a scalar (per-tensor) "
                            "or a 1-D scale (per-channel)") for r in _reasons(model, "w_q"))


def test_per_channel_scale_must_match_the_channel_count_and_axis() -> None:
    short = _qdq_conv(w_scale=np.full(3, 0.01))
    assert any("per-channel scale has 3 coefficients but 'W' has 4 channels along axis 0" in r
               for r in _reasons(short, "w_q"))
    # 4 input channels too, so the size matches: only the axis is wrong (Conv's output channels are axis 0)
    wrong_axis = _qdq_conv(w_axis=1)
    assert _reasons(wrong_axis, "w_q") == [
        "per-channel weight scale runs along axis 1, but Conv 'conv' has its output channels on axis 0 "
        "(unroll's rule: per-channel weights are quantized along the output-channel axis)"]
    assert _reasons(_qdq_conv(opset=12), "w_q")[0].startswith("per-channel Q/DQ needs opset 13 or newer")


def test_lint_report_and_error_list_tensorrt_rules_first() -> None:
    model = _qdq_conv(x_zp=np.int8(3))
    model.graph.node.append(helper.make_node("RandomUniformLike", ["y"], ["noise"], name="noise"))
    rep = lint_report(model)
    assert not rep["ok"] and rep["issues"][0].startswith("node 'x_q' (QuantizeLinear): zero point")
    assert rep["issues"][-1].startswith("node 'noise' (RandomUniformLike): unroll policy:")
    assert rep["operator_table"]["source"] == op_table().source_url and "Loop" in rep["policy"]
    msg = str(lint_failure("m.int8.onnx", lint(model)))
    assert msg.index(f"{TRT} would reject:") < msg.index("unroll's serving-graph policy refuses:")
    assert LintIssue("n", "Op", "why").message == "why"


# ----------------------------------------------------------------------------------------------- real graphs


def test_onnxruntime_default_quantization_is_rejected_and_unrolls_int8_passes(demo_onnx_dir: Path, tmp_path) -> None:
    """ONNX Runtime's default static quantization (asymmetric UINT8 activations, int32 biases) is not a graph
    TensorRT builds; unroll's settings give one it does, with Q/DQ only on the inputs of its INT8 layers."""
    from onnxruntime.quantization import QuantType, quantize_static

    from unroll.export.quantize import _Reader

    src = demo_onnx_dir / "sdnet-mnist.onnx"
    feeds = calibration_inputs(from_onnx(src), 32)
    quantize_static(str(src), str(tmp_path / "ort_default.onnx"), _Reader(feeds), activation_type=QuantType.QUInt8)
    issues = lint(onnx.load(tmp_path / "ort_default.onnx"))
    reasons = [i.reason for i in issues]
    assert any("is UINT8" in r and "runs only on DLA" in r for r in reasons)
    assert any("is not 0" in r for r in reasons)
    assert any(r.startswith("DequantizeLinear on INT32") for r in reasons)  # int32-quantized biases

    ours = to_int8(src, feeds, [], tmp_path / "unroll.onnx")
    assert lint(ours) == []
    g = ours.graph
    producers = {o: n for n in g.node for o in n.output}
    weighted = {"Conv", "ConvTranspose", "Gemm", "MatMul"}
    for dq in (n for n in g.node if n.op_type == "DequantizeLinear"):
        readers = [(n.op_type, list(n.input).index(dq.output[0])) for n in g.node if dq.output[0] in n.input]
        assert len(readers) == 1 and readers[0][0] in weighted, (dq.name, readers)  # a dedicated pair, on an input
        assert producers[dq.input[0]].op_type == "QuantizeLinear"  # always a Q→DQ pair (weights stay FP32)
    assert all(o.name not in {n.output[0] for n in g.node if n.op_type == "DequantizeLinear"} for o in g.output)
    assert not any(n.op_type == "DequantizeLinear" and n.input[0] in {t.name for t in g.initializer} for n in g.node)
