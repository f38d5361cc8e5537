"""A registered model as an AOTInductor package (``NAME.pt2``): PyTorch's ahead-of-time compiled C++, the third
CPU runtime ``unroll optimize`` compares with ONNX Runtime and OpenVINO (``serving/aoti_runtime.py`` runs it).

The model is wrapped, named and fed exactly as for the ONNX export (:func:`~unroll.export.onnx_export.io_names`,
its real example inputs), captured with ``torch.export`` with the same dynamic axes (batch; H×W where the card's
shape has -1), compiled with ``torch._inductor.aoti_compile_and_package`` and checked against PyTorch on every
example case before it is written. Beside it, ``NAME.json`` (:func:`read_sidecar`) holds what a runtime needs
without PyTorch's help: input names and dims in call order, output names, the PyTorch version (a package runs only
on the one that built it) and the model card.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

import unroll
from unroll.errors import ExportError
from unroll.export import inputs as example_inputs
from unroll.export.onnx_export import MAX_ABS_ERR, _Classifier, _first_line, _WithResidual, io_names, resolve_card
from unroll.registry import get_spec

#: Largest batch a package accepts: well above any ``max_batch_size`` the model repository writes (32).
MAX_BATCH = 1024
#: Inductor settings: kernels read the thread count at run time (``torch.set_num_threads`` in the serving process)
#: instead of the compiling machine's, which would otherwise be compiled in.
INDUCTOR_CONFIGS = {"cpp.dynamic_threads": True}


def sidecar_of(package: str | Path) -> Path:
    """``X.pt2`` → ``X.json``."""
    return Path(package).with_suffix(".json")


def read_sidecar(path: str | Path) -> dict:
    """The JSON beside a package (``path`` is either): ``model``, ``inputs`` ({name: dims, ``None`` where
    dynamic}, in call order), ``outputs``, ``torch``, ``card``, ``parity``."""
    path = sidecar_of(path)
    if not path.is_file():
        raise ExportError(f"{path} does not exist: an AOTInductor package is written with it (unroll.export.aoti)")
    return json.loads(path.read_text())


def _ranges(axes: dict[str, dict[int, str]], min_size: int) -> dict[str, list[int | None]]:
    """``[min, max]`` (``None``: unbounded) per dynamic axis name: the batch up to :data:`MAX_BATCH`, the others
    (H, W, tokens) from the card's ``min_size``, unbounded as in the ONNX graph."""
    names = dict.fromkeys(n for a in axes.values() for n in a.values())
    return {n: [1, MAX_BATCH] if n == "batch" else [min_size, None] for n in names}


def _dynamic_shapes(axes: dict[str, dict[int, str]], ranges: dict[str, list[int | None]], ins: list[str]) -> tuple:
    """``torch.export``'s ``dynamic_shapes``, positional. The batch is one named ``Dim`` shared by every input;
    other axes are ``Dim.DYNAMIC``: torch.export then accepts guards it cannot prove but that hold for every size
    (the denoiser's ``(h + 17) // 2 * 2 <= h + 17`` slice bound, which a named ``Dim`` refuses, suggesting an
    even-H, odd-W split taken from the example), while a specialisation to the example's size is still an error."""
    batch = torch.export.Dim("batch", min=ranges["batch"][0], max=ranges["batch"][1])
    return tuple({i: batch if n == "batch" else torch.export.Dim.DYNAMIC(min=ranges[n][0], max=ranges[n][1])
                  for i, n in axes[k].items()} for k in ins)


