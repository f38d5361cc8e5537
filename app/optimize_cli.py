"""``unroll optimize NAME``: measure every runtime × precision × Triton configuration here and keep the best.

The measuring code (:mod:`unroll.benchmarks.optimize`) pulls in PyTorch and the runtimes, so it is imported inside
the command (this module is imported at every ``unroll`` start, in the serving image too).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from unroll import artifacts
from unroll.app.errors import fail, handles_errors

console = Console()
err = Console(stderr=True)
RESULTS = artifacts.RESULTS_DIR


@handles_errors
def optimize(
    name: Annotated[str, typer.Argument(help="A registered model (`unroll models`) or a graph stem in --onnx-dir")],
    target: Annotated[str, typer.Option(help="cpu: ONNX Runtime / OpenVINO / AOTInductor through the bundled Triton; "
                                             "gpu: the PyTorch CUDA candidates (needs a CUDA GPU)")] = "cpu",
    latency_budget_ms: Annotated[float | None, typer.Option(
        help="The configuration sweep's objective is the best throughput at a concurrency whose p99 stays within "
             "this; default: the best throughput")] = None,
    time_budget_min: Annotated[float, typer.Option(
        help="Stop measuring after this long and choose from what was measured (the report says so)")] = 15.0,
    threads: Annotated[int | None, typer.Option(help="Threads per model instance (default: up to 2)")] = None,
    precision: Annotated[str, typer.Option(
        help="Precisions the choice may use, comma-separated, among fp32, fp16, int8. INT8 trades quality for "
             "speed, so it is a candidate only when named here; the report and `unroll serve`'s banner show what "
             "the chosen precision loses on the gate data")] = "fp32,fp16",
    sweep: Annotated[bool, typer.Option("--sweep/--no-sweep",
                                        help="Run the Triton configuration sweep (needs perf_analyzer)")] = True,
    compare: Annotated[bool, typer.Option("--compare/--no-compare", help="Time the served choice (Triton direct) "
                                          "against torch.compile in process, in the same run")] = True,
    fresh: Annotated[bool, typer.Option("--fresh", help="Measure everything again instead of resuming an "
                                                        "interrupted run")] = False,
    publish: Annotated[bool, typer.Option("--publish", help="Also copy the report to benchmarks/results/"
                                                            "optimize_NAME.{json,md}")] = False,
    onnx_dir: Annotated[Path, typer.Option(help="ONNX exports (a stale one is exported first)")] = artifacts.ONNX_DIR,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar")] = True,
) -> None:
    """Find the fastest correct runtime, precision and Triton configuration for NAME on this machine.

    Every candidate is checked against the FP32 PyTorch model on the card's gate data before it is timed (a wrong
    candidate is refused and reported); the fastest one then goes through a Triton configuration sweep with
    perf_analyzer. The choice and its evidence are written to build/optimize/NAME.TARGET.{json,md}, and
    `unroll repo` / `unroll serve` serve the choice. An interrupted run resumes where it stopped.
    """
    if target not in ("cpu", "gpu"):
        raise fail(f"--target must be cpu or gpu, not {target!r}")
    precisions = _precisions(precision)
    if time_budget_min <= 0 or (latency_budget_ms is not None and latency_budget_ms <= 0):
        raise fail("--time-budget-min and --latency-budget-ms must be > 0")
    if target == "gpu":
        from unroll.benchmarks.optimize_gpu import run_gpu  # local: torch

        record = run_gpu(name, time_budget_min * 60, fresh)
    else:
        record = _run_cpu(name, latency_budget_ms, time_budget_min, threads, sweep, compare, fresh, onnx_dir, progress,
                          precisions)
    path = artifacts.choice(name, target)
    if publish:
        RESULTS.mkdir(parents=True, exist_ok=True)
        for suffix in (".json", ".md"):
            shutil.copyfile(path.with_suffix(suffix), RESULTS / f"optimize_{name}.{target}{suffix}")
    console.print(path.with_suffix(".md").read_text())
    console.print(f"[green]✓[/] {name}: chose {_chosen(record)}; written to {path} "
                  f"({'served by `unroll repo`' if target == 'cpu' else 'measured only'})")


def _precisions(text: str) -> tuple[str, ...]:
    """``--precision fp32,fp16`` → ``("fp32", "fp16")``; a clear error for anything else."""
    from unroll.benchmarks.optimize import PRECISIONS  # (light: the module imports its heavy parts inside)

    got = tuple(dict.fromkeys(p.strip().lower() for p in text.split(",") if p.strip()))
    unknown = [p for p in got if p not in PRECISIONS]
    if not got or unknown:
        raise fail(f"--precision {text!r}: give a comma-separated list among {', '.join(PRECISIONS)}"
                   + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    return got


def _run_cpu(name, latency_budget_ms, time_budget_min, threads, sweep, compare, fresh, onnx_dir, progress,
             precisions) -> dict:
    from unroll.benchmarks import optimize as opt  # local: torch, onnxruntime
    from unroll.benchmarks.common import progress_bars

    settings = opt.Settings(name, latency_budget_ms, time_budget_min, onnx_dir=onnx_dir, fresh=fresh, sweep=sweep,
                            compare=compare, precisions=precisions,
                            **({"threads": threads} if threads else {}))
    with progress_bars(progress) as bars:
        task = bars.add_task(f"optimize {name}", total=None, info="")
        return opt.run(settings, progress=lambda msg: bars.update(task, info=msg) if progress else err.print(msg),
                       advance=lambda n: bars.advance(task, n), total=lambda n: bars.update(task, total=n))


def _chosen(record: dict) -> str:
    c = record["choice"]
    if not c:
        return record.get("best", "nothing")
    return (f"{c['runtime']}{' (static shapes)' if c.get('static_shapes') else ''} "
            f"{'bf16' if c.get('bf16') else c['precision']}, "
            f"{c['instances']}×{c['threads']} threads, max batch {c['max_batch_size']}, "
            f"queue delay {c['queue_delay_us']} µs")
