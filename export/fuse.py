"""``unroll fuse``: rewrite the textbook shrinkage and step-size forms of a graph unroll did not write.

Papers' soft thresholds (``sign(v)·relu(|v| − θ)``, ``where(|v| > θ, v − sign(v)·θ, 0)``, …) become the fused forms
unroll's own export writes (:mod:`unroll.solvers.shrink`: ``v − clip(v, −θ, θ)``, ``relu(v − θ)``), and constant
step sizes are folded into weights, with onnxscript's pattern rewriter. A rewrite is taken only when its condition
proves it exact; anything else is left alone and listed in the report, never guessed at. The result is checked
against the input graph with ONNX Runtime before it is written; ``OUT.report.json`` lists every rewrite.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import onnxscript
from onnx_ir.passes.common import LiftConstantsToInitializersPass, RemoveUnusedNodesPass
from onnxscript.rewriter import pattern

from unroll import artifacts
from unroll.card import CARD_KEY, CardError, ModelCard, from_onnx, write_to_onnx
from unroll.errors import FuseError
from unroll.export.card_attach import check_card_fits, load_card_file

#: Export's parity tolerance (unroll.export.onnx_export.MAX_ABS_ERR / MAX_REL_ERR).
MAX_ABS_ERR = 1e-4
MAX_REL_ERR = 1e-5
#: Ops that betray a textbook shrinkage; any left after fusing are named in the report.
SUSPECT_OPS = ("Sign", "Abs", "Where", "Greater", "Less", "GreaterOrEqual", "LessOrEqual")
#: Sizes for dynamic input axes when ``input_shapes`` does not name them: batch 1, every other axis 16.
DEFAULT_BATCH, DEFAULT_DIM = 1, 16


@dataclass
class FuseResult:
    onnx_path: Path
    report_path: Path
    report: dict


# ---------------------------------------------------------------------------------------------- helpers


def _const(v: ir.Value | None) -> np.ndarray | None:
    """A value's constant array (initializer or folded), or ``None`` (also for overridable graph inputs)."""
    if v is None or v.is_graph_input() or v.const_value is None:
        return None
    return v.const_value.numpy()


def _rank(v: ir.Value) -> int | None:
    return None if v.shape is None else len(v.shape)


def _same(a: ir.Value, b: ir.Value) -> bool:
    """The same threshold: one value, or two constants holding equal arrays of the same shape."""
    if a is b:
        return True
    ca, cb = _const(a), _const(b)
    return ca is not None and cb is not None and ca.shape == cb.shape and bool(np.array_equal(ca, cb))


def _negated(lo: ir.Value, hi: ir.Value) -> bool:
    """``lo == −hi``: constants with negated equal arrays, or ``lo = Neg(hi)``."""
    ca, cb = _const(lo), _const(hi)
    if ca is not None and cb is not None:
        return ca.shape == cb.shape and bool(np.array_equal(ca, -cb))
    p = lo.producer()
    return p is not None and p.op_type == "Neg" and p.domain == "" and p.inputs[0] is hi


def _ok_theta(t: ir.Value) -> bool:
    """A threshold that makes the rewrite exact: a constant must be ≥ 0 (a run-time one is assumed to be)."""
    c = _const(t)
    return c is None or (c.dtype.kind == "f" and bool(np.all(c >= 0)))


def _is_zero(z: ir.Value, *shape_sources: ir.Value | None) -> bool:
    """A zero that changes no shape: a one-element constant 0, or ``ConstantOfShape(Shape(s), 0)`` of a source."""
    c = _const(z)
    if c is not None:
        return c.size == 1 and float(c.reshape(())) == 0.0 and (
            c.ndim == 0 or any(s is not None and _rank(s) is not None and c.ndim <= _rank(s) for s in shape_sources))
    p = z.producer()
    if p is None or p.op_type != "ConstantOfShape" or p.domain != "":
        return False
    fill = p.attributes.get("value")
    if fill is not None and float(np.asarray(fill.as_tensor().numpy()).reshape(-1)[0]) != 0.0:
        return False
    shape = p.inputs[0].producer() if p.inputs[0] is not None else None
    return (shape is not None and shape.op_type == "Shape" and not shape.attributes
            and any(shape.inputs[0] is s for s in shape_sources if s is not None))


