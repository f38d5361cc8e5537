"""TensorRT compatibility lint for ONNX graphs, runnable on a CPU.

Every graph TensorRT will parse (the FP32 export and the FP16/INT8 graphs of ``unroll quantize``) goes through
:func:`lint` before it is written, so a graph TensorRT would reject fails here, naming the node and the reason,
rather than on the GPU server. Two kinds of rule, kept apart: TensorRT's own (:func:`tensorrt_issues`: the ONNX
parser's operator table for TensorRT 10.15, shipped as ``tensorrt_onnx_ops_10.15.json``, and its documented Q/DQ
rules), and unroll's serving-graph policy (:func:`policy_issues`: no control flow, data-dependent shapes or random
ops in an unrolled graph), whose messages say "unroll policy", never "not supported by TensorRT".
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from unroll.errors import LintError

OPS_FILE = Path(__file__).with_name("tensorrt_onnx_ops_10.15.json")

#: ONNX element types by the names TensorRT's operator table uses (DOUBLE is cast down to FP32 by the parser).
_TYPE_NAMES = {
    TensorProto.FLOAT: "FP32", TensorProto.FLOAT16: "FP16", TensorProto.BFLOAT16: "BF16", TensorProto.DOUBLE: "DOUBLE",
    TensorProto.INT32: "INT32", TensorProto.INT64: "INT64", TensorProto.INT8: "INT8", TensorProto.UINT8: "UINT8",
    TensorProto.BOOL: "BOOL", TensorProto.INT4: "INT4", TensorProto.FLOAT8E4M3FN: "FP8",
    TensorProto.FLOAT4E2M1: "FP4",
}
#: Quantized types TensorRT accepts on a Q/DQ (zero-point / data type); UINT8 only on DLA.
_QUANT_TYPES = {TensorProto.INT8, TensorProto.INT4, TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT4E2M1}
#: Graph input/output types TensorRT binds (quantized types are reachable only through Q/DQ, not as I/O).
_IO_TYPES = {"FP32", "FP16", "BF16", "DOUBLE", "INT32", "INT64", "UINT8", "BOOL"}

#: unroll's serving-graph policy: operators TensorRT 10.15 parses but unroll refuses in a served graph.
POLICY = {
    "Loop": "control flow in a serving graph: unroll the iterations into a static graph at export",
    "If": "control flow in a serving graph: resolve the branch at export",
    "Scan": "control flow in a serving graph: unroll the iterations into a static graph at export",
    "NonZero": "data-dependent output shape: a served graph's shapes follow from its input shapes only",
    "RandomNormal": "random sampling in a serving graph (TensorRT ignores the seed): freeze the sample "
                    "into an initializer",
    "RandomNormalLike": "random sampling in a serving graph (TensorRT ignores the seed): freeze the sample "
                        "into an initializer",
    "RandomUniform": "random sampling in a serving graph (TensorRT ignores the seed): freeze the sample "
                     "into an initializer",
    "RandomUniformLike": "random sampling in a serving graph (TensorRT ignores the seed): freeze the sample "
                         "into an initializer",
}

_REDUCE = {"ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin",
           "ReduceProd", "ReduceSum", "ReduceSumSquare"}
_RESIZE_COORD = {"half_pixel", "pytorch_half_pixel", "tf_half_pixel_for_nn", "asymmetric", "align_corners"}
_RESIZE_NEAREST = {"floor", "ceil", "round_prefer_floor", "round_prefer_ceil"}
#: Which tensor of a node the table's "Supported Types" column is about (default: input 0).
_TYPED_TENSOR = {"Where": ("input", 1), "Constant": ("output", 0), "ConstantOfShape": ("output", 0)}
#: Weighted ops: the input index of the weight and its output-channel axis (None: depends on attributes).
_WEIGHTED = {"Conv": 0, "ConvTranspose": 1, "Gemm": None, "MatMul": None}


@dataclass(frozen=True)
class OpTable:
    """TensorRT's ONNX operator support matrix for one TensorRT version."""

    tensorrt_version: str
    opset_range: tuple[int, int]
    source_url: str
    commit: str
    operators: dict[str, dict]

    @property
    def product(self) -> str:
        return f"TensorRT {self.tensorrt_version}"


@functools.cache
def op_table() -> OpTable:
    """The operator table shipped with unroll (``tensorrt_onnx_ops_10.15.json``)."""
    d = json.loads(OPS_FILE.read_text())
    return OpTable(d["tensorrt_version"], tuple(d["opset_range"]), d["source"]["url"], d["source"]["commit"],
                   d["operators"])


