"""How much GPU memory an engine needs at its profile's largest shapes: an estimate from the ONNX alone.

``unroll build`` prints it before asking TensorRT for anything and refuses a build that cannot fit
(:func:`check_budget`). On a CPU: ONNX shape inference at the profile's max shapes (ONNX Runtime's symbolic
inference as fallback; unresolved tensors make it a lower bound, and the summary says so), the peak of tensors live
at once in topological order, plus the weights. It is the unfused graph, so TensorRT usually needs less; the right
order of magnitude for choosing a profile. TensorRT's workspace comes on top.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from onnx import TensorProto

from unroll.errors import MemoryBudgetError

__all__ = ["GIB", "MemoryBudgetError", "MemoryEstimate", "TensorBytes", "check_budget", "estimate",
           "gpu_total_bytes", "infer_shapes"]

GIB = 1 << 30


@dataclass(frozen=True)
class TensorBytes:
    """One tensor at the profile's max shapes."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    #: The node that writes it (``graph input`` for inputs).
    producer: str

    def describe(self) -> str:
        return f"{self.name!r} {list(self.shape)} {self.dtype} ({fmt_bytes(self.bytes)}, from {self.producer})"


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak activation memory (liveness over the node order) + weights, at fixed input shapes."""

    input_shapes: dict[str, tuple[int, ...]]
    activation_peak_bytes: int
    #: The node running when the activation peak is reached, and how many tensors are live then.
    peak_node: str
    live_at_peak: int
    weights_bytes: int
    #: Bytes of the graph's inputs and outputs (part of the activation peak; the caller's buffers).
    io_bytes: int
    largest: TensorBytes | None
    #: Tensors whose shape could not be inferred (counted as 0 bytes).
    unknown: tuple[str, ...] = ()
    nodes: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def total_bytes(self) -> int:
        return self.activation_peak_bytes + self.weights_bytes

    def to_json(self) -> dict:
        return {
            "method": "ONNX shape inference at the profile's max shapes; liveness over the node order (unfused "
                      "graph); weights once; TensorRT workspace not included",
            "input_shapes": {k: list(v) for k, v in self.input_shapes.items()},
            "total_bytes": self.total_bytes, "total_gib": round(self.total_bytes / GIB, 3),
            "activation_peak_bytes": self.activation_peak_bytes, "peak_node": self.peak_node,
            "live_at_peak": self.live_at_peak, "weights_bytes": self.weights_bytes, "io_bytes": self.io_bytes,
            "largest_tensor": None if self.largest is None else {
                "name": self.largest.name, "shape": list(self.largest.shape), "dtype": self.largest.dtype,
                "bytes": self.largest.bytes, "producer": self.largest.producer},
            "unknown_shapes": list(self.unknown), "nodes": self.nodes,
        }

    def summary(self) -> str:
        """One paragraph for the console: total, its parts, the largest tensor."""
        bound = " (a lower bound: some shapes are unknown)" if self.unknown else ""
        text = (f"estimated GPU memory at the profile's max shapes: {fmt_bytes(self.total_bytes)}{bound} = "
                f"activations {fmt_bytes(self.activation_peak_bytes)} (peak at node {self.peak_node!r}, "
                f"{self.live_at_peak} tensors live) + weights {fmt_bytes(self.weights_bytes)}")
        if self.largest is not None:
            text += f"; largest tensor {self.largest.describe()}"
        return text


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


_DTYPE_BYTES = {
    TensorProto.FLOAT: 4, TensorProto.FLOAT16: 2, TensorProto.BFLOAT16: 2, TensorProto.DOUBLE: 8,
    TensorProto.INT8: 1, TensorProto.UINT8: 1, TensorProto.INT16: 2, TensorProto.UINT16: 2,
    TensorProto.INT32: 4, TensorProto.UINT32: 4, TensorProto.INT64: 8, TensorProto.UINT64: 8,
    TensorProto.BOOL: 1, TensorProto.FLOAT8E4M3FN: 1, TensorProto.FLOAT8E5M2: 1,
}


def _fixed(model: onnx.ModelProto, input_shapes: Mapping[str, Sequence[int]]) -> onnx.ModelProto:
    """A copy whose graph inputs have ``input_shapes`` and which carries no stale value_info."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    inits = {t.name for t in m.graph.initializer}
    real = [v for v in m.graph.input if v.name not in inits]
    missing = [v.name for v in real if v.name not in input_shapes]
    unknown = [n for n in input_shapes if n not in {v.name for v in real}]
    if missing or unknown:
        raise ValueError(f"shapes given for {sorted(input_shapes)}, but the graph's inputs are "
                         f"{[v.name for v in real]} (missing {missing}, unknown {unknown})")
    for v in real:
        shape = [int(d) for d in input_shapes[v.name]]
        dims = v.type.tensor_type.shape.dim
        if len(dims) != len(shape):
            raise ValueError(f"input {v.name!r} has rank {len(dims)}, the shape given {shape} rank {len(shape)}")
        for d, n in zip(dims, shape, strict=True):
            if d.HasField("dim_value") and d.dim_value > 0 and d.dim_value != n:
                raise ValueError(f"input {v.name!r} has a fixed dimension {d.dim_value}, not {n} ({shape})")
            d.Clear()
            d.dim_value = n
    del m.graph.value_info[:]
    for v in m.graph.output:  # symbolic output dims would only be merged back in
        for d in v.type.tensor_type.shape.dim:
            d.Clear()
    return m


