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
from dataclasses import dataclass
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
from unroll.registry import ModelSpec, get_spec
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


class _Classifier(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, image: torch.Tensor, lam: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(image, lam)


def io_names(spec: ModelSpec, lam_input: bool) -> tuple[list[str], list[str], dict[str, dict[int, str]]]:
    """Graph input/output names and dynamic axes for a registered model (CONVENTIONS.md)."""
    if spec.task == "classification":
        ins = ["image", "lam"] if lam_input else ["image"]
        axes = {"image": {0: "batch"}, "logits": {0: "batch"}, "lam": {0: "batch"}}
        return ins, ["logits"], {k: v for k, v in axes.items() if k in ins or k == "logits"}
    if spec.task == "denoising":
        hw = {0: "batch", 2: "height", 3: "width"}
        return ["noisy", "sigma"], ["denoised"], {"noisy": hw, "sigma": {0: "batch"}, "denoised": hw}
    dyn = {0: "batch", 1: "tokens"} if len(spec.input_shape) == 2 else {0: "batch"}
    return ["x"], ["y"], {"x": dyn, "y": dyn}


def set_iterations(model: nn.Module, k: int) -> None:
    """Change K for every solver layer (``--iters``); learned per-step weights cannot be re-unrolled."""
    from unroll.models.denoiser import CSCDenoiser

    for m in model.modules():
        if isinstance(m, CSCDenoiser) and m.n_steps != k:
            raise ExportError(f"csc-denoiser has learned weights for each of its {m.n_steps} steps; "
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
                  naive: bool = True) -> ExportResult:
    """Trace, slim, check, lint, verify, then (and only then) write ``out_path`` and its report."""
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


def export_auto_lam(name: str = "sdnet-mnist", out_dir: Path = Path("build/onnx"), opset: int = 17) -> ExportResult:
    """``NAME.autolam.onnx``: image → per-sample λ from the fitted rule λ* = a·r + b (``lam=auto``).

    A separate small graph (one CSC pass and its reconstruction), so the classifier graph stays a
    pure function of ``(image, lam)`` and serving can choose λ first.
    """
    spec = get_spec(name)
    model = unroll.load(name, pretrained=spec.has_weights)
    if not hasattr(model, "auto_lam"):
        raise ExportError(f"{name} has no fitted λ rule (lam=auto)")
    cases = [example_inputs.Case(c.label, {"image": c.inputs["image"]})
             for c in example_inputs.cases(spec, lam_input=False)]
    extra = {"model": name, "task": "auto-lambda", "weights": "committed" if spec.has_weights else "seeded random init",
             "rule": "lam = clamp(a * rms(x - D c(x)) + b, lam_min, lam_max)",
             "coefficients": [float(v) for v in model.lam_auto]}
    return export_module(_AutoLam(model), cases, ["image"], ["lam"], {"image": {0: "batch"}, "lam": {0: "batch"}},
                         Path(out_dir) / f"{name}.autolam.onnx", opset, extra, naive=False)


def export_model(name: str, out_dir: Path = Path("build/onnx"), iters: int | None = None, opset: int = 17,
                 lam_input: bool | None = None, naive: bool = True) -> ExportResult:
    """Export a registered model to ``out_dir/NAME.onnx`` + ``NAME.report.json`` (verified)."""
    spec = get_spec(name)
    model = unroll.load(name, pretrained=spec.has_weights)
    if iters is not None:
        set_iterations(model, iters)
    is_sdnet = spec.task == "classification"
    lam_input = is_sdnet if lam_input is None else lam_input
    if lam_input and not is_sdnet:
        raise ExportError(f"{name} has no first-layer λ to expose (lam input is for SDNet classifiers)")
    module = _Classifier(model) if is_sdnet else model
    ins, outs, axes = io_names(spec, lam_input)
    fixed = None
    if spec.task == "classification":
        fixed = (f"fixed {spec.input_shape[1]}×{spec.input_shape[2]} input: the classifier was built and trained "
                 "for this resolution")
    extra = {"model": name, "task": spec.task, "weights": "committed" if spec.has_weights else "seeded random init",
             "lam_input": lam_input, "fixed_resolution": fixed, "solvers": solver_settings(model)}
    return export_module(module, example_inputs.cases(spec, lam_input), ins, outs, axes,
                         Path(out_dir) / f"{name}.onnx", opset, extra, naive)