@dataclass(frozen=True)
class LintIssue:
    """One problem: the node's name, its op type, why, and whose rule (``tensorrt`` or ``unroll``)."""

    node: str
    op: str
    reason: str
    rule: str = "tensorrt"

    @property
    def message(self) -> str:  # the earlier field name
        return self.reason

    def __str__(self) -> str:
        return f"node {self.node!r} ({self.op}): {self.reason}"


def lint_failure(what: str, issues: list[LintIssue]) -> LintError:
    """The :class:`LintError` saying that ``what`` fails the lint, with every issue listed."""
    return LintError(f"{what} fails the TensorRT lint:\n{format_issues(issues)}", issues)


def format_issues(issues: list[LintIssue]) -> str:
    """The issues one per line, TensorRT's rules first, then unroll's policy."""
    trt = [f"  {i}" for i in issues if i.rule == "tensorrt"]
    own = [f"  {i}" for i in issues if i.rule != "tensorrt"]
    parts = []
    if trt:
        parts.append(f"{op_table().product} would reject:\n" + "\n".join(trt))
    if own:
        parts.append("unroll's serving-graph policy refuses:\n" + "\n".join(own))
    return "\n".join(parts)


# ----------------------------------------------------------------------------------------------- graph helpers


def _nodes(graph: onnx.GraphProto):
    """Every node, including those of subgraphs (Loop/If/Scan bodies: TensorRT parses them too)."""
    for n in graph.node:
        yield n
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _nodes(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _nodes(g)


def _constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Initializers and ``Constant`` outputs (build-time constants), as arrays."""
    out: dict[str, np.ndarray] = {}

    def visit(graph: onnx.GraphProto) -> None:
        for t in graph.initializer:
            out[t.name] = numpy_helper.to_array(t)
    visit(model.graph)
    for n in _nodes(model.graph):
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                visit(a.g)
        if n.op_type == "Constant" and n.attribute and n.attribute[0].type == onnx.AttributeProto.TENSOR:
            out[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    return out


def _value_types(model: onnx.ModelProto) -> tuple[dict[str, int], dict[str, list]]:
    """Element type and shape (dims as int or None) of every tensor shape inference can tell."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # a graph shape inference cannot handle: type checks fall back to what is declared
        inferred = model
    g = inferred.graph
    types: dict[str, int] = {}
    shapes: dict[str, list] = {}
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        tt = vi.type.tensor_type
        if tt.elem_type:
            types[vi.name] = tt.elem_type
        if tt.HasField("shape"):
            shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
    for t in g.initializer:
        types[t.name] = t.data_type
        shapes[t.name] = list(t.dims)
    for n in g.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].type == onnx.AttributeProto.TENSOR:
            types[n.output[0]] = n.attribute[0].t.data_type
            shapes[n.output[0]] = list(n.attribute[0].t.dims)
    return types, shapes


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _str(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _opset(model: onnx.ModelProto) -> int | None:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)


def _type_name(elem: int) -> str:
    return _TYPE_NAMES.get(elem, TensorProto.DataType.Name(elem))


# ----------------------------------------------------------------------------------------------- TensorRT rules


