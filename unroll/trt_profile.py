"""The TensorRT optimization profile of a graph: the axes of its inputs that need ranges, named ``INPUT[AXIS]`` (or by
their ONNX ``dim_param``), the ranges a card or the command line gives them, and :func:`profile_shapes`, the one
min/opt/max builder that ``unroll build`` (``unroll.export``) and ``unroll repo --target gpu`` (``unroll.serving``)
both use. Core module: imports no stage."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import onnx

from unroll.card import ModelCard
from unroll.errors import UnknownDimError

Shape = tuple[int, ...]


Range = tuple[int, int, int]


ProfileShapes = dict[str, tuple[Shape, Shape, Shape]]


def check_range(what: str, lo: int, mid: int, hi: int, floor: int = 1) -> None:
    if not floor <= lo <= mid <= hi:
        raise ValueError(f"{what} must satisfy {floor} ≤ min ≤ opt ≤ max, got {lo}/{mid}/{hi}")


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The real inputs (older exporters also list initializers as graph inputs)."""
    inits = {t.name for t in model.graph.initializer}
    return [v for v in model.graph.input if v.name not in inits]


#: ``INPUT[AXIS]``: one axis of one graph input (axis 0 is the batch), the canonical key of a dim range.
_AXIS_KEY = re.compile(r"(?P<input>.+)\[(?P<axis>\d+)\]")


def axis_key(input_name: str, axis: int) -> str:
    """The canonical name of one graph-input axis in dim ranges: ``INPUT[AXIS]`` (``x[1]``, ``noisy[2]``)."""
    return f"{input_name}[{axis}]"


def dynamic_axes(model: onnx.ModelProto) -> dict[str, str]:
    """Every dynamic non-batch axis of the graph's inputs: ``{"INPUT[AXIS]": dim_param or ""}`` in input order."""
    out = {}
    for v in graph_inputs(model):
        for axis, d in enumerate(v.type.tensor_type.shape.dim):
            if axis > 0 and not (d.HasField("dim_value") and d.dim_value > 0):
                out[axis_key(v.name, axis)] = d.dim_param
    return out


def dim_range_names(model: onnx.ModelProto) -> list[str]:
    """The names ``--dim-range`` accepts for this graph: each dynamic axis as ``INPUT[AXIS]``, and each ONNX
    ``dim_param`` of a dynamic non-batch axis (``tokens``, ``height``), which names every axis carrying it."""
    axes = dynamic_axes(model)
    params = [p for p in dict.fromkeys(axes.values()) if p]
    return [*axes, *params]


def resolve_dim_ranges(model: onnx.ModelProto, ranges: Mapping[str, Sequence[int]] | None
                       ) -> dict[str, Range]:
    """``{"INPUT[AXIS]": (min, opt, max)}`` from ranges named by ``INPUT[AXIS]`` or by ``dim_param``.

    A name that is no dynamic non-batch axis is an :class:`UnknownDimError` naming the valid ones (the batch
    axis has its own range, ``batch``; a fixed axis takes no range). Two names for the same axis must agree.
    """
    axes = dynamic_axes(model)
    valid = dim_range_names(model)
    out: dict[str, Range] = {}
    for name, r in (ranges or {}).items():
        rng = tuple(int(v) for v in r)
        if len(rng) != 3:
            raise ValueError(f"dim range {name!r} needs min, opt and max, got {list(rng)}")
        m = _AXIS_KEY.fullmatch(name)
        if m and int(m.group("axis")) == 0 and any(v.name == m.group("input") for v in graph_inputs(model)):
            raise UnknownDimError(f"{name} is the batch axis: its range is the batch range (--batch-min/--batch-opt/"
                                  "--batch-max, card.trt_profile.batch), not a dim range")
        keys = [name] if name in axes else [k for k, p in axes.items() if p and p == name]
        if not keys:
            fixed = ""
            if m:
                for v in graph_inputs(model):
                    dims = list(v.type.tensor_type.shape.dim)
                    axis = int(m.group("axis"))
                    if v.name == m.group("input") and axis < len(dims) and dims[axis].dim_value > 0:
                        fixed = f" ({name} is fixed at {dims[axis].dim_value} in the graph)"
            raise UnknownDimError(f"no dynamic axis is called {name!r}{fixed}; this graph's dynamic axes are "
                                  f"{', '.join(valid) or 'none (every non-batch axis is fixed)'}")
        for k in keys:
            if k in out and out[k] != rng:
                raise ValueError(f"two ranges for {k}: {list(out[k])} and {list(rng)} ({name})")
            out[k] = rng
    return out


