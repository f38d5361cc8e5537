"""``unroll repo`` and ``unroll triton``: Typer command functions, registered on the main CLI.

Plain functions (no Typer app here) so ``unroll/cli.py`` can do ``app.command("repo")(repo)`` and
``app.command("triton")(triton)``. Errors print one sentence to stderr and exit 1 (no traceback).
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from unroll.serving.repository import (
    AUTOLAM_SUFFIX,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_QUEUE_DELAY_US,
    PRECISIONS,
    RepositoryError,
    validate_model,
    write_repository,
)

console = Console()
err = Console(stderr=True)
DEFAULT_LOG = Path("build/logs/tritonserver.log")


def _fail(message: str) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(1)


def _has_auto_lam(name: str) -> bool:
    """Whether the architecture has a fitted λ rule (``lam="auto"``) to serve as ``NAME-autolam``."""
    import unroll

    return hasattr(unroll.load(name, pretrained=False), "auto_lam")


def _ensure_exports(names: list[str], onnx_dir: Path, autolam: bool) -> list[str]:
    """Export whatever ONNX is missing; returns the model list with ``NAME-autolam`` companions added.

    Nothing heavy (torch) is imported when every export is already there.
    """
    served = list(dict.fromkeys(names))
    with Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), TimeElapsedColumn(), console=err,
                  transient=True) as bar:

        def build(path: Path, what: str, base: str) -> None:
            from unroll.export.onnx_export import ExportError, export_auto_lam, export_model

            task = bar.add_task(f"exporting {path.name} (not built yet)", total=None)
            try:
                export_auto_lam(base, onnx_dir) if what == "autolam" else export_model(base, onnx_dir)
            except KeyError as e:  # unknown model name: the registry's message lists the known ones
                raise _fail(str(e.args[0])) from None
            except ExportError as e:
                raise _fail(f"exporting {path.name} failed: {e}") from None
            bar.remove_task(task)
            console.print(f"[green]✓[/] exported {path}")

        for base in dict.fromkeys(n.removesuffix(AUTOLAM_SUFFIX) for n in served):
            onnx_path, autolam_path = onnx_dir / f"{base}.onnx", onnx_dir / f"{base}.autolam.onnx"
            if not onnx_path.exists():
                build(onnx_path, "model", base)
            companion = f"{base}{AUTOLAM_SUFFIX}"
            if companion not in served:
                if not autolam:
                    continue
                task = json.loads(onnx_path.with_suffix(".report.json").read_text()).get("task")
                if not autolam_path.exists() and not (task == "classification" and _has_auto_lam(base)):
                    continue
                served.insert(served.index(base) + 1 if base in served else len(served), companion)
            if not autolam_path.exists():
                build(autolam_path, "autolam", base)
    return served


def repo(
    target: Annotated[str, typer.Option(
        help="cpu: Python-backend models that run the ONNX with ONNX Runtime (what the bundled Triton serves); "
             "gpu: TensorRT plans, or ONNX Runtime with the TensorRT accelerator, for the NGC tritonserver "
             "container")] = "cpu",
    models: Annotated[str, typer.Option(
        help="Comma-separated model names (see `unroll models`); NAME-autolam serves NAME's lam=auto rule")]
        = "sdnet-mnist,csc-denoiser",
    precision: Annotated[str, typer.Option(
        help="fp32, fp16 or int8: gpu uses build/trt/NAME.PRECISION.plan when present, else TensorRT's "
             "precision_mode; cpu fp16/int8 serve build/onnx/NAME.PRECISION.onnx from `unroll quantize`")] = "fp32",
    out: Annotated[Path, typer.Option(help="Model repository folder to write")] = Path("model_repository"),
    onnx_dir: Annotated[Path, typer.Option(help="Where `unroll export` wrote NAME.onnx (missing ones are "
                                                "exported first)")] = Path("build/onnx"),
    plan_dir: Annotated[Path, typer.Option(help="Where `unroll build` wrote TensorRT plans (gpu)")] = Path("build/trt"),
    threads: Annotated[int, typer.Option(help="cpu: ONNX Runtime intra-op threads per model instance")] = 2,
    instances: Annotated[int, typer.Option(help="Model instances (parallel executions) per model")] = 1,
    max_batch_size: Annotated[int | None, typer.Option(
        help=f"Largest batch Triton's dynamic batcher forms (and the TensorRT profile's max batch); default "
             f"{DEFAULT_MAX_BATCH_SIZE}, csc-denoiser on cpu 4 (measured; see serving/repository.py)")] = None,
    queue_delay_us: Annotated[int, typer.Option(
        help="Dynamic batching max_queue_delay_microseconds (the default was measured; see "
             "serving/repository.py)")] = DEFAULT_QUEUE_DELAY_US,
    autolam: Annotated[bool, typer.Option(
        "--autolam/--no-autolam", help="Also serve NAME-autolam for classifiers with a fitted λ rule")] = True,
) -> None:
    """Write a Triton model repository (config.pbtxt, version 1, labels) for the exported models and validate it.

    Builds missing ONNX exports first. Every written config is re-parsed with Triton's
    model_config schema and checked tensor by tensor against its ONNX graph.
    """
    if target not in ("cpu", "gpu"):
        raise _fail(f"--target must be cpu or gpu, not {target!r}")
    if precision not in PRECISIONS:
        raise _fail(f"--precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    names = [m.strip() for m in models.split(",") if m.strip()]
    if not names:
        raise _fail("--models names no model")
    served = _ensure_exports(names, onnx_dir, autolam)
    try:
        written = write_repository(target, served, out, precision=precision, onnx_dir=onnx_dir, plan_dir=plan_dir,
                                   threads=threads, max_batch_size=max_batch_size, queue_delay_us=queue_delay_us,
                                   instances=instances)
    except RepositoryError as e:
        raise _fail(str(e)) from None
    table = Table("model", "runs as", "inputs", "outputs", "files", title=f"{out} (target {target}, {precision})")
    for name in served:
        try:
            cfg = validate_model(out / name, reference_onnx=_reference_onnx(out / name, onnx_dir))
        except RepositoryError as e:
            raise _fail(str(e)) from None
        runs = cfg.backend + " (ONNX Runtime CPU)" if cfg.backend == "python" else cfg.platform
        ins = ", ".join(f"{i.name}{list(i.dims)}{' (optional)' if i.optional else ''}" for i in cfg.input)
        outs = ", ".join(f"{o.name}{list(o.dims)}" + (" +labels" if o.label_filename else "") for o in cfg.output)
        files = ", ".join(str(p.relative_to(out / name)) for p in written if p.is_relative_to(out / name))
        table.add_row(name, runs, ins, outs, files)
    console.print(table)
    others = sorted(p.name for p in Path(out).iterdir() if p.is_dir() and not p.name.startswith(".")
                    and p.name not in served)
    if others:
        console.print(f"[yellow]note:[/] {out} also holds {', '.join(others)} (not rewritten; Triton serves them too)")
    console.print(f"[green]✓[/] {len(served)} models written and validated against their ONNX graphs. "
                  + (f"Serve them with `unroll triton --repo {out}`." if target == "cpu" else
                     f"Serve them in the NGC container: docker run --gpus all --rm -p 8000-8002:8000-8002 "
                     f"-v {Path(out).resolve()}:/models nvcr.io/nvidia/tritonserver:<yy.mm>-py3 tritonserver "
                     f"--model-repository=/models"))


def _reference_onnx(model_dir: Path, onnx_dir: Path) -> Path | None:
    """The graph to check a model against: its own model.onnx, else (a plan) the export it was built from."""
    if any((v / "model.onnx").exists() for v in model_dir.iterdir() if v.is_dir()):
        return None
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    cfg = text_format.Parse((model_dir / "config.pbtxt").read_text(), mc.ModelConfig())
    return onnx_dir / cfg.parameters["unroll_source_onnx"].string_value


def triton(
    repo: Annotated[Path, typer.Option(help="Model repository to serve (write it with `unroll repo`)")]
        = Path("model_repository"),
    http_port: Annotated[int, typer.Option(help="HTTP/REST port (KServe v2 protocol)")] = 8000,
    grpc_port: Annotated[int, typer.Option(help="gRPC port")] = 8001,
    metrics_port: Annotated[int, typer.Option(help="Prometheus metrics port")] = 8002,
    host: Annotated[str, typer.Option(help="Address to bind; 127.0.0.1 keeps Triton local (0.0.0.0 exposes it)")]
        = "127.0.0.1",
    log_file: Annotated[Path, typer.Option(help="Triton's log file")] = DEFAULT_LOG,
    timeout_s: Annotated[float, typer.Option(help="Seconds to wait for every model to load and warm up")] = 120,
) -> None:
    """Start the Triton Inference Server bundled with nvidia-pytriton on a model repository; Ctrl-C stops it.

    Waits until every model is loaded and warm (/v2/health/ready), prints the endpoints, and stops
    the server cleanly on SIGINT/SIGTERM.
    """
    from unroll.serving.repository import validate_repository
    from unroll.serving.triton import TritonStartError, start

    try:  # a clear message for a half-built repository (fresh clone: configs only) before Triton says it
        validate_repository(repo, onnx_dir=Path("build/onnx"))
    except RepositoryError as e:
        raise _fail(str(e).replace("\n", " ")) from None
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with console.status(f"starting Triton on {repo} (loading and warming up models)…"):
            try:
                handle = start(repo, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port, host=host,
                               log_file=log_file, timeout_s=timeout_s)
            except TritonStartError as e:
                where = f" (full log: {e.log_path})" if e.log_path else ""
                raise _fail(e.reason.replace("\n", "; ") + where) from None
        with handle:
            console.print(f"[green]✓[/] Triton ready (pid {handle.pid}) — models from {repo}")
            console.print(f"  HTTP     http://{handle.url}   (try: curl {handle.url}/v2/models/stats)")
            console.print(f"  gRPC     {handle.grpc_url}")
            console.print(f"  metrics  {handle.metrics_url}")
            console.print(f"  log      {handle.log_path}")
            console.print("Press Ctrl-C to stop.")
            while not stop.wait(0.5):
                if not handle.is_alive():
                    raise _fail(f"tritonserver exited unexpectedly (code {handle.wait()}); see {handle.log_path}")
            console.print("stopping Triton…")
            code = handle.stop()
        if code == 0:
            console.print("[green]✓[/] Triton stopped")
        else:
            err.print(f"[yellow]Triton did not shut down cleanly (exit code {code}); see {handle.log_path}[/]")
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
