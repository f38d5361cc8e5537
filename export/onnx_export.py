"""``unroll export``: unroll every solver into a static, fused ONNX graph and verify it against PyTorch.

The PyTorch solver layers are written in their fused form (``relu(v − θ)`` shrinkage, step sizes
folded into the weights, ``Dᵀ(x − Dy)`` gradients, FISTA momenta as per-step literals) and hold every
stateful or random quantity in buffers (power-iteration step sizes, normalised atoms, NMF bases,
random-feature matrices), so tracing in eval mode yields a loop-free graph with those frozen as
initializers. The same model traced under :func:`textbook_mode` is the "naive" export it is compared
with. The graph is cleaned with onnxslim, checked by the ONNX checker and shape inference, linted for
TensorRT and verified with ONNX Runtime on real inputs before anything is written.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import io
import json
import linecache
import os
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import onnxslim
import torch
from torch import nn

import unroll
from unroll import artifacts, tasks
from unroll.card import CardError, ModelCard, OodCard, write_to_onnx
from unroll.errors import ExportError  # re-exported: the model cannot be exported as a valid, verified graph
from unroll.export import inputs as _inputs  # (``export`` has a parameter named example_inputs)
from unroll.export import inputs as example_inputs
from unroll.export.tiling_check import tiling_parity
from unroll.export.trt_lint import format_issues, lint, lint_report
from unroll.export.user_model import update_card
from unroll.models.denoiser import CSCDenoiser
from unroll.registry import get_spec
from unroll.solvers.csc import DictBlock, fista_momenta
from unroll.solvers.dic_attn import DicAttention
from unroll.solvers.iterations import iteration_count, set_iterations
from unroll.solvers.nmf import NMFHam
from unroll.solvers.residual import WithResidual as _WithResidual
from unroll.solvers.residual import first_solver
from unroll.solvers.shrink import textbook_mode
from unroll.solvers.vars_attn import VARSAttention

MAX_ABS_ERR = 1e-4
MAX_REL_ERR = 1e-5
#: :func:`float64_floor`: how much worse than PyTorch's own FP32 error ONNX Runtime may be, and the largest such
#: floor accepted at all (a model whose FP32 output is off by more than 0.1 % is refused, whatever the graph).
FLOOR_FACTOR, MAX_FLOOR = 2.0, 1e-3
#: :func:`float64_floor`: PyTorch FP32 runs on inputs moved by one FP32 rounding (relative ``FP32_EPS``), with these
#: seeds: how far the model's own FP32 output moves when its input is rounded differently (its conditioning there).
FP32_EPS, ULP_SEEDS = float(np.finfo(np.float32).eps), 8
SHRINK_CHAIN_OPS = ("Sign", "Abs", "Where", "Greater", "Less")


@dataclass
class ExportResult:
    onnx_path: Path
    report_path: Path
    report: dict
    #: Graphs exported with this one because its card names them (e.g. its λ rule).
    companions: list[ExportResult] = field(default_factory=list)


class _Classifier(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, image: torch.Tensor, lam: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(image, lam)


def _arrays(out: torch.Tensor | tuple[torch.Tensor, ...]) -> list[np.ndarray]:
    """A module's output(s) as arrays, in graph output order."""
    return [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]


def io_names(card: ModelCard, lam_input: bool) -> tuple[list[str], list[str], dict[str, dict[int, str]]]:
    """Graph input/output names and dynamic axes, from the model card (CONVENTIONS.md)."""
    main = card.input
    axis_names = (["channels", "height", "width"] if main.colour is not None and len(main.shape) == 3
                  else [f"dim{i}" for i in range(len(main.shape))])
    if len(main.shape) == 2:
        axis_names = ["tokens", "dim"]
    dyn = {0: "batch", **{i + 1: axis_names[i] for i, d in enumerate(main.shape) if d < 0}}
    ins = [main.name]
    axes: dict[str, dict[int, str]] = {main.name: dyn}
    if card.lam is not None and lam_input:
        ins.append(card.lam.input)
        axes[card.lam.input] = {0: "batch"}
    if card.sigma is not None:
        ins.append(card.sigma.input)
        axes[card.sigma.input] = {0: "batch"}
    # The output follows the input's dynamic axes when it has the input's rank (images, tokens).
    axes[card.output] = dyn if tasks.get(card.task).same_shape_output else {0: "batch"}
    if card.ood is not None:
        axes[card.ood.output] = {0: "batch"}
    return ins, card.output_names, axes


