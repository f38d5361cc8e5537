"""``unroll optimize``'s per-model choice as repository options: what ``unroll repo`` serves a model with.

The choice file (:func:`unroll.artifacts.choice`) holds the runtime, precision and Triton configuration that won on
this machine, with the evidence. :func:`apply` turns it into :class:`RepoOptions` for that model; options the caller
set explicitly are overridden, because a choice is only written when asked for and ``--no-optimized`` ignores it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path

from unroll import artifacts
from unroll.errors import PipelineError
from unroll.pipeline.repo_stage import RepoOptions

#: The :class:`RepoOptions` fields a choice sets.
CHOSEN = ("runtime", "precision", "static_shapes", "bf16", "threads", "instances", "max_batch_size", "queue_delay_us",
          "spinning")


@dataclass(frozen=True)
class Applied:
    """A model's options after its choice, and where they came from (``None``: no choice applied)."""

    options: RepoOptions
    source: Path | None = None
    note: str = ""


def read(graph: str, target: str, optimize_dir: Path | None = None) -> dict | None:
    """The choice record of ``graph`` for ``target``, or ``None`` when ``unroll optimize`` has not chosen."""
    record = artifacts.read_json(artifacts.choice(graph, target, optimize_dir))
    if record is None:
        return None
    chosen = record.get("choice")
    if not isinstance(chosen, dict) or set(chosen) - set(CHOSEN):
        raise PipelineError(f"{artifacts.choice(graph, target, optimize_dir)} is not a choice `unroll optimize` wrote "
                            f"(expected a 'choice' with keys among {', '.join(CHOSEN)}); delete it or re-run "
                            f"`unroll optimize {graph}`")
    if chosen.get("precision") == "int8" and "int8" not in (record.get("precisions_allowed") or []):
        raise PipelineError(f"{artifacts.choice(graph, target, optimize_dir)} chose INT8 without the user allowing it "
                            "(a choice written before `unroll optimize --precision`); INT8 gives up quality for speed, "
                            f"so it is served only by consent: re-run `unroll optimize {graph}` (FP32/FP16) or "
                            f"`unroll optimize {graph} --precision fp32,fp16,int8`, or delete the file")
    return record


def describe_quality(q: dict | None) -> str:
    """``int8: worst gate image loses 0.12 dB (stress/edges-1 σ=15)`` — one line for reports and the banner."""
    if not q:
        return "quality not recorded"
    if "psnr_loss_db_worst" in q:
        return (f"{q['precision']}: worst gate image loses {q['psnr_loss_db_worst']:.3f} dB"
                + (f" ({q['worst_image']})" if q.get("worst_image") else ""))
    if "accuracy_loss" in q:
        return f"{q['precision']}: gate accuracy loss {q['accuracy_loss']:.4f}"
    if "top1_agreement" in q:
        return f"{q['precision']}: top-1 agreement with FP32 {q['top1_agreement']:.4f} on the gate data"
    return q["precision"]


def apply(graph: str, options: RepoOptions, onnx_dir: Path = artifacts.ONNX_DIR,
          optimize_dir: Path | None = None) -> Applied:
    """``options`` with ``graph``'s choice applied (when ``options.optimized`` and a choice exists)."""
    if not options.optimized:
        return Applied(options)
    record = read(graph, options.target, optimize_dir)
    if record is None:
        return Applied(options)
    known = {f.name for f in fields(RepoOptions)}
    chosen = replace(options, **{k: v for k, v in record["choice"].items() if k in known})
    fp32 = artifacts.graph(graph, onnx_dir=onnx_dir)
    note = ""
    if fp32.exists() and record.get("graph_sha256") not in (None, artifacts.sha256(fp32)):
        note = "measured on an earlier export of this graph: re-run `unroll optimize` to measure this one"
    return Applied(chosen, artifacts.choice(graph, options.target, optimize_dir), note)


def served_as(graph: str, target: str = "cpu", optimize_dir: Path | None = None) -> str | None:
    """How ``unroll optimize``'s choice serves ``graph`` and what it gives up, for ``unroll serve``'s banner:
    ``openvino (static shapes), chosen by `unroll optimize` with fp32, fp16, int8 allowed; int8: worst gate image
    loses 0.120 dB (…)``; ``None`` without a choice."""
    record = read(graph, target, optimize_dir)
    if record is None:
        return None
    c = record["choice"]
    allowed = record.get("precisions_allowed")
    return (f"{c.get('runtime', '?')}{' (static shapes)' if c.get('static_shapes') else ''}, chosen by `unroll "
            f"optimize`{' with ' + ', '.join(allowed) + ' allowed' if allowed else ''}; "
            + describe_quality(record.get("quality")))