def compile_package(name: str, out: Path, *, progress: Callable[[str], None] | None = None) -> Path:
    """Compile the registered model ``name`` to the AOTInductor package ``out`` (``.pt2``) and its sidecar.

    Raises :class:`ExportError` (nothing written) when ``torch.export`` cannot capture the model with its dynamic
    axes (no static fallback: the package would refuse other sizes), or the package differs from PyTorch by more
    than the ONNX export's tolerance on any example case.
    """
    say = progress or (lambda _msg: None)
    out = Path(out)
    if out.suffix != ".pt2":
        raise ExportError(f"{out}: an AOTInductor package is a .pt2 file")
    spec = get_spec(name)
    model = unroll.load(name, pretrained=spec.has_weights)
    lam_input = spec.card.lam is not None  # as export_model: a classifier with a λ takes it as an input
    module = (_Classifier(model) if lam_input else model).eval()
    card = resolve_card(spec.card, model, lam_input)
    if card.ood is not None:
        module = _WithResidual(module)  # the solver's residual and code size as outputs, as the ONNX export adds them
    ins, outs, axes = io_names(card, lam_input)
    cases = example_inputs.cases(dataclasses.replace(spec, card=card), lam_input)
    # batch 1 would be specialised (torch.export's 0/1 rule): capture with the first case batching several
    case = next(c for c in cases if c.inputs[ins[0]].shape[0] > 1)
    axes = {k: axes[k] for k in ins}
    ranges = _ranges(axes, card.input.min_size)
    what = ", ".join(f"{k}[{', '.join(axes[k].get(i, str(s)) for i, s in enumerate(case.inputs[k].shape))}]"
                     for k in ins)

    say(f"{name}: torch.export, dynamic {what}")
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            shapes = _dynamic_shapes(axes, ranges, ins)
            ep = torch.export.export(module, tuple(case.inputs[k] for k in ins),  # (the wrapper takes *inputs)
                                     dynamic_shapes=(shapes,) if isinstance(module, _WithResidual) else shapes)
    except Exception as e:  # constraint violations name the axis, the guard and a suggested fix
        raise ExportError(f"{name}: torch.export cannot capture the model with dynamic {what}: "
                          f"{type(e).__name__}: {_explain(e)}") from e
    say(f"{name}: AOTInductor compile")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.tmp.pt2")
    try:
        try:
            torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp),
                                                     inductor_configs=dict(INDUCTOR_CONFIGS))  # (it adds to it)
        except Exception as e:
            raise ExportError(f"{name}: AOTInductor could not compile the exported program: "
                              f"{type(e).__name__}: {_first_line(e)}") from e
        seconds = round(time.perf_counter() - t0, 1)
        say(f"{name}: checking against PyTorch on {len(cases)} cases")
        parity = _verify(tmp, module, cases, ins)
        bad = [r for r in parity if r["max_abs_err"] > MAX_ABS_ERR]
        if bad:
            raise ExportError(f"{name}: the AOTInductor package differs from PyTorch beyond max abs {MAX_ABS_ERR:g}: "
                              + "; ".join(f"{r['case']}: {r['max_abs_err']:.2e}" for r in bad))
        os.replace(tmp, out)  # atomic: a reader never loads a half-written package
    finally:
        tmp.unlink(missing_ok=True)
    sidecar = {"model": name,
               "inputs": {k: [None if i in axes[k] else int(s) for i, s in enumerate(case.inputs[k].shape)]
                          for k in ins},
               "outputs": outs, "torch": torch.__version__, "card": card.model_dump(mode="json"),
               "axes": axes, "ranges": ranges, "inductor_configs": INDUCTOR_CONFIGS, "compile_seconds": seconds,
               "parity": {"max_abs_tol": MAX_ABS_ERR, "cases": parity}}
    sidecar_of(out).write_text(json.dumps(sidecar, indent=2) + "\n")
    return out


def _verify(package: Path, module: torch.nn.Module, cases: list[example_inputs.Case], ins: list[str]) -> list[dict]:
    """Max abs error of the package against ``module`` per example case."""
    compiled = torch._inductor.aoti_load_package(str(package))
    rows = []
    with torch.inference_mode():
        for c in cases:
            args = [c.inputs[k] for k in ins]
            try:
                got = compiled(*args)
            except Exception as e:
                raise ExportError(f"{c.label}: the AOTInductor package could not run it: {_first_line(e)}") from e
            want = module(*args)
            pairs = zip(*((o,) if isinstance(o, torch.Tensor) else tuple(o) for o in (got, want)), strict=True)
            rows.append({"case": c.label, "shapes": {k: list(c.inputs[k].shape) for k in ins},
                         "max_abs_err": max(float((g - w).abs().max()) for g, w in pairs)})
    return rows


def _explain(e: BaseException) -> str:
    """``torch.export``'s first line, the guards it could not prove and its suggested fixes (not the traceback)."""
    text = str(e)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    keep = [lines[0] if lines else type(e).__name__, *[ln for ln in lines if ln.startswith("- ")][:4]]
    if "Suggested fixes:" in text:
        fixes = text.split("Suggested fixes:", 1)[1].split("\n\n", 1)[0]
        keep.append("suggested fixes: " + "; ".join(ln.strip() for ln in fixes.splitlines() if ln.strip()))
    return " ".join(keep)