def resolve_card(card: ModelCard, model: nn.Module, lam_input: bool) -> ModelCard:
    """The card as exported: λ's default filled in from the model's first solver layer, λ dropped if baked in;
    the served iteration counts' default filled in from the solver layers' count."""
    if card.iters is not None and card.iters.default is None:
        card = card.model_copy(update={"iters": card.iters.model_copy(update={"default": iteration_count(model)})})
    if card.lam is None:
        return card
    if not lam_input:
        return card.model_copy(update={"lam": None})
    if card.lam.default is not None:
        return card
    lams = [s["lambda"] for s in solver_settings(model) if "lambda" in s]
    if not lams:
        raise ExportError(f"{card.name}: its card declares a λ input but no solver layer has a λ to default to; "
                          "set lam.default on the card")
    return card.model_copy(update={"lam": card.lam.model_copy(update={"default": float(lams[0])})})


def solver_settings(model: nn.Module) -> list[dict]:
    """What was frozen, per solver layer, for the report."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, DictBlock):
            out.append({"layer": name, "solver": "FISTA (CSC, non-negative)", "iterations": m.n_steps,
                        "lambda": m.lmbd, "step_size": round(float(m.step_size), 6), "stride": m.stride,
                        "kernel": m.kernel_size, "momenta": [round(b, 6) for b in fista_momenta(m.n_steps)],
                        "frozen": ["unit-norm atoms", "step size 0.9/L (power iteration)", "FISTA momenta"]})
        elif isinstance(m, CSCDenoiser):
            out.append({"layer": name or "model", "solver": "LISTA (untied, stride-2 CSC)", "iterations": m.n_steps,
                        "atoms": m.num_atoms, "frozen": ["per-step filters", "threshold affine maps τ(σ)"]})
        elif isinstance(m, VARSAttention):
            out.append({"layer": name or "model", "solver": f"learned ISTA (official VARS-{m.mode.upper()})",
                        "iterations": m.n_steps, "lambda": round(m.lam * float(m.learned_lam.detach()), 6),
                        "shrinkage": "sign(v)·GELU(|v| − θ)" if m.shrink == "gelu" else "soft threshold",
                        "frozen": ["random-feature matrix Ω", "learned_k, learned_lam, learned_L"]
                        + (["static atoms (kernel)"] if m.mode == "sd" else [])})
        elif isinstance(m, NMFHam):
            out.append({"layer": name or "model", "solver": "NMF multiplicative updates", "iterations": m.eval_steps,
                        "rank": m.bases.shape[-1], "frozen": ["seeded NMF bases (official code redraws per call)"]})
        elif isinstance(m, DicAttention):
            out.append({"layer": name or "model", "solver": "ISTA (elastic net)", "iterations": m.n_steps,
                        "beta": m.beta, "mu": m.mu, "frozen": ["unit-norm atoms", "L = ‖D‖² + μ",
                                                              "step matrix I(1−μ/L) − DᵀD/L"]})
    return out


def _torch_export(module: nn.Module, args: tuple, path: str, ins: list[str], outs: list[str],
                  axes: dict, opset: int) -> list[warnings.WarningMessage]:
    """``torch.onnx.export`` (TorchScript tracer); returns the tracer's warnings (see :func:`static_graph_check`)."""
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(io.StringIO()), _quiet_stderr():
        warnings.simplefilter("always")  # (the exporter dumps its IR graph on failure: kept out of the output)
        torch.onnx.export(module, args, path, input_names=ins, output_names=outs, dynamic_axes=axes,
                          opset_version=opset, do_constant_folding=True, dynamo=False)
    return [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)]


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (C++ logging) for the duration; Python warnings are recorded separately."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with tempfile.TemporaryFile() as sink:
        try:
            torch._C._jit_set_onnx_log_output_stream("stderr")  # its C++ log (default: buffered stdout)
            os.dup2(sink.fileno(), 2)
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            torch._C._jit_set_onnx_log_output_stream("stdout")


def _source(w: warnings.WarningMessage) -> str:
    return linecache.getline(w.filename, w.lineno).strip()


def _where(w: warnings.WarningMessage) -> str:
    return f"{w.filename}:{w.lineno}" + (f" (`{_source(w)}`)" if _source(w) else "")