def card_dim_ranges(model: onnx.ModelProto, card: ModelCard) -> dict[str, Range]:
    """The card's ranges (``card.trt_profile.dims``, axes of one sample of the main input) as ``INPUT[AXIS]`` keys
    of this graph's dynamic axes (a card range for an axis the graph fixes is not a range here)."""
    axes = dynamic_axes(model)
    out = {}
    for key, r in card.trt_profile.dims.items():
        check_range(f"card.trt_profile.dims[{key!r}]", *r)
        k = axis_key(card.input.name, int(key) + 1)
        if k in axes:
            out[k] = tuple(r)
    return out


def has_dynamic_image(model: onnx.ModelProto) -> bool:
    """Whether some 4-D input has a dynamic H or W (then image sizes matter)."""
    for v in graph_inputs(model):
        dims = v.type.tensor_type.shape.dim
        if len(dims) == 4 and any(not (d.HasField("dim_value") and d.dim_value > 0) for d in list(dims)[2:]):
            return True
    return False


def profile_shapes(model: onnx.ModelProto, card: ModelCard, batch: Range | None = None,
                   image_sizes: tuple[tuple[int, int], tuple[int, int], tuple[int, int]] | None = None,
                   dim_ranges: Mapping[str, Sequence[int]] | None = None) -> ProfileShapes:
    """min/opt/max shape of every graph input for one TensorRT optimization profile.

    Axis 0 is the batch and follows ``batch`` (default ``card.trt_profile.batch``; ``[B]`` inputs like
    λ/σ follow it too). Every other dynamic axis takes its range from, first, ``dim_ranges`` (names as
    :func:`resolve_dim_ranges` takes them: ``INPUT[AXIS]`` or the ONNX ``dim_param``), then ``image_sizes``
    (``(H, W)`` for min, opt, max, for H and W of a ``[B, C, H, W]`` main input), then the card
    (``card.trt_profile.dims``). Fixed dims keep their ONNX value. A dynamic axis with no range is an error
    naming the input and the card field to set, rather than a silent guess. Axes of the main input must
    stay ≥ ``card.input.min_size``.
    """
    batch = tuple(batch or card.trt_profile.batch)
    check_range("batch", *batch)
    floor = card.input.min_size
    ranges: dict[str, Range] = card_dim_ranges(model, card)
    main_dims = next((len(v.type.tensor_type.shape.dim) for v in graph_inputs(model) if v.name == card.input.name), 0)
    given = resolve_dim_ranges(model, dim_ranges)
    dynamic = dynamic_axes(model)
    image_axes = [axis_key(card.input.name, a) for a in (2, 3)] if main_dims == 4 else []
    if image_sizes is not None and any(k in dynamic for k in image_axes):  # fixed H×W: sizes do not apply
        (h0, w0), (h1, w1), (h2, w2) = image_sizes
        check_range("image height", h0, h1, h2, floor)
        check_range("image width", w0, w1, w2, floor)
        for i, key in enumerate(image_axes):
            if key not in dynamic:
                continue
            if key in given:
                raise ValueError(f"{key} has a dim range and image sizes; give one of them")
            ranges[key] = tuple(s[i] for s in image_sizes)
    ranges.update(given)
    for key, r in ranges.items():
        main = key.startswith(f"{card.input.name}[")
        check_range(f"dim range {key}", *r, floor if main else 1)
    out: ProfileShapes = {}
    for v in graph_inputs(model):
        dims = list(v.type.tensor_type.shape.dim)
        if not dims:
            raise ValueError(f"input {v.name!r} is a scalar or has no shape; TensorRT profiles need ranked inputs")
        main = v.name == card.input.name
        lo, mid, hi = [], [], []
        for axis, d in enumerate(dims):
            key = axis_key(v.name, axis)
            if d.HasField("dim_value") and d.dim_value > 0:
                r = (d.dim_value,) * 3
            elif axis == 0:
                r = batch
            elif key in ranges:
                r = ranges[key]
            else:
                label = d.dim_param or f"axis {axis}"
                hint = (f" (set {card.field_hint('trt_profile', 'dims', str(axis - 1), value='<[min, opt, max]>')}"
                        if main else " (give")
                hint += f" or --dim-range {d.dim_param or key}=MIN:OPT:MAX)"
                raise ValueError(f"input {v.name!r} has a dynamic dimension {label!r} with no range{hint}")
            lo.append(r[0])
            mid.append(r[1])
            hi.append(r[2])
        out[v.name] = (tuple(lo), tuple(mid), tuple(hi))
    return out
