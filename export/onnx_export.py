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
import json
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
from unroll.export import inputs as example_inputs
from unroll.export.trt_lint import lint

import unroll
from unroll.card import ModelCard, write_to_onnx
from unroll.registry import get_spec
from unroll.solvers.shrink import textbook_mode

MAX_ABS_ERR = 1e-4
MAX_REL_ERR = 1e-5
SHRINK_CHAIN_OPS = ("Sign", "Abs", "Where", "Greater", "Less")


class ExportError(RuntimeError):
    """The model cannot be exported as a valid, verified static graph (nothing was written)."""


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
    axes[card.output] = dyn if card.task in ("denoising", "block") else {0: "batch"}
    return ins, [card.output], axes


def resolve_card(card: ModelCard, model: nn.Module, lam_input: bool) -> ModelCard:
    """The card as exported: λ's default filled in from the model's first solver layer, λ dropped if baked in."""
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


def set_iterations(model: nn.Module, k: int) -> None:
    """Change K for every solver layer (``--iters``); learned per-step weights cannot be re-unrolled."""
    from unroll.models.denoiser import CSCDenoiser

    for m in model.modules():
        if isinstance(m, CSCDenoiser) and m.n_steps != k:
            raise ExportError(f"the CSC denoiser has learned weights for each of its {m.n_steps} steps; "
                              f"--iters {k} would need retraining")
        if hasattr(m, "eval_steps"):
            m.eval_steps = k
        elif hasattr(m, "n_steps"):
            m.n_steps = k


def solver_settings(model: nn.Module) -> list[dict]:
    """What was frozen, per solver layer, for the report."""
    from unroll.models.denoiser import CSCDenoiser
    from unroll.solvers.csc import DictBlock, fista_momenta
    from unroll.solvers.dic_attn import DicAttention
    from unroll.solvers.nmf import NMFHam
    from unroll.solvers.vars_attn import VARSAttention

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
            out.append({"layer": name or "model", "solver": f"ISTA (VARS-{m.mode.upper()})",
                        "iterations": m.n_steps, "lambda": m.lmbd,
                        "frozen": ["random-feature matrix Ω"] + (["static atoms"] if m.mode == "sd" else [])})
        elif isinstance(m, NMFHam):
            out.append({"layer": name or "model", "solver": "NMF multiplicative updates", "iterations": m.eval_steps,
                        "rank": m.bases.shape[-1], "frozen": ["seeded NMF bases (official code redraws per call)"]})
        elif isinstance(m, DicAttention):
            out.append({"layer": name or "model", "solver": "ISTA (elastic net)", "iterations": m.n_steps,
                        "beta": m.beta, "mu": m.mu, "frozen": ["unit-norm atoms", "L = ‖D‖² + μ",
                                                              "step matrix I(1−μ/L) − DᵀD/L"]})
    return out


def _torch_export(module: nn.Module, args: tuple, path: str, ins: list[str], outs: list[str],
                  axes: dict, opset: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, path, input_names=ins, output_names=outs, dynamic_axes=axes,
                          opset_version=opset, do_constant_folding=True, dynamo=False)


def op_histogram(model: onnx.ModelProto) -> dict[str, int]:
    return dict(sorted(collections.Counter(n.op_type for n in model.graph.node).items()))


