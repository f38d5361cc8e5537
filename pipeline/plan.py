"""What must run to serve some models, and running it: :func:`plan` and :func:`run`.

The stages form one chain per model — export → quantize (precisions other than fp32) → build (TensorRT plans,
when asked) → repo — and a step is planned when its own artifact is stale (each stage's rule, in its module) or
when a step before it in the chain is planned (its input is about to change). ``unroll serve``, ``unroll repo``,
the container staging and the benchmarks all plan with this, so they agree on what is stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from unroll import artifacts
from unroll.errors import PipelineError
from unroll.pipeline import build_stage, choice, export_stage, quantize_stage, repo_stage
from unroll.pipeline.repo_stage import RepoOptions
from unroll.pipeline.step import Step


def plan(models: Iterable[str], *, onnx_dir: Path = artifacts.ONNX_DIR, repo: Path | None = None,
         options: RepoOptions | None = None, plan_dir: Path = artifacts.TRT_DIR, precision: str | None = None,
         companions: bool = True, build: bool = False, force: bool = False) -> list[Step]:
    """The steps that bring ``models`` (registered names or exported graphs) up to date, in the order to run.

    ``repo``: also the Triton repository there, written with ``options`` (default :class:`RepoOptions`); without
    it the chain stops before the repo stage. ``precision`` (default ``options.precision``, else fp32): the graph
    served, quantized when it is not fp32. ``companions``: each model's λ-rule graph too. ``build``: TensorRT plans
    too (GPU target). ``force``: every step, stale or not (``--rebuild``).
    """
    options = options or RepoOptions()
    precision = precision or options.precision
    steps: list[Step] = []
    for model in dict.fromkeys(models):
        export = export_stage.plan_model(model, onnx_dir, force)
        steps += [export] if export is not None else []
        for graph in export_stage.graphs_of([model], onnx_dir, companions):
            steps += plan_graph(graph, onnx_dir=onnx_dir, repo=repo, options=options, plan_dir=plan_dir,
                                precision=precision, build=build, force=force,
                                upstream=f"{model} is re-exported" if export is not None else None)
    return steps


def plan_graph(graph: str, *, onnx_dir: Path = artifacts.ONNX_DIR, repo: Path | None = None,
               options: RepoOptions | None = None, plan_dir: Path = artifacts.TRT_DIR, precision: str = "fp32",
               build: bool = False, force: bool = False, upstream: str | None = None) -> list[Step]:
    """The steps after export for one exported graph (``upstream``: why its graph is about to change); with
    ``unroll optimize``'s choice for it applied (:func:`unroll.pipeline.choice.apply`)."""
    options = options or RepoOptions()
    applied = choice.apply(graph, options, onnx_dir)
    if applied.source is not None:
        options, precision = applied.options, applied.options.precision
    upstream = upstream or ("--rebuild" if force else None)
    steps: list[Step] = []
    quantize = quantize_stage.plan_graph(graph, precision, onnx_dir, upstream)
    if quantize is not None:
        steps.append(quantize)
        upstream = upstream or f"{artifacts.graph(graph, precision).name} is re-made"
    if build and options.target == "gpu":
        made = build_stage.plan_graph(graph, precision, onnx_dir, plan_dir, upstream)
        if made is not None:
            steps.append(made)
            upstream = upstream or (f"{artifacts.plan(graph, precision).name} is rebuilt" if made.runnable else None)
    if repo is not None:
        written = repo_stage.plan_graph(graph, repo, onnx_dir, plan_dir, options, upstream)
        steps += [written] if written is not None else []
    return steps


def run(steps: Iterable[Step], progress: Callable[[str], None] | None = print) -> list[Step]:
    """Run ``steps`` in order, saying each one through ``progress``; returns the steps that ran.

    A step that cannot run here (``runnable`` False) is only reported. A stage's own error (export, quantize,
    build, repository) propagates unchanged, so the caller's message is the stage's.
    """
    done = []
    for step in steps:
        if progress is not None:
            progress(str(step))
        if not step.runnable:
            continue
        if step.action is None:
            raise PipelineError(f"{step}: nothing to run")
        step.action()
        done.append(step)
    return done


def stale(steps: Iterable[Step]) -> dict[tuple[str, str], str]:
    """``{(stage, name): reason}`` of a plan, for messages and tests."""
    return {s.key: s.reason for s in steps}