class _Names:
    """Fresh initializer names for one fuse run."""

    def __init__(self) -> None:
        self._n = itertools.count()

    def __call__(self, what: str) -> str:
        return f"unroll_fuse_{next(self._n)}_{what}"


def _soft(op, v: ir.Value, t: ir.Value, names: _Names):
    """The fused signed soft threshold with the fewest nodes for this θ: ``v − clip(v, −θ, θ)`` for one constant
    number, else ``v − min(max(v, −θ), θ)`` (with a ``Neg`` when θ is computed at run time)."""
    c = _const(t)
    if c is not None:
        rank = _rank(v)
        if c.size == 1 and (c.ndim == 0 or (rank is not None and c.ndim <= rank)):
            s = c.reshape(())
            lo = op.initializer(ir.tensor(np.array(-s, c.dtype)), name=names("neg_theta"))
            hi = op.initializer(ir.tensor(np.array(s, c.dtype)), name=names("theta"))
            return op.Sub(v, op.Clip(v, lo, hi))
        neg = op.initializer(ir.tensor(np.ascontiguousarray(-c)), name=names("neg_theta"))
        return op.Sub(v, op.Min(op.Max(v, neg), t))
    return op.Sub(v, op.Min(op.Max(v, op.Neg(t)), t))


# ---------------------------------------------------------------------------------------------- rules


@dataclass
class _Rule:
    key: str
    form: str  # the textbook form, as the report names it
    into: str  # what it becomes
    rule: pattern.RewriteRule
    kept: bool = False  # a count-only rule: the form is already fused and stays


def _rules(names: _Names, runtime_theta: list[str], kept_hits: dict[str, set[int]]) -> list[list[_Rule]]:
    """Phases of rules, applied in order, each to a fixed point: constants, the count of forms already fused
    (before anything is rewritten into them), signed shrinkage, non-negative."""

    def soft(op, v, t, **_):
        if _const(t) is None:
            runtime_theta.append(t.name or "?")
        return _soft(op, v, t, names)

    return [_constant_rules(names), _kept_rules(kept_hits), _signed_rules(soft), _nonneg_rules()]


def _constant_rules(names: _Names) -> list[_Rule]:
    """Constants folded: ``η·W``, ``W / L``, casts and negations of constants (step sizes into weights)."""
    def const_binary(op, a, b, out, **_):
        return _const(a) is not None and _const(b) is not None

    def fold(fn):
        def replace(op, a, b, out, **_):
            ca, cb = _const(a), _const(b)
            r = np.asarray(fn(ca, cb)).astype(np.result_type(ca, cb), copy=False)
            return op.initializer(ir.tensor(np.ascontiguousarray(r)), name=names("folded"))
        return replace

    def const_unary(op, a, out, **_):
        return _const(a) is not None

    def fold_cast(op, a, out, **_):
        to = out.producer().attributes["to"].as_int()
        arr = _const(a).astype(ir.DataType(to).numpy())
        return op.initializer(ir.tensor(np.ascontiguousarray(arr)), name=names("cast"))

    def fold_neg(op, a, out, **_):
        return op.initializer(ir.tensor(np.ascontiguousarray(-_const(a))), name=names("neg"))

    constants = [
        _Rule("step_size_times_weight", "η·W (constant × constant, e.g. a step size times a dictionary)",
              "one folded initializer",
              pattern.RewriteRule(lambda op, a, b: op.Mul(a, b, _outputs=["out"]), fold(np.multiply), const_binary,
                                  name="eta_times_w")),
        _Rule("weight_over_constant", "W / L (constant ÷ constant, e.g. a dictionary over its Lipschitz bound)",
              "one folded initializer",
              pattern.RewriteRule(lambda op, a, b: op.Div(a, b, _outputs=["out"]), fold(np.divide), const_binary,
                                  name="w_over_l")),
        _Rule("cast_of_constant", "Cast(constant) (torch.onnx's casts around thresholds)", "the constant",
              pattern.RewriteRule(lambda op, a: op.Cast(a, _outputs=["out"]), fold_cast, const_unary,
                                  name="cast_const")),
        _Rule("neg_of_constant", "Neg(constant) (a −θ bound)", "the constant",
              pattern.RewriteRule(lambda op, a: op.Neg(a, _outputs=["out"]), fold_neg, const_unary,
                                  name="neg_const")),
    ]
    return constants