def _known(vi: onnx.ValueInfoProto) -> tuple[int, tuple[int, ...]] | None:
    t = vi.type.tensor_type
    if not t.HasField("shape") or not t.elem_type:
        return None
    dims = []
    for d in t.shape.dim:
        if not d.HasField("dim_value") or d.dim_value < 0:
            return None
        dims.append(int(d.dim_value))
    return t.elem_type, tuple(dims)


def _collect(model: onnx.ModelProto) -> dict[str, tuple[int, tuple[int, ...]]]:
    g = model.graph
    out = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        k = _known(vi)
        if k is not None:
            out[vi.name] = k
    return out


def infer_shapes(model: onnx.ModelProto, input_shapes: Mapping[str, Sequence[int]]
                 ) -> tuple[dict[str, tuple[int, tuple[int, ...]]], list[str]]:
    """``{tensor: (onnx elem type, shape)}`` for every tensor whose shape resolves with the inputs fixed at
    ``input_shapes``, and the notes on how (ONNX, then ONNX Runtime's symbolic inference for the rest)."""
    fixed = _fixed(model, input_shapes)
    inferred = onnx.shape_inference.infer_shapes(fixed, check_type=False, strict_mode=False, data_prop=True)
    shapes = _collect(inferred)
    notes = ["onnx.shape_inference (data_prop)"]
    wanted = {o for n in model.graph.node for o in n.output if o}
    if wanted - set(shapes):
        try:
            from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

            sym = SymbolicShapeInference.infer_shapes(fixed, auto_merge=True, guess_output_rank=False)
        except Exception as e:  # the fallback is best effort; what stays open is reported as unknown
            notes.append(f"onnxruntime symbolic shape inference failed: {type(e).__name__}")
        else:
            more = _collect(sym)
            added = {k: v for k, v in more.items() if k not in shapes}
            shapes.update(added)
            notes.append(f"onnxruntime symbolic shape inference ({len(added)} more tensors)")
    return shapes, notes


def _nbytes(elem: int, shape: tuple[int, ...]) -> int:
    n = _DTYPE_BYTES.get(elem, 4)
    for d in shape:
        n *= d
    return n


def _weights_bytes(model: onnx.ModelProto) -> tuple[int, set[str]]:
    total, names = 0, set()
    for t in model.graph.initializer:
        total += _nbytes(t.data_type, tuple(t.dims))
        names.add(t.name)
    for n in model.graph.node:
        if n.op_type == "Constant" and n.output:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.TENSOR:
                    total += _nbytes(a.t.data_type, tuple(a.t.dims))
            names.add(n.output[0])
    return total, names


