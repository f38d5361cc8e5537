"""Quantize stage: ``NAME.onnx`` (its card inside) → ``NAME.fp16.onnx`` / ``NAME.int8.onnx`` + the gate's report.

Stale iff the quantized graph is missing or its report's ``built_from`` (the FP32 graph's hash and the quantize
options, :func:`unroll.export.quantize.quantize_inputs`) differs from now. A graph whose last try failed its gate
is missing, so it is tried again.
"""

from __future__ import annotations

from pathlib import Path

from unroll import artifacts
from unroll.pipeline.step import Step, changed_words

_CHANGED = {"upstream": "older than the FP32 export (made from another one)",
            "options": "the quantize options changed"}


def stale_reason(graph: str, precision: str, onnx_dir: Path) -> str | None:
    """Why ``onnx_dir/<graph>.<precision>.onnx`` must be (re)made, or ``None`` when it is up to date."""
    from unroll.export.quantize import quantize_inputs  # local: keeps onnxruntime out of `unroll serve` startup

    out, fp32 = artifacts.graph(graph, precision, onnx_dir), artifacts.graph(graph, onnx_dir=onnx_dir)
    if not out.exists():
        return "not quantized"
    if not fp32.exists():
        return "its FP32 graph is missing"
    report = artifacts.read_json(artifacts.report_of(out)) or {}
    changed = artifacts.changed_inputs(report.get(artifacts.BUILT_FROM_KEY), quantize_inputs(fp32, precision))
    return changed_words(changed, _CHANGED) or None


def plan_graph(graph: str, precision: str, onnx_dir: Path, upstream: str | None = None) -> Step | None:
    """The quantize step for ``graph`` (``upstream``: why its FP32 graph is being rebuilt first), else ``None``."""
    if precision == "fp32":
        return None
    why = upstream or stale_reason(graph, precision, onnx_dir)
    if why is None:
        return None
    out = artifacts.graph(graph, precision, onnx_dir)
    return Step("quantize", graph, why, (out, artifacts.report_of(out)), action=lambda: run(graph, precision, onnx_dir),
                message=f"quantize {graph} to {precision} → {onnx_dir} ({why})")


def run(graph: str, precision: str, onnx_dir: Path) -> dict:
    """``unroll quantize GRAPH --precision PRECISION`` with the card's gates; returns its report."""
    from unroll.export.quantize import quantize  # local: keeps onnxruntime out of `unroll serve` startup

    return quantize(graph, precision, onnx_dir)