def _signed_rules(soft: Callable[..., ir.Value]) -> list[_Rule]:
    """The textbook signed soft thresholds, each rewritten by ``soft`` into the fused form (when exact)."""
    def cond_theta(context, v, t, **_):
        return _ok_theta(t)

    def cond_two_thetas(context, v, t, t2, **_):
        return _same(t, t2) and _ok_theta(t)

    def cond_zero(context, v, t, z, x=None, **_):
        return _ok_theta(t) and _is_zero(z, v, x)

    def cond_where(context, v, t, t2, z, **_):
        return _same(t, t2) and _ok_theta(t) and _is_zero(z, v)

    def cond_clip_runtime(context, v, lo, hi, **_):
        return _const(hi) is None and _negated(lo, hi)

    def clip_runtime(op, v, lo, hi, **_):
        return soft(op, v, hi)

    def cond_minmax_scalar(context, v, lo, hi, **_):
        c = _const(hi)
        return c is not None and c.size == 1 and _negated(lo, hi) and _ok_theta(hi) and (
            c.ndim == 0 or (_rank(v) is not None and c.ndim <= _rank(v)))

    def minmax(op, v, lo, hi, **_):
        return soft(op, v, hi)

    textbook_where = "where(|v| > θ, v − sign(v)·θ, 0)"
    fused = "v − clip(v, −θ, θ) (one constant θ) or v − min(max(v, −θ), θ)"
    signed = [
        _Rule("sign_relu", "sign(v)·relu(|v| − θ)", fused,
              pattern.RewriteRule(lambda op, v, t: op.Mul(op.Sign(v), op.Relu(op.Sub(op.Abs(v), t))), soft,
                                  cond_theta, name="sign_relu")),
        _Rule("sign_max", "sign(v)·max(|v| − θ, 0)", fused,
              pattern.RewriteRule(lambda op, v, t, z: op.Mul(op.Sign(v), op.Max(op.Sub(op.Abs(v), t, _outputs=["x"]),
                                                                                 z)),
                                  soft, cond_zero, name="sign_max")),
        _Rule("sign_max", "sign(v)·max(|v| − θ, 0)", fused,
              pattern.RewriteRule(lambda op, v, t, z: op.Mul(op.Sign(v), op.Clip(op.Sub(op.Abs(v), t,
                                                                                        _outputs=["x"]), z)),
                                  soft, cond_zero, name="sign_clip_min")),
        _Rule("where_sign", textbook_where, fused,
              pattern.RewriteRule(lambda op, v, t, t2, z: op.Where(op.Greater(op.Abs(v), t),
                                                                   op.Sub(v, op.Mul(op.Sign(v), t2)), z),
                                  soft, cond_where, name="where_greater")),
        _Rule("where_sign", textbook_where, fused,
              pattern.RewriteRule(lambda op, v, t, t2, z: op.Where(op.Less(t, op.Abs(v)),
                                                                   op.Sub(v, op.Mul(op.Sign(v), t2)), z),
                                  soft, cond_where, name="where_less")),
        _Rule("relu_minus_relu", "relu(v − θ) − relu(−v − θ)", fused,
              pattern.RewriteRule(lambda op, v, t, t2: op.Sub(op.Relu(op.Sub(v, t)), op.Relu(op.Sub(op.Neg(v), t2))),
                                  soft, cond_two_thetas, name="relu_minus_relu")),
        _Rule("clip_runtime_theta", "v − clip(v, −θ, θ) with θ computed at run time", "v − min(max(v, −θ), θ)",
              pattern.RewriteRule(lambda op, v, lo, hi: op.Sub(v, op.Clip(v, lo, hi)), clip_runtime,
                                  cond_clip_runtime, name="clip_runtime")),
        _Rule("minmax_scalar_theta", "v − min(max(v, −θ), θ) with one constant θ", "v − clip(v, −θ, θ)",
              pattern.RewriteRule(lambda op, v, lo, hi: op.Sub(v, op.Min(op.Max(v, lo), hi)), minmax,
                                  cond_minmax_scalar, name="minmax_scalar")),
    ]
    return signed


