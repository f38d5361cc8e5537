"""Repo stage: graphs (and plans) → one model directory each in a Triton repository (config, version 1, labels).

Each directory records what it was written from (:data:`unroll.artifacts.REPOSITORY_SOURCE_FILE`: the hashes of
:func:`unroll.serving.repository.repository_inputs`, and of every file written). Stale iff it is missing, has no
such record, was written from other inputs (graph, report, plan, backend, target, precision, options), or one of
its files changed since.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from unroll import artifacts
from unroll.pipeline.step import Step, changed_words
from unroll.serving.repository import (
    DEFAULT_QUEUE_DELAY_US,
    INTRA_OP_SPINNING,
    repository_inputs,
    write_repository,
)

_CHANGED = {"upstream": "its graph changed", "fp32": "its FP32 graph changed", "export_report": "its export changed",
            "plan": "its plan changed", "backend": "the Python backend (model.py) changed",
            "options": "written with other options (target, precision, batching, threads, runtime)",
            "package": "its AOTInductor package changed"}


@dataclass(frozen=True)
class RepoOptions:
    """How ``unroll repo`` writes each model (:func:`unroll.serving.repository.write_repository`'s options)."""

    target: str = "cpu"
    precision: str = "fp32"
    threads: int = 2
    max_batch_size: int | None = None
    queue_delay_us: int = DEFAULT_QUEUE_DELAY_US
    instances: int = 1
    cpu_stand_in: bool = False
    spinning: bool = INTRA_OP_SPINNING
    #: CPU runtime and shape mode for every model (``None``: each card's ``cpu_runtime`` / ``cpu_static_shapes``)
    runtime: str | None = None
    static_shapes: bool | None = None
    #: OpenVINO's bfloat16 maths (a reduced precision that passed the FP16 gate in ``unroll optimize``)
    bf16: bool = False
    #: take each model's configuration from ``unroll optimize``'s choice where there is one (:mod:`.choice`)
    optimized: bool = True

    def writer_kwargs(self) -> dict:
        """Keyword arguments of ``write_repository`` besides the target."""
        return {k: v for k, v in asdict(self).items() if k not in ("target", "optimized")}


def stale_reason(graph: str, repo: Path, onnx_dir: Path, plan_dir: Path, options: RepoOptions) -> str | None:
    """Why ``repo/<graph>`` must be (re)written, or ``None`` when it is up to date."""
    model_dir = artifacts.model_dir(graph, repo)
    if not artifacts.model_config(model_dir).exists():
        return "not written yet"
    record = artifacts.read_json(model_dir / artifacts.REPOSITORY_SOURCE_FILE)
    if record is None:
        return "written without a record of its inputs"
    current = repository_inputs(graph, options.target, onnx_dir=onnx_dir, plan_dir=plan_dir, **options.writer_kwargs())
    why = changed_words(artifacts.changed_inputs(record.get(artifacts.BUILT_FROM_KEY), current), _CHANGED)
    if why:
        return why
    files = record.get("files") if isinstance(record.get("files"), dict) else {}
    for rel, digest in files.items():
        path = model_dir / rel
        if not path.is_file() or artifacts.sha256(path) != digest:
            return f"{rel} changed since it was written"
    return None


def plan_graph(graph: str, repo: Path, onnx_dir: Path, plan_dir: Path, options: RepoOptions,
               upstream: str | None = None) -> Step | None:
    """The repo step for ``graph`` (``upstream``: why an input is being rebuilt first), else ``None``."""
    why = upstream or stale_reason(graph, repo, onnx_dir, plan_dir, options)
    if why is None:
        return None
    return Step("repo", graph, why, (artifacts.model_dir(graph, repo),),
                action=lambda: run([graph], repo, onnx_dir, plan_dir, options),
                message=f"write Triton repository {repo} ({options.target}): {graph} ({why})")


def run(graphs: list[str], repo: Path, onnx_dir: Path, plan_dir: Path, options: RepoOptions) -> list[Path]:
    """Write ``repo/<graph>`` for each of ``graphs`` (validated); returns the files written."""
    return write_repository(options.target, graphs, repo, onnx_dir=onnx_dir, plan_dir=plan_dir,
                            **options.writer_kwargs())
