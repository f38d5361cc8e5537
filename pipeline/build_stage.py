"""Build stage: the graph that carries a precision → a TensorRT plan ``build/trt/NAME.PRECISION.plan`` + its JSON.

Stale iff the plan or its JSON is missing, the JSON says the build did not pass its parity gate, or the graph's
hash differs from the one the JSON records (``onnx_sha256``). Without TensorRT and a GPU the step cannot run: it
only reports why, and the GPU repository then serves the graph through ONNX Runtime's TensorRT provider.
"""

from __future__ import annotations

from pathlib import Path

from unroll import artifacts
from unroll.export.trt_build import build_engine, tensorrt_available
from unroll.pipeline.step import Step


def stale_reason(graph: str, precision: str, onnx_dir: Path, plan_dir: Path) -> str | None:
    """Why ``plan_dir/<graph>.<precision>.plan`` must be (re)built, or ``None`` when it is up to date."""
    plan, src = artifacts.plan(graph, precision, plan_dir), artifacts.graph(graph, precision, onnx_dir)
    report = artifacts.read_json(artifacts.plan_json(plan))
    if not plan.exists() or report is None:
        return "not built yet"
    if report.get("passed") is not True:
        return "its last build did not pass its parity gate"
    if not src.exists() or report.get("onnx_sha256") != artifacts.sha256(src):
        return f"{src.name} changed since the plan was built"
    return None


def plan_graph(graph: str, precision: str, onnx_dir: Path, plan_dir: Path, upstream: str | None = None
               ) -> Step | None:
    """The build step for ``graph`` (``upstream``: why its graph is being rebuilt first), else ``None``."""
    why = upstream or stale_reason(graph, precision, onnx_dir, plan_dir)
    if why is None:
        return None
    ok, where = tensorrt_available()
    plan = artifacts.plan(graph, precision, plan_dir)
    if not ok:
        return Step("build", graph, why, (plan, artifacts.plan_json(plan)), runnable=False,
                    message=f"cannot build {plan.name} here ({why}): {where}")
    return Step("build", graph, why, (plan, artifacts.plan_json(plan)),
                action=lambda: run(graph, precision, onnx_dir, plan_dir),
                message=f"build {plan.name} → {plan_dir} ({why})")


def run(graph: str, precision: str, onnx_dir: Path, plan_dir: Path) -> dict:
    """``unroll build GRAPH --precision PRECISION`` with the card's profile; returns the plan's JSON."""
    return build_engine(graph, precision, onnx_dir, plan_dir)