def static_graph_check(tracer_warnings: list[warnings.WarningMessage]) -> None:
    """Refuse a trace whose Python control flow read tensor values: a static graph cannot hold it.

    How it is detected: tracing turns every Python ``bool(tensor)`` into a constant and says so with a
    ``TracerWarning`` ("Converting a tensor to a Python boolean"), whose file and line are the user's
    code. The line's source tells a loop from a branch: a ``while`` statement (or a line that converted
    a tensor to a boolean more than once in one trace: a loop condition) is a data-dependent loop;
    anything else (``if``, ``elif``, a conditional expression, ``assert``) is a Python-side branch on
    tensor values. Tensor → Python number conversions (``.item()``, ``float(t)``) are not refused here:
    they freeze a value, which verification on inputs other than the traced one catches, and the
    failure message then names them (:func:`_frozen_values_hint`).
    """
    bools = [w for w in tracer_warnings if "Python boolean" in str(w.message)]
    if not bools:
        return
    sites = collections.Counter((w.filename, w.lineno) for w in bools)
    first = {(w.filename, w.lineno): w for w in reversed(bools)}
    for (fn, ln), n in sites.items():
        w = first[(fn, ln)]
        src = _source(w)
        if src.startswith("while") or (n > 1 and not src.startswith(("if", "elif", "assert"))):
            raise ExportError(
                f"data-dependent loop at {_where(w)}: how often it runs depends on tensor values (it ran {n}× "
                f"while tracing), so a static graph would freeze that count for every input. Fix the iteration "
                f"count: run a fixed K steps (`for _ in range(K):`), as unroll's solver layers do")
    w = first[next(iter(sites))]
    raise ExportError(
        f"Python-side `if` on tensor values at {_where(w)}: a static graph keeps only the branch taken while "
        "tracing. Fix: compute both branches and pick per element with torch.where(cond, a, b), or make the "
        "condition a Python setting (a module attribute or constructor argument), not a tensor")


def _frozen_values_hint(tracer_warnings: list[warnings.WarningMessage]) -> str:
    """Where a tensor became a Python number while tracing (a likely cause when verification fails)."""
    sites = {_where(w): None for w in tracer_warnings if "Converting a tensor to a Python" in str(w.message)}
    if not sites:
        return ""
    return (". Likely cause: a tensor value turned into a Python number (frozen as a constant in the graph) at "
            + ", ".join(sites) + "; keep it a tensor (no .item(), float(t), int(t) on input-dependent values)")


def op_histogram(model: onnx.ModelProto) -> dict[str, int]:
    return dict(sorted(collections.Counter(n.op_type for n in model.graph.node).items()))


def _trace(module: nn.Module, case: example_inputs.Case, ins: list[str], outs: list[str], axes: dict,
           opset: int, workdir: str, tag: str) -> tuple[onnx.ModelProto, int, list[warnings.WarningMessage]]:
    raw_path = os.path.join(workdir, f"{tag}.raw.onnx")
    args = tuple(case.inputs[k] for k in ins)
    try:
        caught = _torch_export(module, args, raw_path, ins, outs, axes, opset)
    except Exception as e:  # the exporter's own message names the unsupported construct
        fix = ("; fix: write that step with operators ONNX supports, or compute it outside the model"
               if "Unsupported" in type(e).__name__ or "not supported" in str(e) else "")
        raise ExportError(f"torch.onnx.export failed: {type(e).__name__}: {_first_line(e)}{fix}") from e
    static_graph_check(caught)
    raw = onnx.load(raw_path)
    slim = onnxslim.slim(raw)
    return slim, len(raw.graph.node), caught


def _first_line(e: BaseException) -> str:
    return next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)