def _restrictions(n: onnx.NodeProto, consts: dict, graph_inputs: set[str], trt: str) -> list[str]:
    """The table's per-operator restrictions that a vision graph can hit (its wording, TensorRT's version)."""
    op = n.op_type
    bad: list[str] = []
    if op in _REDUCE and len(n.input) > 1 and n.input[1] and n.input[1] not in consts:
        bad.append(f"{trt}: `axes` of {op} must be an initializer")
    elif op == "CumSum" and len(n.input) > 1 and n.input[1] not in consts:
        bad.append(f"{trt}: `axis` of CumSum must be a build-time constant")
    elif op in ("Squeeze", "Unsqueeze") and len(n.input) > 1 and n.input[1] in graph_inputs:
        bad.append(f"{trt}: `axes` of {op} must be resolvable to a constant (here a graph input)")
    elif op == "TopK":
        if _attr(n, "sorted", 1) != 1:
            bad.append(f"{trt}: TopK needs `sorted` = 1")
        k = consts.get(n.input[1]) if len(n.input) > 1 else None
        if k is not None and int(np.asarray(k).reshape(-1)[0]) >= 3840:
            bad.append(f"{trt}: TopK's `K` must be less than 3840 (is {int(np.asarray(k).reshape(-1)[0])})")
    elif op == "Resize":
        coord = _str(_attr(n, "coordinate_transformation_mode", "half_pixel"))
        mode = _str(_attr(n, "mode", "nearest"))
        nearest = _str(_attr(n, "nearest_mode", "round_prefer_floor"))
        if coord not in _RESIZE_COORD:
            bad.append(f"{trt}: Resize coordinate_transformation_mode {coord!r} is unsupported "
                       f"(supported: {', '.join(sorted(_RESIZE_COORD))})")
        if mode not in ("nearest", "linear"):
            bad.append(f"{trt}: Resize mode {mode!r} is unsupported (supported: nearest, linear)")
        if mode == "nearest" and nearest not in _RESIZE_NEAREST:
            bad.append(f"{trt}: Resize nearest_mode {nearest!r} is unsupported")
        if _attr(n, "antialias", 0):
            bad.append(f"{trt}: Resize antialiasing is not supported")
        if _str(_attr(n, "keep_aspect_ratio_policy", "stretch")) != "stretch":
            bad.append(f"{trt}: Resize keep_aspect_ratio_policy must be 'stretch'")
    elif op in ("MaxPool", "AveragePool", "LpPool"):
        dil = _attr(n, "dilations", None)
        if dil and any(d != 1 for d in dil):
            bad.append(f"{trt}: {op} `dilations` must be empty or all ones (is {list(dil)})")
        ks = _attr(n, "kernel_shape", [])
        if op != "LpPool" and len(ks) not in (2, 3):
            bad.append(f"{trt}: {op} supports 2D or 3D pooling only (kernel_shape {list(ks)})")
        if op == "MaxPool" and len(n.output) > 1 and n.output[1]:
            bad.append(f"{trt}: MaxPool's `Indices` output is unsupported")
    elif op == "Dropout" and len(n.input) > 2 and n.input[2]:
        t = consts.get(n.input[2])
        if t is None or bool(np.asarray(t).reshape(-1)[0]):
            bad.append(f"{trt}: Dropout `is_training` must be an initializer that evaluates to False")
    elif op == "LayerNormalization" and any(o for o in n.output[1:]):
        bad.append(f"{trt}: only LayerNormalization's first output `Y` is supported")
    elif op == "ScatterND" and _str(_attr(n, "reduction", "none")) != "none":
        bad.append(f"{trt}: ScatterND `reduction` other than `none` is not supported")
    elif op == "Constant" and any(a.name in ("sparse_value", "value_string", "value_strings") for a in n.attribute):
        bad.append(f"{trt}: Constant's sparse_value / value_string / value_strings attributes are unsupported")
    elif op == "OneHot" and len(n.input) > 1 and n.input[1] not in consts:
        bad.append(f"{trt}: OneHot `depth` must be a build-time constant")
    elif op == "STFT" and any(len(n.input) > i and n.input[i] and n.input[i] not in consts for i in (1, 2)):
        bad.append(f"{trt}: STFT `frame_step` and `window` must be initializers")
    return bad


def _weight_axis(consumer: onnx.NodeProto, rank: int) -> int | None:
    """Output-channel axis of the weight input (index 1) of a weighted op."""
    if consumer.op_type == "Gemm":
        return 0 if _attr(consumer, "transB", 0) else 1
    if consumer.op_type == "MatMul":
        return rank - 1
    return _WEIGHTED.get(consumer.op_type)