def _kept_rules(kept_hits: dict[str, set[int]]) -> list[_Rule]:
    """Forms already fused, counted only (the replacement records the match in ``kept_hits`` and declines)."""
    def counter(key: str):
        def record(op, out, **_):
            kept_hits.setdefault(key, set()).add(id(out))
            return None
        return record

    def cond_clip_const(context, v, lo, hi, out, **_):
        return _const(hi) is not None and _negated(lo, hi) and _ok_theta(hi)

    def cond_minmax_fused(context, v, lo, hi, out, **_):
        return _negated(lo, hi) and _ok_theta(hi)

    def cond_relu_sub(context, v, t, out, **_):
        return _threshold_like(t)

    kept = [
        _Rule("clip", "v − clip(v, −θ, θ)", "kept (already fused)",
              pattern.RewriteRule(lambda op, v, lo, hi: op.Sub(v, op.Clip(v, lo, hi), _outputs=["out"]),
                                  counter("clip"), cond_clip_const, name="kept_clip"), kept=True),
        _Rule("minmax", "v − min(max(v, −θ), θ)", "kept (already fused)",
              pattern.RewriteRule(lambda op, v, lo, hi: op.Sub(v, op.Min(op.Max(v, lo), hi), _outputs=["out"]),
                                  counter("minmax"), cond_minmax_fused, name="kept_minmax"), kept=True),
    ]
    kept_nonneg = [
        _Rule("relu_nonneg", "relu(v − θ)", "kept (already fused)",
              pattern.RewriteRule(lambda op, v, t: op.Relu(op.Sub(v, t), _outputs=["out"]), counter("relu_nonneg"),
                                  cond_relu_sub, name="kept_relu"), kept=True),
    ]
    return kept + kept_nonneg


def _nonneg_rules() -> list[_Rule]:
    """The textbook non-negative thresholds (``relu(soft(v, θ))``, ``max(v − θ, 0)``) into ``relu(v − θ)``."""
    def cond_nonneg_zero(context, v, t, z, x, **_):
        return _threshold_like(t) and _is_zero(z, v, x)

    def relu_sub(op, v, t, **_):
        return op.Relu(op.Sub(v, t))

    def cond_relu_soft(context, v, lo, hi, **_):
        c = _const(hi)
        return c is not None and _negated(lo, hi) and bool(np.all(c >= 0))

    def relu_soft(op, v, lo, hi, **_):
        return op.Relu(op.Sub(v, hi))

    nonneg = [
        _Rule("relu_of_soft", "relu(soft(v, θ)) (textbook non-negative: relu(sign(v)·relu(|v| − θ)))",
              "relu(v − θ)",
              pattern.RewriteRule(lambda op, v, lo, hi: op.Relu(op.Sub(v, op.Clip(v, lo, hi))), relu_soft,
                                  cond_relu_soft, name="relu_of_soft_clip")),
        _Rule("relu_of_soft", "relu(soft(v, θ)) (textbook non-negative: relu(sign(v)·relu(|v| − θ)))",
              "relu(v − θ)",
              pattern.RewriteRule(lambda op, v, lo, hi: op.Relu(op.Sub(v, op.Min(op.Max(v, lo), hi))), relu_soft,
                                  cond_relu_soft, name="relu_of_soft_minmax")),
        _Rule("max_nonneg", "max(v − θ, 0)", "relu(v − θ)",
              pattern.RewriteRule(lambda op, v, t, z: op.Max(op.Sub(v, t, _outputs=["x"]), z), relu_sub,
                                  cond_nonneg_zero, name="max_nonneg")),
        _Rule("max_nonneg", "max(v − θ, 0)", "relu(v − θ)",
              pattern.RewriteRule(lambda op, v, t, z: op.Clip(op.Sub(v, t, _outputs=["x"]), z), relu_sub,
                                  cond_nonneg_zero, name="clip_nonneg")),
    ]
    return nonneg