def estimate(model: onnx.ModelProto | str | Path, input_shapes: Mapping[str, Sequence[int]]) -> MemoryEstimate:
    """The memory estimate of ``model`` with its inputs at ``input_shapes`` (see the module docstring)."""
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model))
    g = model.graph
    shapes, notes = infer_shapes(model, input_shapes)
    weights, constant = _weights_bytes(model)
    inits = {t.name for t in g.initializer}
    inputs = [v.name for v in g.input if v.name not in inits]
    outputs = {v.name for v in g.output}
    nodes = list(g.node)
    end = len(nodes)

    start: dict[str, int] = {name: 0 for name in inputs}
    producer: dict[str, str] = {name: "graph input" for name in inputs}
    last: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for t in n.input:
            if t and t not in constant:
                last[t] = i
        for t in n.output:
            if t and t not in constant:
                start.setdefault(t, i)
                producer.setdefault(t, n.name or f"#{i} {n.op_type}")
    for t in outputs:
        last[t] = end
    sizes: dict[str, int] = {}
    unknown = []
    for t in start:
        if t in shapes:
            sizes[t] = _nbytes(*shapes[t])
        else:
            sizes[t] = 0
            unknown.append(t)
    # sweep: +bytes when produced, -bytes after the last read
    add: dict[int, int] = {}
    drop: dict[int, int] = {}
    count_add: dict[int, int] = {}
    count_drop: dict[int, int] = {}
    for t, s in start.items():
        e = last.get(t, s)  # produced and never read: live at its own step only
        add[s] = add.get(s, 0) + sizes[t]
        drop[e] = drop.get(e, 0) + sizes[t]
        count_add[s] = count_add.get(s, 0) + 1
        count_drop[e] = count_drop.get(e, 0) + 1
    live = n_live = 0
    peak, peak_step, peak_count = 0, 0, 0
    for step in range(end + 1):
        live += add.get(step, 0)
        n_live += count_add.get(step, 0)
        if live > peak:
            peak, peak_step, peak_count = live, step, n_live
        live -= drop.get(step, 0)
        n_live -= count_drop.get(step, 0)
    peak_node = ("graph outputs" if peak_step >= end else
                 (nodes[peak_step].name or f"#{peak_step} {nodes[peak_step].op_type}"))
    largest = None
    if sizes:
        name = max(sizes, key=lambda t: sizes[t])
        if sizes[name] > 0:
            elem, shape = shapes[name]
            largest = TensorBytes(name, shape, TensorProto.DataType.Name(elem).lower(), sizes[name], producer[name])
    io = sum(sizes.get(t, 0) for t in inputs) + sum(sizes.get(t, 0) for t in outputs)
    return MemoryEstimate({k: tuple(int(d) for d in v) for k, v in input_shapes.items()}, peak, peak_node, peak_count,
                          weights, io, largest, tuple(sorted(unknown)), len(nodes), tuple(notes))


def gpu_total_bytes() -> tuple[int, str] | None:
    """``(total memory in bytes, GPU name)`` of the current CUDA device, or ``None`` where no CUDA is visible."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        dev = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(dev)
        return int(props.total_memory), str(props.name)
    except Exception:  # a broken CUDA set-up: no budget to check against (the build itself will say why)
        return None


def check_budget(est: MemoryEstimate, budget_bytes: int, where: str, lower: str) -> None:
    """Raise :class:`MemoryBudgetError` when ``est`` exceeds ``budget_bytes``.

    ``where`` names the budget (``"the GPU's 16.00 GiB (NVIDIA T4)"``, ``"--max-memory-gib 8"``); ``lower``
    says which options lower the estimate.
    """
    if est.total_bytes > budget_bytes:
        big = f"; its largest tensor is {est.largest.describe()}" if est.largest else ""
        raise MemoryBudgetError(
            f"the profile needs an estimated {fmt_bytes(est.total_bytes)} of GPU memory at its max shapes "
            f"{ {k: list(v) for k, v in est.input_shapes.items()} }, more than {where}{big}: {lower}")