def _qdq_issues(n: onnx.NodeProto, consts: dict, types: dict, shapes: dict,
                consumers: dict[str, list[tuple[onnx.NodeProto, int]]], opset: int | None, trt: str) -> list[str]:
    """TensorRT's explicit-quantization rules for one QuantizeLinear / DequantizeLinear."""
    bad: list[str] = []
    if len(n.input) < 2 or not n.input[1]:
        return [f"{trt} needs a scale input on {n.op_type}"]
    scale = consts.get(n.input[1])
    if scale is None:
        bad.append(f"scale {n.input[1]!r} is not a build-time constant: {trt} needs an initializer or Constant")
    else:
        s = np.asarray(scale, dtype=np.float64)
        if s.size == 0:
            bad.append(f"scale {n.input[1]!r} is empty")
        elif not np.all(np.isfinite(s)) or not np.all(s > 0):
            bad.append(f"scale {n.input[1]!r} has coefficients that are not finite and positive "
                       f"(min {s.min():.3g}): {trt} needs all scale coefficients strictly positive")
        if s.ndim >= 2:
            bad.append(f"scale {n.input[1]!r} has shape {list(s.shape)}: for INT8 {trt} takes a scalar "
                       "(per-tensor) or a 1-D scale (per-channel); block-wise scales are for INT4 weights only")
    if n.op_type == "QuantizeLinear" and not (len(n.input) > 2 and n.input[2]) and not _attr(n, "output_dtype", 0):
        bad.append(f"no zero point: ONNX quantizes to UINT8 then, {trt} to INT8 (its parser's default), so ONNX "
                   "Runtime and TensorRT would compute different values; give it an INT8 zero point of 0")
    if len(n.input) > 2 and n.input[2]:
        zp_name = n.input[2]
        zp = consts.get(zp_name)
        ztype = types.get(zp_name)
        if ztype is not None and ztype not in _QUANT_TYPES:
            tname = _type_name(ztype)
            why = ("asymmetric UINT8 quantization runs only on DLA" if ztype == TensorProto.UINT8
                   else f"{tname} is not a quantized type")
            bad.append(f"zero point {zp_name!r} is {tname}: {trt} quantizes to INT8 (or FP8/INT4/FP4); {why}")
        if zp is None:
            bad.append(f"zero point {zp_name!r} is not a build-time constant: {trt} must see that it is 0")
        else:
            z = np.asarray(zp)
            if np.any(z.astype(np.float64) != 0):
                bad.append(f"zero point {zp_name!r} is not 0 (values {np.unique(z)[:4].tolist()}): {trt} "
                           "supports symmetric quantization only (zero point 0)")
            if scale is not None and z.size != np.asarray(scale).size:
                bad.append(f"zero point {zp_name!r} has {z.size} coefficients, the scale {np.asarray(scale).size}: "
                           f"{trt} needs the same volume")
    x = n.input[0]
    if scale is not None and np.asarray(scale).ndim == 1 and np.asarray(scale).size > 1:
        if opset is not None and opset < 13:
            bad.append(f"per-channel Q/DQ needs opset 13 or newer (the `axis` attribute); the graph is opset {opset}")
        xshape = shapes.get(x)
        rank = len(xshape) if xshape is not None else None
        axis = _attr(n, "axis", 1)
        if rank is not None:
            ax = axis + rank if axis < 0 else axis
            if not 0 <= ax < rank:
                bad.append(f"`axis` {axis} is out of range for {x!r} of rank {rank}")
            else:
                k = xshape[ax]
                if k is not None and k != np.asarray(scale).size:
                    bad.append(f"per-channel scale has {np.asarray(scale).size} coefficients but {x!r} has {k} "
                               f"channels along axis {ax}: {trt} needs one scale per channel")
                expected = _expected_weight_axes(n, rank, consumers) if x in consts else {}
                for (cname, cop), want in expected.items():
                    if want is not None and want != ax:
                        bad.append(f"per-channel weight scale runs along axis {ax}, but {cop} {cname!r} has its "
                                   f"output channels on axis {want} (unroll's rule: per-channel weights "
                                   "are quantized along the output-channel axis)")
    return bad


def _expected_weight_axes(n: onnx.NodeProto, rank: int,
                          consumers: dict[str, list[tuple[onnx.NodeProto, int]]]) -> dict[tuple[str, str], int | None]:
    """For a Q/DQ on a constant: the weighted ops that take its (dequantized) output as their weight."""
    outs = [n.output[0]]
    if n.op_type == "QuantizeLinear":  # W -> Q -> DQ -> op
        outs = [c.output[0] for c, _ in consumers.get(n.output[0], []) if c.op_type == "DequantizeLinear"]
    found: dict[tuple[str, str], int | None] = {}
    for o in outs:
        for c, idx in consumers.get(o, []):
            if c.op_type in _WEIGHTED and idx == 1:
                found[(c.name, c.op_type)] = _weight_axis(c, rank)
    return found