def _threshold_like(t: ir.Value) -> bool:
    """A value that can be a threshold: a constant ≥ 0, a graph input, or one reshaped/scaled from those."""
    seen = 0

    def ok(v: ir.Value) -> bool:
        nonlocal seen
        seen += 1
        if seen > 32:
            return False
        c = _const(v)
        if c is not None:
            return c.dtype.kind in "fiu" and bool(np.all(c >= 0))
        if v.is_graph_input():
            return True
        p = v.producer()
        if p is None or p.domain != "" or p.op_type not in ("Reshape", "Unsqueeze", "Mul", "Div", "Cast", "Expand",
                                                              "Abs", "Relu", "Softplus"):
            return False
        if p.op_type in ("Reshape", "Unsqueeze", "Expand"):
            return ok(p.inputs[0])
        return all(i is not None and ok(i) for i in p.inputs)

    return ok(t)


# ---------------------------------------------------------------------------------------------- rewriting


def _histogram(model: onnx.ModelProto) -> dict[str, int]:
    hist: dict[str, int] = {}
    for n in model.graph.node:
        hist[n.op_type] = hist.get(n.op_type, 0) + 1
    return dict(sorted(hist.items()))


def fuse_model(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict]:
    """Rewrite ``model`` (not modified) → ``(fused model, rewrite report)``; no verification (see :func:`fuse`)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # shapes only sharpen the Clip-vs-Min/Max choice; without them the rewrite is still exact
        inferred = model
    m = ir.serde.deserialize_model(inferred)
    before = len(model.graph.node)
    RemoveUnusedNodesPass()(m)  # also drops trailing empty inputs (Clip(x, min, "")), so patterns see Clip(x, min)
    lifted = sum(1 for n in m.graph if n.op_type == "Constant")
    LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(m)
    lifted -= sum(1 for n in m.graph if n.op_type == "Constant")
    names, runtime_theta, kept_hits = _Names(), [], {}
    phases = _rules(names, runtime_theta, kept_hits)
    counts: dict[str, int] = {}
    for phase in phases:
        for _ in range(100):  # to a fixed point (a cast of a cast folds in two rounds)
            changed = 0
            for r in phase:
                n = pattern.RewriteRuleSet([r.rule], commute=True).apply_to_model(m)
                if not r.kept:
                    counts[r.key] = counts.get(r.key, 0) + n
                    changed += n
            RemoveUnusedNodesPass()(m)
            if not changed:
                break
    for r in (r for phase in phases for r in phase if r.kept):
        counts[r.key] = len(kept_hits.get(r.key, ()))
    ir.passes.common.TopologicalSortPass()(m)
    fused = ir.serde.serialize_model(m)
    del fused.graph.value_info[:]  # inferred for the input graph; the fused graph's are re-inferred when checked
    # the rewriter's provenance tags are not for users' graphs
    for node in fused.graph.node:
        keep = [p for p in node.metadata_props if not p.key.startswith("pkg.onnxscript")]
        del node.metadata_props[:]
        node.metadata_props.extend(keep)
    seen: dict[str, dict] = {}
    for phase in phases:
        for r in phase:
            row = seen.setdefault(r.key, {"rule": r.key, "form": r.form, "into": r.into, "count": 0,
                                          "kept": r.kept})
            row["count"] = counts.get(r.key, 0)
    rewrites = [row for row in seen.values() if not row["kept"]]
    kept = [row for row in seen.values() if row["kept"]]
    for row in rewrites + kept:
        del row["kept"]
    left = [{"node": n.name, "op": n.op_type} for n in fused.graph.node if n.op_type in SUSPECT_OPS]
    report = {
        "nodes_before": before, "nodes_after": len(fused.graph.node),
        "rewrites": rewrites, "kept": kept,
        "constant_nodes_lifted_to_initializers": lifted,
        "runtime_thresholds_assumed_nonnegative": sorted(set(runtime_theta)),
        "left_alone": left,
        "left_alone_note": ("no rule matched these nodes; they are not rewritten (a form unroll does not know "
                            "is never guessed at)") if left else "",
        "op_histogram_before": _histogram(model), "op_histogram_after": _histogram(fused),
    }
    return fused, report


# ---------------------------------------------------------------------------------------------- verification


def parse_input_shapes(items: list[str] | None) -> dict[str, list[int]]:
    """``["x=1,3,32,32", …]`` → ``{"x": [1, 3, 32, 32]}`` (``--input-shape``)."""
    shapes: dict[str, list[int]] = {}
    for item in items or []:
        name, sep, dims = item.partition("=")
        try:
            if not sep or not name.strip():
                raise ValueError
            shapes[name.strip()] = [int(d) for d in dims.replace("x", ",").split(",") if d.strip()]
            if not shapes[name.strip()] or min(shapes[name.strip()]) < 1:
                raise ValueError
        except ValueError:
            raise FuseError(f"--input-shape {item!r}: expected NAME=D1,D2,… with positive sizes, "
                            "e.g. image=1,3,32,32") from None
    return shapes


_NP = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.DOUBLE: np.float64, onnx.TensorProto.FLOAT16: np.float16,
       onnx.TensorProto.INT64: np.int64, onnx.TensorProto.INT32: np.int32, onnx.TensorProto.BOOL: np.bool_,
       onnx.TensorProto.UINT8: np.uint8, onnx.TensorProto.INT8: np.int8}


def random_feeds(model: onnx.ModelProto, shapes: dict[str, list[int]], seed: int) -> dict[str, np.ndarray]:
    """Random inputs for every graph input: floats uniform in [0, 1) (images, λ and σ are non-negative)."""
    rng = np.random.default_rng(seed)
    inits = {i.name for i in model.graph.initializer}
    feeds = {}
    unknown = set(shapes) - {i.name for i in model.graph.input}
    if unknown:
        raise FuseError(f"--input-shape names {sorted(unknown)}, not inputs of the graph "
                        f"({[i.name for i in model.graph.input if i.name not in inits]})")
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        t = inp.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in t.shape.dim]
        given = shapes.get(inp.name)
        if given is not None:
            if len(given) != len(dims) or any(d is not None and d != g for d, g in zip(dims, given, strict=True)):
                raise FuseError(f"--input-shape {inp.name}={','.join(map(str, given))} does not fit the graph's "
                                f"{['?' if d is None else d for d in dims]}")
            shape = given
        else:
            shape = [d if d is not None else (DEFAULT_BATCH if i == 0 else DEFAULT_DIM) for i, d in enumerate(dims)]
        dtype = _NP.get(t.elem_type)
        if dtype is None:
            raise FuseError(f"input {inp.name!r} has element type {onnx.TensorProto.DataType.Name(t.elem_type)}, "
                            "which the parity check cannot feed")
        if np.issubdtype(dtype, np.floating):
            feeds[inp.name] = rng.random(shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[inp.name] = rng.random(shape) < 0.5
        else:
            feeds[inp.name] = rng.integers(0, 2, shape).astype(dtype)
    return feeds


def parity(before: onnx.ModelProto, after: onnx.ModelProto, shapes: dict[str, list[int]],
           seeds: tuple[int, ...] = (0, 1)) -> list[dict]:
    """Both graphs in ONNX Runtime (CPU, FP32) on random inputs: max abs and norm-wise relative error per output."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sessions = []
    for what, model in (("input", before), ("fused", after)):
        try:
            sessions.append(ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]))
        except Exception as e:
            raise FuseError(f"ONNX Runtime cannot load the {what} graph: {str(e).splitlines()[0]}") from None
    rows = []
    for seed in seeds:
        feeds = random_feeds(before, shapes, seed)
        try:
            refs, gots = (s.run(None, feeds) for s in sessions)
        except Exception as e:
            raise FuseError(f"ONNX Runtime could not run the graphs on inputs "
                            f"{ {k: list(v.shape) for k, v in feeds.items()} }: {str(e).splitlines()[0]} "
                            "(give the sizes with --input-shape NAME=D1,D2,…)") from None
        for out, ref, got in zip(before.graph.output, refs, gots, strict=True):
            if got.shape != ref.shape:
                raise FuseError(f"output {out.name}: fused shape {got.shape} != input graph's {ref.shape}")
            diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
            rel = float(np.linalg.norm(diff) / max(float(np.linalg.norm(ref.astype(np.float64))), 1e-30))
            mx = float(diff.max()) if diff.size else 0.0
            rows.append({"case": f"random inputs, seed {seed}", "output": out.name,
                         "shapes": {k: list(v.shape) for k, v in feeds.items()}, "max_abs_err": mx, "rel_err": rel,
                         "ok": bool(mx <= MAX_ABS_ERR and rel <= MAX_REL_ERR)})
    return rows