def verify(model_bytes: bytes, module: nn.Module, cases: list[example_inputs.Case], ins: list[str]) -> list[dict]:
    """ONNX Runtime (CPU, FP32) vs PyTorch on every case: max abs and norm-wise relative error."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
    rows = []
    double: nn.Module | None = None  # the float64 copy float64_floor needs, made once, only if a case misses
    for case in cases:
        feed = {k: case.inputs[k].numpy() for k in ins}
        try:
            gots = sess.run(None, feed)
        except Exception as e:  # e.g. a shape frozen at the traced input's
            raise ExportError(f"{case.label}: ONNX Runtime could not run the graph: {_first_line(e)}") from e
        with torch.no_grad():
            refs = _arrays(module(*(case.inputs[k] for k in ins)))
        per_output = []
        for i, (got, ref) in enumerate(zip(gots, refs, strict=True)):
            if got.shape != ref.shape:
                raise ExportError(f"{case.label}: ONNX output {i} shape {got.shape} != PyTorch {ref.shape}")
            out = {"max_abs_err": float(np.abs(got.astype(np.float64) - ref).max()), "rel_err": _rel(got, ref)}
            out["ok"] = bool(out["max_abs_err"] <= MAX_ABS_ERR and out["rel_err"] <= MAX_REL_ERR)
            if not out["ok"]:
                if double is None:
                    double = copy.deepcopy(module).double()
                out.update(float64_floor(module, case, ins, got, ref, double, index=i))
            per_output.append(out)
        row = {"case": case.label, "batch": int(next(iter(feed.values())).shape[0]),
               "shapes": {k: list(v.shape) for k, v in feed.items()},
               "max_abs_err": max(o["max_abs_err"] for o in per_output),
               "rel_err": max(o["rel_err"] for o in per_output), "ok": all(o["ok"] for o in per_output)}
        if len(per_output) == 1:
            row.update({k: v for k, v in per_output[0].items() if k == "float64"})
        else:  # each output judged on its own (a residual of ~0.6 and logits of ~10 share no scale)
            row["outputs"] = per_output
        rows.append(row)
    return rows


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / max(np.linalg.norm(b), 1e-30))


def float64_floor(module: nn.Module, case: example_inputs.Case, ins: list[str], got: np.ndarray,
                  ref: np.ndarray, double: nn.Module | None = None, index: int = 0) -> dict:
    """Judge ONNX Runtime against exact arithmetic when it misses PyTorch: an ill-conditioned model (VARS's
    discontinuous shrinkage, a random init's growing residual stream) differs from *itself* in FP32 by more than
    the fixed tolerance, and which FP32 rounding (the fused or the textbook form) lands closer is luck. The graph
    passes when its error to the float64 PyTorch output is within ``FLOOR_FACTOR`` × the largest FP32 error of
    PyTorch — its two forms, and the same model on inputs moved by one FP32 rounding (``ULP_SEEDS`` draws): at a
    sample near a discontinuity one rounding decides the side, for PyTorch as for any runtime — (+ the fixed
    tolerance), and that floor is below ``MAX_FLOOR``: no worse than the framework it came from, never a wrong graph
    (those miss by orders of magnitude more). ``double``: ``module`` in float64 (copied here when not given); ``index``:
    which of the module's outputs ``got`` and ``ref`` are."""
    def run(m: nn.Module, *xs: torch.Tensor) -> np.ndarray:
        return _arrays(m(*xs))[index]

    with torch.no_grad(), textbook_mode():
        textbook = run(module, *(case.inputs[k] for k in ins))
    if double is None:
        double = copy.deepcopy(module).double()
    with torch.no_grad():
        exact = run(double, *(case.inputs[k].double() for k in ins))
        moved = []
        for seed in range(ULP_SEEDS):
            g = torch.Generator().manual_seed(seed)
            xs = [x * (1 + FP32_EPS * torch.randn(x.shape, generator=g)) if x.is_floating_point() else x
                  for x in (case.inputs[k] for k in ins)]
            moved.append(_rel(run(module, *xs), exact))
    errs = {"pytorch_fp32_rel_err": _rel(ref, exact), "pytorch_textbook_fp32_rel_err": _rel(textbook, exact),
            "pytorch_fp32_input_rounded_rel_err": max(moved)}
    floor, onnx_err = max(errs.values()), _rel(got, exact)
    ok = floor <= MAX_FLOOR and onnx_err <= FLOOR_FACTOR * floor + MAX_REL_ERR
    return {"float64": {**errs, "onnx_rel_err": onnx_err}, "ok": bool(ok)}


def _check_tiling(blob: bytes, card: ModelCard, case: example_inputs.Case, ins: list[str]) -> dict:
    """The card's ``tiling`` claim checked on the graph (:func:`unroll.export.tiling_check.tiling_parity`);
    refused beyond the parity tolerance, naming the card field to fix."""
    sess = ort.InferenceSession(blob, providers=["CPUExecutionProvider"])
    extra = {k: case.inputs[k][:1].numpy() for k in ins[1:]}
    result = tiling_parity(sess, card, extra)
    result["ok"] = bool(result["max_abs_err"] <= MAX_ABS_ERR and result["rel_err"] <= MAX_REL_ERR)
    if not result["ok"]:
        raise ExportError(f"card.tiling {card.tiling.model_dump()} does not hold: windows stitched back differ from "
                          f"the whole image by abs {result['max_abs_err']:.2e}, rel {result['rel_err']:.2e} "
                          f"(tolerance {MAX_ABS_ERR:g} / {MAX_REL_ERR:g}); widen the margin to the graph's receptive "
                          "radius, or set mean_centred if the graph removes its input's mean")
    return result


def export_module(module: nn.Module, cases: list[example_inputs.Case], ins: list[str], outs: list[str],
                  axes: dict, out_path: Path, opset: int = 17, extra_report: dict | None = None,
                  naive: bool = True, card: ModelCard | None = None) -> ExportResult:
    """Trace, slim, check, lint, verify, then (and only then) write ``out_path`` and its report.

    ``card`` is written into the graph's ``metadata_props`` (``unroll.card``) and the report, so every
    later stage reads what the model is from the file itself.
    """
    if opset < 17:
        raise ExportError(f"opset {opset} is too old: use 17 or newer")
    module = module.eval()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        fused, raw_nodes, caught = _trace(module, cases[0], ins, outs, axes, opset, tmp, "fused")
        try:
            onnx.checker.check_model(fused, full_check=True)
            fused = onnx.shape_inference.infer_shapes(fused, check_type=True, strict_mode=True)
        except Exception as e:
            raise ExportError(f"ONNX checker / shape inference rejected the graph: {e}") from e
        issues = lint(fused)
        if issues:
            raise ExportError("the graph fails the TensorRT lint:\n" + format_issues(issues))
        trt_lint = lint_report(fused, issues)
        if card is not None:
            write_to_onnx(fused, card)
        blob = fused.SerializeToString()
        try:
            parity = verify(blob, module, cases, ins)
        except ExportError as e:
            raise ExportError(f"{e}{_frozen_values_hint(caught)}") from e
        tiling = _check_tiling(blob, card, cases[0], ins) if card is not None and card.tiling is not None else None
        bad = [r for r in parity if not r["ok"]]
        if bad:
            raise ExportError("ONNX Runtime output differs from PyTorch beyond max abs 1e-4 / rel 1e-5 (and beyond "
                              f"{FLOOR_FACTOR:g}× PyTorch FP32's own error to float64): " +
                              "; ".join(f"{r['case']}: abs {r['max_abs_err']:.2e}, rel {r['rel_err']:.2e}"
                                        for r in bad) + _frozen_values_hint(caught))
        naive_info = None
        if naive:
            with textbook_mode():
                naive_model, naive_raw, _ = _trace(module, cases[0], ins, outs, axes, opset, tmp, "naive")
            naive_info = {"node_count": len(naive_model.graph.node), "node_count_before_slim": naive_raw,
                          "op_histogram": op_histogram(naive_model)}
    hist = op_histogram(fused)
    report = {
        **(extra_report or {}),
        **({"card": card.model_dump(mode="json")} if card is not None else {}),
        "opset": opset,
        "inputs": [_io(v, axes) for v in fused.graph.input],
        "outputs": [_io(v, axes) for v in fused.graph.output],
        "node_count": len(fused.graph.node), "node_count_before_slim": raw_nodes, "op_histogram": hist,
        "shrinkage_chain_ops": {op: hist.get(op, 0) for op in SHRINK_CHAIN_OPS},
        "naive_export": naive_info,
        "parity": {"max_abs_tol": MAX_ABS_ERR, "rel_tol": MAX_REL_ERR, "runtime": f"onnxruntime {ort.__version__} CPU",
                   "cases": parity},
        "trt_lint": trt_lint,
        **({"tiling": tiling} if tiling is not None else {}),
        "cleanup": f"onnxslim {onnxslim.__version__}; onnx.checker full_check; strict shape inference",
        "versions": {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": ort.__version__},
        "export_seconds": round(time.perf_counter() - t0, 2),
        "file_bytes": len(blob),
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = out_path.with_suffix(".onnx.tmp")
    tmp_path.write_bytes(blob)
    os.replace(tmp_path, out_path)  # atomic: a reader never sees a half-written model
    report_path = artifacts.report_of(out_path)
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    return ExportResult(out_path, report_path, report)


def _io(v: onnx.ValueInfoProto, axes: dict) -> dict:
    dims = [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
    return {"name": v.name, "dtype": onnx.TensorProto.DataType.Name(v.type.tensor_type.elem_type).lower(),
            "shape": dims}


class _AutoLam(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.model.auto_lam(image)


def _export_auto_lam(card: ModelCard, model: nn.Module, cases: list[example_inputs.Case], out_dir: Path,
                     opset: int, weights: str, built_from: dict | None = None) -> ExportResult:
    """``out_dir/<card.lam.auto>.onnx``: the λ rule of the classifier ``card`` describes (see export_auto_lam).

    ``weights`` and ``built_from`` (the classifier's input hashes) go into the report as the classifier's do:
    :mod:`unroll.pipeline` re-exports a registered model when any of its graphs was built from other inputs."""
    if card.lam is None or card.lam.auto is None:
        raise ExportError(f"{card.name}: its card declares no λ rule (lam.auto)")
    if not hasattr(model, "auto_lam"):
        raise ExportError(f"{card.name}: the card names a λ rule but the model has no auto_lam(image) method")
    main = card.input.name
    comp = card.companion(tasks.LAMBDA_RULE, card.lam.auto, f"λ rule (lam=auto) for {card.name}", "lam")
    comp_cases = [example_inputs.Case(c.label, {main: c.inputs[main]}) for c in cases]
    extra = {"model": comp.name, "task": comp.task, "rule": "lam = clamp(a * rms(x - D c(x)) + b, lam_min, lam_max)",
             "coefficients": [float(v) for v in model.lam_auto], "weights": weights,
             **({artifacts.BUILT_FROM_KEY: built_from} if built_from is not None else {})}
    return export_module(_AutoLam(model), comp_cases, [main], ["lam"], {main: {0: "batch"}, "lam": {0: "batch"}},
                         artifacts.graph(comp.name, onnx_dir=out_dir), opset, extra, naive=False, card=comp)


def export_auto_lam(name: str, out_dir: Path = artifacts.ONNX_DIR, opset: int = 17,
                    model: nn.Module | None = None) -> ExportResult:
    """``out_dir/<card.lam.auto>.onnx``: image → per-sample λ from the model's fitted rule (``lam=auto``).

    A separate small graph (one CSC pass and its reconstruction), so the classifier graph stays a
    pure function of ``(image, lam)`` and serving can choose λ first. Its card (task ``lambda-rule``)
    names the classifier it serves, and the classifier's card names it (``lam.auto``).
    """
    spec = get_spec(name)
    if spec.card.lam is None or spec.card.lam.auto is None:
        raise ExportError(f"{name}: its card declares no λ rule (lam.auto)")
    built_from = artifacts.export_inputs(spec, opset=opset) if model is None else None
    model = model if model is not None else unroll.load(name, pretrained=spec.has_weights)
    return _export_auto_lam(spec.card, model, example_inputs.cases(spec, lam_input=False), out_dir, opset,
                            "committed" if spec.has_weights else "seeded random init", built_from)


Examples = (example_inputs.Case | list[example_inputs.Case] | dict[str, torch.Tensor] | torch.Tensor
            | tuple[torch.Tensor, ...])


def _as_cases(given: Examples, ins: list[str], card: ModelCard) -> list[example_inputs.Case]:
    """The caller's example inputs as verification cases, keyed by the graph's input names.

    A tensor or tuple is taken positionally (main input, then λ, then σ); a missing λ is filled with the
    card's default. When every case has batch 1, a batch-2 case (the first one twice) is added so that the
    dynamic batch axis is verified as well.
    """
    if isinstance(given, example_inputs.Case):
        given = [given]
    if isinstance(given, torch.Tensor):
        given = (given,)
    if isinstance(given, tuple):
        given = dict(zip(ins, given, strict=False))
    if isinstance(given, dict):
        given = [example_inputs.Case("given example", dict(given))]
    out = []
    for case in given:
        inputs = dict(case.inputs)
        main = inputs.get(card.input.name)
        if main is None:
            raise ExportError(f"example inputs {sorted(inputs)} lack the card's main input {card.input.name!r}")
        if card.lam is not None and card.lam.input in ins and card.lam.input not in inputs:
            inputs[card.lam.input] = torch.full((main.shape[0],), float(card.lam.default))
        missing = [k for k in ins if k not in inputs]
        if missing:
            raise ExportError(f"example inputs lack the graph inputs {missing} (the card's inputs are {ins})")
        out.append(example_inputs.Case(case.label, {k: inputs[k].detach().float() for k in ins}))
    if out and all(c.inputs[ins[0]].shape[0] == 1 for c in out):
        first = out[0]
        out.append(example_inputs.Case(f"{first.label} ×2 (batch 2)",
                                       {k: torch.cat([v, v]) for k, v in first.inputs.items()}))
    return out


def _check_outputs(module: nn.Module, card: ModelCard, case: example_inputs.Case, ins: list[str]) -> None:
    """The module runs on the first case, and a classifier's logits match its labels (before any trace)."""
    try:
        with torch.no_grad():
            y = module(*(case.inputs[k] for k in ins))
    except Exception as e:
        raise ExportError(f"{card.name}: the module fails on its example input ({case.label}, shapes "
                          f"{ {k: list(case.inputs[k].shape) for k in ins} }): {type(e).__name__}: "
                          f"{_first_line(e)}") from e
    if not isinstance(y, torch.Tensor):
        raise ExportError(f"{card.name}: forward must return one tensor ({card.output!r}), got {type(y).__name__}")
    if tasks.get(card.task).logits:
        if y.ndim != 2:
            raise ExportError(f"{card.name}: a classifier returns logits [batch, classes], got shape {list(y.shape)}")
        if card.labels is not None and len(card.labels) != y.shape[1]:
            raise ExportError(f"{card.name}: the card has {len(card.labels)} labels but the model outputs "
                              f"{y.shape[1]} logits; give one label per logit")


def export(module: nn.Module, card: ModelCard | dict, example_inputs: Examples | None = None,
           out_dir: str | Path = artifacts.ONNX_DIR, *, name: str | None = None, opset: int = 17,
           lam_input: bool | None = None, naive: bool | None = None, companions: bool = True,
           extra_report: dict | None = None) -> ExportResult:
    """Export any ``nn.Module`` with its model card to ``out_dir/NAME.onnx`` + ``NAME.report.json``, verified.

    The one export path: ``export_model`` (registered models) and ``unroll export --model FILE.py:factory``
    both end here. The module is called with the card's inputs positionally (main input, then λ when
    ``lam_input``, then σ) and returns one tensor. ``example_inputs`` (a tensor, a tuple, a
    ``{name: tensor}`` dict or a list of :class:`~unroll.export.inputs.Case`) are what the graph is traced
    with and verified on; when omitted they are built from the card (its datasets, sizes, λ/σ values) as
    for registered models. ``name`` overrides the card's name (the file stem and the served name).

    Raises :class:`ExportError` (nothing written) when the model cannot become a static graph (a
    data-dependent loop or ``if``, an unsupported op), fails a check, or differs from PyTorch.
    """
    if isinstance(card, dict):
        try:
            card = ModelCard.model_validate({**card, "origin": "python"})  # field hints name this dict
        except Exception as e:
            raise CardError(f"invalid model card: {e}") from None
    if name is not None and name != card.name:
        card = card.model_copy(update={"name": name})
    has_lam = card.lam is not None
    lam_input = has_lam if lam_input is None else lam_input
    if lam_input and not has_lam:
        raise ExportError(f"{card.name} has no first-layer λ to expose (its card declares no lam input)")
    module = module.eval()
    card = resolve_card(card, module, lam_input)
    ins, outs, axes = io_names(card, lam_input)
    cases = (_inputs.cases(card, lam_input) if example_inputs is None
             else _as_cases(example_inputs, ins, card))
    _check_outputs(module, card, cases[0], ins)
    traced = module
    if card.ood is not None:
        if first_solver(module) is None:
            raise ExportError(f"{card.name}: its card declares ood (a solver residual output) but the model has no "
                              "solver layer (CSC, VARS or Dic-Attn attention, NMF) to take it from; remove ood")
        traced = _WithResidual(module)
    solvers = solver_settings(module)
    naive = bool(solvers) if naive is None else naive  # textbook_mode only changes unroll's own solver layers
    fixed = None
    if tasks.get(card.task).logits and card.input.fixed_hw is not None:
        fixed = (f"fixed {card.input.fixed_hw[0]}×{card.input.fixed_hw[1]} input: the model was built and trained "
                 "for this resolution")
    extra = {"model": card.name, "task": card.task, "weights": "given module", **(extra_report or {}),
             "lam_input": lam_input, "fixed_resolution": fixed, "solvers": solvers}
    out_path = artifacts.graph(card.name, onnx_dir=out_dir)
    result = export_module(traced, cases, ins, outs, axes, out_path, opset, extra, naive, card=card)
    inner = module.model if isinstance(module, _Classifier) else module
    if not companions:
        return result
    try:
        if lam_input and card.lam.auto is not None and hasattr(inner, "auto_lam"):
            result.companions.append(_export_auto_lam(card, inner, cases, Path(out_dir), opset,
                                                      result.report.get("weights", "given module"),
                                                      result.report.get(artifacts.BUILT_FROM_KEY)))
        result.companions += _export_iteration_graphs(module, card, cases, ins, outs[:1], axes, Path(out_dir),
                                                      opset, extra)
    except BaseException:  # all or nothing: a model without the graphs its card names is not served half-way
        for r in (result, *result.companions):
            r.onnx_path.unlink(missing_ok=True)
            r.report_path.unlink(missing_ok=True)
        raise
    return result


def calibrated_ood(card: ModelCard, rule: dict | None) -> ModelCard:
    """``card`` with its ``ood`` rule filled in from the training record's (``unroll bench ood`` chose it on
    validation data; :class:`~unroll.card.OodCard`), where the card declares ``ood`` and does not give one."""
    if card.ood is None or card.ood.calibrated or not rule:
        return card
    try:
        ood = OodCard.model_validate({**card.ood.model_dump(), **rule})
    except ValueError as e:
        raise CardError(f"{card.name}: the training record's ood rule is invalid: {e}") from None
    return card.model_copy(update={"ood": ood})


def iteration_card(card: ModelCard, k: int) -> ModelCard:
    """The card of the graph that runs ``card``'s model with ``k`` solver iterations (``iters=k``): the model's
    own card, named :meth:`IterCard.graph`, with ``k`` as its count and ``companion_of`` the model; without ``ood``
    (its residual is calibrated at the trained count)."""
    assert card.iters is not None and card.iters.default is not None
    return card.model_copy(update={
        "name": card.iters.graph(card.name, k), "companion_of": card.name, "ood": None,
        "description": f"{card.name} with {k} solver iterations (iters={k}; trained: {card.iters.default})",
        "iters": card.iters.model_copy(update={"default": k})})


def _export_iteration_graphs(module: nn.Module, card: ModelCard, cases: list[example_inputs.Case], ins: list[str],
                             outs: list[str], axes: dict, out_dir: Path, opset: int, extra: dict
                             ) -> list[ExportResult]:
    """One verified graph per served iteration count other than the trained one (``card.iters``): a copy of the
    module unrolled to that count, traced and checked against PyTorch running the same count."""
    if card.iters is None:
        return []
    out = []
    for k in card.iters.counts:
        if k == card.iters.default:
            continue
        sibling = iteration_card(card, k)
        unrolled = set_iterations(copy.deepcopy(module), k)
        report = {**extra, "model": sibling.name, "iterations": k, "solvers": solver_settings(unrolled)}
        out.append(export_module(unrolled, cases, ins, outs, axes, artifacts.graph(sibling.name, onnx_dir=out_dir),
                                 opset, report, naive=False, card=sibling))
    return out


def export_model(name: str, out_dir: Path = artifacts.ONNX_DIR, iters: int | None = None, opset: int = 17,
                 lam_input: bool | None = None, naive: bool = True, companions: bool = True,
                 checkpoint: str | Path | None = None, card_updates: dict | None = None,
                 export_name: str | None = None) -> ExportResult:
    """Export a registered model to ``out_dir/NAME.onnx`` + ``NAME.report.json`` (verified, card inside).

    ``checkpoint=PATH`` loads that checkpoint with the architecture's own loader (official SDNet
    ``model_best.pth.tar`` / ``checkpoint.pth.tar``, official VARS/RVT ``{"model": …}``) instead of the
    committed weights; the report names it (path and sha256). ``card_updates`` changes card fields (e.g.
    ``{"labels": [...]}``, or ``{"input": {"mean": [...]}}``; validated, see
    :func:`unroll.export.user_model.update_card`),
    ``export_name`` the name the graph is written and served under. With ``companions``, the graphs its
    card names are exported too (its λ rule for ``lam=auto``); they are in ``ExportResult.companions``.
    """
    spec = get_spec(name)
    declared = card = update_card(spec.card, card_updates or {})
    if checkpoint is None:  # the residual's rule was chosen for the committed weights only
        card = calibrated_ood(card, spec.info().get("ood"))
    weights = "committed" if spec.has_weights else "seeded random init"
    extra: dict = {}
    if checkpoint is not None:
        path = Path(checkpoint)
        if not path.is_file():
            raise ExportError(f"checkpoint {path} does not exist")
        try:
            model = unroll.load(name, pretrained=False, checkpoint=path)
        except ValueError as e:  # the architecture's loader: names missing / unexpected / mis-shaped keys
            raise ExportError(_first_line(e)) from None
        except Exception as e:  # torch.load: not a checkpoint at all (truncated, corrupt, another format)
            raise ExportError(f"{path}: not a readable PyTorch checkpoint ({type(e).__name__}: {_first_line(e)})"
                              ) from None
        weights = f"checkpoint {path}"
        extra["checkpoint"] = {"path": str(path.resolve()), "sha256": artifacts.sha256(path),
                               "bytes": path.stat().st_size}
    else:
        model = unroll.load(name, pretrained=spec.has_weights)
    # what unroll.pipeline compares to decide whether this export is stale
    extra[artifacts.BUILT_FROM_KEY] = artifacts.export_inputs(spec, card=declared, checkpoint=checkpoint, iters=iters,
                                                              opset=opset, lam_input=lam_input)
    if iters is not None:
        set_iterations(model, iters)
    has_lam = card.lam is not None
    lam_input = has_lam if lam_input is None else lam_input
    if lam_input and not has_lam:
        raise ExportError(f"{name} has no first-layer λ to expose (its card declares no lam input)")
    module = _Classifier(model) if has_lam and lam_input else model
    card_for_cases = card if card.name == spec.name else card.model_copy(update={"name": spec.name})
    cases = example_inputs.cases(dataclasses.replace(spec, card=resolve_card(card_for_cases, model, lam_input)),
                                 lam_input)
    return export(module, card, cases, out_dir, name=export_name, opset=opset, lam_input=lam_input, naive=naive,
                  companions=companions, extra_report={"model": export_name or name, "weights": weights,
                                                       **({"architecture": name} if export_name else {}), **extra})