def tensorrt_issues(model: onnx.ModelProto) -> list[LintIssue]:
    """Every node TensorRT 10.15's ONNX parser would reject, with the reason (its operator table, Q/DQ rules)."""
    table = op_table()
    trt = table.product
    consts = _constants(model)
    types, shapes = _value_types(model)
    opset = _opset(model)
    graph_inputs = {i.name for i in model.graph.input} - set(consts)
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for c in _nodes(model.graph):
        for idx, i in enumerate(c.input):
            consumers.setdefault(i, []).append((c, idx))
    issues: list[LintIssue] = []
    lo, hi = table.opset_range
    if opset is not None and not lo <= opset <= hi:
        issues.append(LintIssue("(graph)", "opset", f"opset {opset} is outside {trt}'s range {lo}–{hi}"))
    for i, n in enumerate(_nodes(model.graph)):
        name = n.name or f"#{i}"
        if n.domain not in ("", "ai.onnx"):
            issues.append(LintIssue(name, n.op_type, f"custom domain {n.domain!r}: {trt} needs a plugin for it"))
            continue
        entry = table.operators.get(n.op_type)
        if entry is None:
            issues.append(LintIssue(name, n.op_type, f"{n.op_type} is not in {trt}'s ONNX operator list"))
            continue
        if not entry["supported"]:
            note = f" ({entry['restrictions']})" if entry.get("restrictions") else ""
            issues.append(LintIssue(name, n.op_type, f"{n.op_type} is not supported by {trt}{note}"))
            continue
        where, idx = _TYPED_TENSOR.get(n.op_type, ("input", 0))
        tensors = n.input if where == "input" else n.output
        if n.op_type in ("Cast", "CastLike"):
            checked = [n.input[0], n.output[0]]
        else:
            checked = [tensors[idx]] if len(tensors) > idx and tensors[idx] else []
        allowed = set(entry["types"]) | ({"DOUBLE"} if "FP32" in entry["types"] else set())
        for t in checked:
            if t in types and _type_name(types[t]) not in allowed:
                issues.append(LintIssue(name, n.op_type, f"{n.op_type} on {_type_name(types[t])} ({t!r}) is not "
                                        f"supported by {trt} (supported: {', '.join(entry['types'])})"))
        for reason in _restrictions(n, consts, graph_inputs, trt):
            issues.append(LintIssue(name, n.op_type, reason))
        if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            for reason in _qdq_issues(n, consts, types, shapes, consumers, opset, trt):
                issues.append(LintIssue(name, n.op_type, reason))
    for vi in list(model.graph.input) + list(model.graph.output):
        elem = vi.type.tensor_type.elem_type
        if elem and _type_name(elem) not in _IO_TYPES:
            issues.append(LintIssue(vi.name, "graph I/O", f"{_type_name(elem)} is not a network input/output "
                                    f"type {trt} binds (FP32, FP16, BF16, INT32, INT64, UINT8, BOOL)"))
    return issues


# ----------------------------------------------------------------------------------------------- unroll policy


def policy_issues(model: onnx.ModelProto) -> list[LintIssue]:
    """What unroll refuses in a serving graph although TensorRT parses it (see :data:`POLICY`)."""
    trt = op_table().product
    issues = []
    for i, n in enumerate(_nodes(model.graph)):
        if n.domain in ("", "ai.onnx") and n.op_type in POLICY:
            issues.append(LintIssue(n.name or f"#{i}", n.op_type,
                                    f"unroll policy: {POLICY[n.op_type]} ({trt} parses {n.op_type}; "
                                    "unroll does not serve it)", rule="unroll"))
    return issues


def lint(model: onnx.ModelProto) -> list[LintIssue]:
    """Every issue: TensorRT's rules (:func:`tensorrt_issues`), then unroll's policy (:func:`policy_issues`)."""
    return tensorrt_issues(model) + policy_issues(model)


def lint_report(model: onnx.ModelProto, issues: list[LintIssue] | None = None) -> dict:
    """The ``trt_lint`` entry of a report: the result and what it was checked against."""
    table = op_table()
    issues = lint(model) if issues is None else issues
    return {"ok": not issues, "issues": [str(i) for i in issues],
            "checked": f"{table.product} ONNX parser operator table (opset {table.opset_range[0]}–"
                       f"{table.opset_range[1]}), TensorRT Q/DQ rules, unroll's serving-graph policy",
            "operator_table": {"tensorrt": table.tensorrt_version, "source": table.source_url},
            "policy": sorted(POLICY)}


def check(model: onnx.ModelProto, what: str) -> dict:
    """:func:`lint_report` for a clean graph; :class:`LintError` naming every node and reason otherwise."""
    issues = lint(model)
    if issues:
        raise lint_failure(what, issues)
    return lint_report(model, issues)