# ---------------------------------------------------------------------------------------------- entry point


def fuse(src: str | Path, out: str | Path, card: str | Path | ModelCard | None = None,
         input_shapes: dict[str, list[int]] | None = None) -> FuseResult:
    """Fuse ``src`` into ``out`` (+ ``out.report.json``), verified with ONNX Runtime; nothing written on failure.

    ``card``: a :class:`ModelCard` or a JSON file of one, attached to the fused graph (named after
    ``out``'s stem); without it, a card already in ``src`` is kept. ``input_shapes``: sizes for the
    parity check's inputs (dynamic axes default to 1 for the batch and 16 otherwise).
    """
    src, out = Path(src), Path(out)
    t0 = time.perf_counter()
    try:
        model = onnx.load(str(src))
    except FileNotFoundError:
        raise FuseError(f"{src} not found") from None
    except Exception as e:
        raise FuseError(f"{src} is not a readable ONNX model: {str(e).splitlines()[0] if str(e) else e}") from None
    name = out.stem
    if isinstance(card, str | Path):
        card = load_card_file(card, name)
    if card is not None:
        check_card_fits(model, card)
    else:
        try:
            card = from_onnx(model)
        except CardError:
            card = None
    try:
        fused, report = fuse_model(model)
        onnx.checker.check_model(fused, full_check=True)
        fused = onnx.shape_inference.infer_shapes(fused, check_type=True, strict_mode=True)
    except FuseError:
        raise
    except Exception as e:
        raise FuseError(f"the rewritten graph failed ONNX's checks: {str(e).splitlines()[0]}") from e
    rows = parity(model, fused, input_shapes or {})
    bad = [r for r in rows if not r["ok"]]
    if bad:
        raise FuseError("the fused graph differs from the input graph beyond max abs 1e-4 / rel 1e-5 (nothing "
                        "written): " + "; ".join(f"{r['case']} {r['output']}: abs {r['max_abs_err']:.2e}, "
                                                 f"rel {r['rel_err']:.2e}" for r in bad))
    if card is not None:
        write_to_onnx(fused, card)
    else:
        kept = [p for p in fused.metadata_props if p.key != CARD_KEY]
        del fused.metadata_props[:]
        fused.metadata_props.extend(kept)
    report = {"model": name, "source": str(src), "output": str(out), **report,
              "parity": {"tolerance": {"max_abs_err": MAX_ABS_ERR, "rel_err": MAX_REL_ERR},
                         "max_abs_err": max(r["max_abs_err"] for r in rows),
                         "rel_err": max(r["rel_err"] for r in rows), "cases": rows},
              "card": None if card is None else card.model_dump(mode="json"),
              "seconds": round(time.perf_counter() - t0, 2),
              "versions": {"onnxscript": onnxscript.__version__, "onnx": onnx.__version__,
                           "onnxruntime": ort.__version__}}
    out.parent.mkdir(parents=True, exist_ok=True)
    report_path = artifacts.report_of(out)
    with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".onnx.tmp", delete=False) as tmp:
        tmp_path = Path(tmp.name)
    try:
        onnx.save(fused, str(tmp_path))
        os.replace(tmp_path, out)
    finally:
        tmp_path.unlink(missing_ok=True)
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    return FuseResult(out, report_path, report)
