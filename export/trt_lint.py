"""TensorRT compatibility lint for ONNX graphs, runnable on a CPU.

Checks every node against the ONNX operators the TensorRT 10/11 ONNX parser supports and the
restrictions that make a parse fail (from the parser's operator-support table), so an export that
TensorRT would reject fails here, naming the node, instead of on the GPU server.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import numpy_helper

#: Operators the TensorRT 10.x / 11.x ONNX parser imports (the subset relevant to vision graphs).
SUPPORTED = {
    "Abs", "Add", "And", "ArgMax", "ArgMin", "AveragePool", "BatchNormalization", "Cast", "Ceil", "Clip",
    "Concat", "Constant", "ConstantOfShape", "Conv", "ConvTranspose", "Cos", "CumSum", "DepthToSpace",
    "DequantizeLinear", "Div", "Dropout", "Einsum", "Elu", "Equal", "Erf", "Exp", "Expand", "Flatten", "Floor",
    "Gather", "GatherElements", "GatherND", "Gelu", "Gemm", "GlobalAveragePool", "GlobalMaxPool", "Greater",
    "GreaterOrEqual", "HardSigmoid", "Identity", "InstanceNormalization", "LayerNormalization", "LeakyRelu",
    "Less", "LessOrEqual", "Log", "LogSoftmax", "MatMul", "Max", "MaxPool", "Mean", "Min", "Mod", "Mul",
    "Neg", "Not", "Or", "Pad", "Pow", "PRelu", "QuantizeLinear", "Range", "Reciprocal", "ReduceL1",
    "ReduceL2", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd", "ReduceSum",
    "ReduceSumSquare", "Relu", "Reshape", "Resize", "Selu", "Shape", "Shrink", "Sigmoid", "Sign", "Sin",
    "Size", "Slice", "Softmax", "Softplus", "Softsign", "SpaceToDepth", "Split", "Sqrt", "Squeeze", "Sub",
    "Sum", "Tanh", "Tile", "TopK", "Transpose", "Unsqueeze", "Where", "Xor",
}
#: Never acceptable in an unrolled serving graph (control flow, data-dependent shapes, randomness, DFT).
FORBIDDEN = {
    "Loop": "control flow: unroll the iterations into a static graph",
    "If": "control flow: resolve the branch at export time",
    "Scan": "control flow: unroll the iterations",
    "Compress": "data-dependent output shape",
    "NonZero": "data-dependent output shape",
    "DFT": "no TensorRT importer for DFT",
    "STFT": "no TensorRT importer for STFT",
    "RandomNormal": "random op: freeze it into an initializer",
    "RandomNormalLike": "random op: freeze it into an initializer",
    "RandomUniform": "random op: freeze it into an initializer",
    "RandomUniformLike": "random op: freeze it into an initializer",
    "Multinomial": "random op",
    "Bernoulli": "random op",
    "SequenceConstruct": "sequence types are not supported",
}
_AXES_AS_INPUT = {"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                  "ReduceSumSquare", "ReduceLogSumExp"}


@dataclass
class LintIssue:
    node: str
    op: str
    message: str

    def __str__(self) -> str:
        return f"node {self.node!r} ({self.op}): {self.message}"


def _constants(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    out = {t.name: t for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.attribute:
            a = n.attribute[0]
            if a.type == onnx.AttributeProto.TENSOR:
                out[n.output[0]] = a.t
    return out


def lint(model: onnx.ModelProto) -> list[LintIssue]:
    """Every node TensorRT's ONNX parser would reject, with the reason."""
    consts = _constants(model)
    issues: list[LintIssue] = []
    for i, n in enumerate(model.graph.node):
        name = n.name or f"#{i}"
        if n.domain not in ("", "ai.onnx"):
            issues.append(LintIssue(name, n.op_type, f"custom domain {n.domain!r} needs a TensorRT plugin"))
        elif n.op_type in FORBIDDEN:
            issues.append(LintIssue(name, n.op_type, FORBIDDEN[n.op_type]))
        elif n.op_type not in SUPPORTED:
            issues.append(LintIssue(name, n.op_type, "operator not supported by the TensorRT ONNX parser"))
        elif n.op_type == "Shrink":
            for a in n.attribute:
                if a.type != onnx.AttributeProto.FLOAT:
                    issues.append(LintIssue(name, n.op_type, f"attribute {a.name} must be a scalar float"))
        elif n.op_type in _AXES_AS_INPUT and len(n.input) > 1 and n.input[1] and n.input[1] not in consts:
            issues.append(LintIssue(name, n.op_type, "reduction axes must be an initializer (constant)"))
        elif n.op_type == "Clip":
            for inp in n.input[1:]:
                if inp and inp in consts and numpy_helper.to_array(consts[inp]).size != 1:
                    issues.append(LintIssue(name, n.op_type, "Clip min/max must be scalars"))
        elif n.op_type == "Pad":
            mode = next((a.s.decode() for a in n.attribute if a.name == "mode"), "constant")
            if mode not in ("constant", "reflect", "edge", "wrap"):
                issues.append(LintIssue(name, n.op_type, f"unsupported pad mode {mode!r}"))
        elif n.op_type in ("ConvTranspose", "Conv"):
            if any(a.name == "auto_pad" and a.s not in (b"NOTSET", b"") for a in n.attribute):
                issues.append(LintIssue(name, n.op_type, "auto_pad other than NOTSET is not supported"))
    for vi in list(model.graph.input) + list(model.graph.output):
        elem = vi.type.tensor_type.elem_type
        if elem in (onnx.TensorProto.DOUBLE, onnx.TensorProto.STRING):
            issues.append(LintIssue(vi.name, "graph I/O", f"type {onnx.TensorProto.DataType.Name(elem)} unsupported"))
    return issues