def _trace(module: nn.Module, case: example_inputs.Case, ins: list[str], outs: list[str], axes: dict,
           opset: int, workdir: str, tag: str) -> tuple[onnx.ModelProto, int]:
    raw_path = os.path.join(workdir, f"{tag}.raw.onnx")
    args = tuple(case.inputs[k] for k in ins)
    try:
        _torch_export(module, args, raw_path, ins, outs, axes, opset)
    except Exception as e:  # the exporter's own message names the unsupported construct
        raise ExportError(f"torch.onnx.export failed: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    raw = onnx.load(raw_path)
    slim = onnxslim.slim(raw)
    return slim, len(raw.graph.node)


def verify(model_bytes: bytes, module: nn.Module, cases: list[example_inputs.Case], ins: list[str]) -> list[dict]:
    """ONNX Runtime (CPU, FP32) vs PyTorch on every case: max abs and norm-wise relative error."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
    rows = []
    for case in cases:
        feed = {k: case.inputs[k].numpy() for k in ins}
        got = sess.run(None, feed)[0]
        with torch.no_grad():
            ref = module(*(case.inputs[k] for k in ins)).numpy()
        if got.shape != ref.shape:
            raise ExportError(f"{case.label}: ONNX output shape {got.shape} != PyTorch {ref.shape}")
        diff = np.abs(got.astype(np.float64) - ref)
        rel = float(np.linalg.norm(diff) / max(np.linalg.norm(ref), 1e-30))
        rows.append({"case": case.label, "batch": int(next(iter(feed.values())).shape[0]),
                     "shapes": {k: list(v.shape) for k, v in feed.items()},
                     "max_abs_err": float(diff.max()), "rel_err": rel,
                     "ok": bool(diff.max() <= MAX_ABS_ERR and rel <= MAX_REL_ERR)})
    return rows


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
        fused, raw_nodes = _trace(module, cases[0], ins, outs, axes, opset, tmp, "fused")
        try:
            onnx.checker.check_model(fused, full_check=True)
            fused = onnx.shape_inference.infer_shapes(fused, check_type=True, strict_mode=True)
        except Exception as e:
            raise ExportError(f"ONNX checker / shape inference rejected the graph: {e}") from e
        issues = lint(fused)
        if issues:
            raise ExportError("TensorRT would not parse this graph:\n  " + "\n  ".join(map(str, issues)))
        if card is not None:
            write_to_onnx(fused, card)
        blob = fused.SerializeToString()
        parity = verify(blob, module, cases, ins)
        bad = [r for r in parity if not r["ok"]]
        if bad:
            raise ExportError("ONNX Runtime output differs from PyTorch beyond max abs 1e-4 / rel 1e-5: " +
                              "; ".join(f"{r['case']}: abs {r['max_abs_err']:.2e}, rel {r['rel_err']:.2e}"
                                        for r in bad))
        naive_info = None
        if naive:
            with textbook_mode():
                naive_model, naive_raw = _trace(module, cases[0], ins, outs, axes, opset, tmp, "naive")
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
        "trt_lint": {"ok": True, "issues": [], "checked": "TensorRT 10/11 ONNX parser operator support"},
        "cleanup": f"onnxslim {onnxslim.__version__}; onnx.checker full_check; strict shape inference",
        "versions": {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": ort.__version__},
        "export_seconds": round(time.perf_counter() - t0, 2),
        "file_bytes": len(blob),
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = out_path.with_suffix(".onnx.tmp")
    tmp_path.write_bytes(blob)
    os.replace(tmp_path, out_path)  # atomic: a reader never sees a half-written model
    report_path = out_path.with_suffix(".report.json")
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


def export_auto_lam(name: str, out_dir: Path = Path("build/onnx"), opset: int = 17,
                    model: nn.Module | None = None) -> ExportResult:
    """``out_dir/<card.lam.auto>.onnx``: image → per-sample λ from the model's fitted rule (``lam=auto``).

    A separate small graph (one CSC pass and its reconstruction), so the classifier graph stays a
    pure function of ``(image, lam)`` and serving can choose λ first. Its card (task ``lambda-rule``)
    names the classifier it serves, and the classifier's card names it (``lam.auto``).
    """
    spec = get_spec(name)
    if spec.card.lam is None or spec.card.lam.auto is None:
        raise ExportError(f"{name}: its card declares no λ rule (lam.auto)")
    model = model if model is not None else unroll.load(name, pretrained=spec.has_weights)
    if not hasattr(model, "auto_lam"):
        raise ExportError(f"{name}: the card names a λ rule but the model has no auto_lam(image) method")
    main = spec.card.input.name
    card = spec.card.companion("lambda-rule", spec.card.lam.auto, f"λ rule (lam=auto) for {name}", "lam")
    cases = [example_inputs.Case(c.label, {main: c.inputs[main]})
             for c in example_inputs.cases(spec, lam_input=False)]
    extra = {"model": card.name, "task": card.task,
             "weights": "committed" if spec.has_weights else "seeded random init",
             "rule": "lam = clamp(a * rms(x - D c(x)) + b, lam_min, lam_max)",
             "coefficients": [float(v) for v in model.lam_auto]}
    return export_module(_AutoLam(model), cases, [main], ["lam"], {main: {0: "batch"}, "lam": {0: "batch"}},
                         Path(out_dir) / f"{card.name}.onnx", opset, extra, naive=False, card=card)


def export_model(name: str, out_dir: Path = Path("build/onnx"), iters: int | None = None, opset: int = 17,
                 lam_input: bool | None = None, naive: bool = True, companions: bool = True) -> ExportResult:
    """Export a registered model to ``out_dir/NAME.onnx`` + ``NAME.report.json`` (verified, card inside).

    With ``companions``, the graphs its card names are exported too (its λ rule for ``lam=auto``); their
    results are in ``ExportResult.companions``.
    """
    spec = get_spec(name)
    model = unroll.load(name, pretrained=spec.has_weights)
    if iters is not None:
        set_iterations(model, iters)
    has_lam = spec.card.lam is not None
    lam_input = has_lam if lam_input is None else lam_input
    if lam_input and not has_lam:
        raise ExportError(f"{name} has no first-layer λ to expose (its card declares no lam input)")
    card = resolve_card(spec.card, model, lam_input)
    module = _Classifier(model) if has_lam else model
    ins, outs, axes = io_names(card, lam_input)
    fixed = None
    if card.input.fixed_hw is not None:
        fixed = (f"fixed {card.input.fixed_hw[0]}×{card.input.fixed_hw[1]} input: the model was built and trained "
                 "for this resolution")
    extra = {"model": name, "task": card.task, "weights": "committed" if spec.has_weights else "seeded random init",
             "lam_input": lam_input, "fixed_resolution": fixed, "solvers": solver_settings(model)}
    result = export_module(module, example_inputs.cases(spec, lam_input), ins, outs, axes,
                           Path(out_dir) / f"{name}.onnx", opset, extra, naive, card=card)
    if companions and lam_input and card.lam.auto is not None:
        result.companions.append(export_auto_lam(name, out_dir, opset, model=model))
    return result
