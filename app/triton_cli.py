"""``unroll repo`` and ``unroll triton``: Typer command functions, registered on the main CLI.

Plain functions (no Typer app here) so ``app/cli.py`` can do ``app.command("repo")(repo)`` and
``app.command("triton")(triton)``. Errors print one sentence to stderr and exit 1 (no traceback).
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from unroll.serving.repository import (
    CPU_MAX_BATCH_SIZE,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_QUEUE_DELAY_US,
    INTRA_OP_SPINNING,
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


def _ensure_exports(names: list[str], onnx_dir: Path, autolam: bool) -> list[str]:
    """Export whatever ONNX is missing; returns the Triton model names, each followed by its companions.

    A name is a registered model or an already exported graph (``onnx_dir/NAME.onnx``). Companions are
    the graphs a card names (its λ rule, ``card.lam.auto``), served unless ``autolam`` is off. Nothing
    heavy (torch) is imported when every export is already there.
    """
    from unroll.card import CardError, from_onnx

    served: list[str] = []
    with Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), TimeElapsedColumn(), console=err,
                  transient=True) as bar:

        def export(name: str, companion_of: str | None = None) -> None:
            from unroll.export.onnx_export import ExportError, export_auto_lam, export_model

            task = bar.add_task(f"exporting {name} (not built yet)", total=None)
            try:
                if companion_of is None:
                    export_model(name, onnx_dir, naive=False)
                else:
                    export_auto_lam(companion_of, onnx_dir)
            except KeyError as e:  # unknown model name: the registry's message lists the known ones
                raise _fail(str(e.args[0])) from None
            except ExportError as e:
                raise _fail(f"exporting {name} failed: {e}") from None
            bar.remove_task(task)
            console.print(f"[green]✓[/] exported {onnx_dir / f'{name}.onnx'}")

        for name in dict.fromkeys(names):
            path = onnx_dir / f"{name}.onnx"
            if not path.exists():
                export(name)
            try:
                card = from_onnx(path)
            except CardError as e:
                from unroll.export.fuse import NO_CARD_HINT

                raise _fail(f"{e}; delete it to re-export, {NO_CARD_HINT}") from None
            served.append(name)
            companion = card.lam.auto if card.lam is not None else None
            if companion is None or not autolam:
                continue
            if not (onnx_dir / f"{companion}.onnx").exists():
                export(companion, companion_of=name)
            served.append(companion)
    return list(dict.fromkeys(served))


def repo(
    target: Annotated[str, typer.Option(
        help="cpu: Python-backend models that run the ONNX with the card's CPU runtime (ONNX Runtime or "
             "OpenVINO; what the bundled Triton serves); "
             "gpu: TensorRT plans, or ONNX Runtime with the TensorRT accelerator, for the NGC tritonserver "
             "container")] = "cpu",
    models: Annotated[str | None, typer.Option(
        help="Comma-separated model names (see `unroll models`, or graphs already in --onnx-dir); default: every "
             "model with committed weights")] = None,
    precision: Annotated[str, typer.Option(
        help="fp32, fp16 or int8: the graph that carries it, build/onnx/NAME.PRECISION.onnx from `unroll quantize` "
             "(fp32: NAME.onnx). gpu serves build/trt/NAME.PRECISION.plan when present (checked against its JSON), "
             "else that graph through ONNX Runtime's TensorRT provider, strongly typed (precision_mode FP32: "
             "TensorRT runs the graph's own precision, nothing is cast)")] = "fp32",
    out: Annotated[Path, typer.Option(help="Model repository folder to write")] = Path("model_repository"),
    onnx_dir: Annotated[Path, typer.Option(help="Where `unroll export` wrote NAME.onnx (missing ones are "
                                                "exported first)")] = Path("build/onnx"),
    plan_dir: Annotated[Path, typer.Option(help="Where `unroll build` wrote TensorRT plans (gpu)")] = Path("build/trt"),
    threads: Annotated[int, typer.Option(help="cpu: ONNX Runtime intra-op threads per model instance")] = 2,
    instances: Annotated[int, typer.Option(help="Model instances (parallel executions) per model")] = 1,
    spinning: Annotated[bool, typer.Option(
        "--spinning/--no-spinning",
        help="cpu: ONNX Runtime's threads spin briefly for the next work before sleeping: lower latency and more "
             "throughput from Triton, but less CPU left for a gateway on the same cores (measured: "
             "serving/repository.py)")] = INTRA_OP_SPINNING,
    max_batch_size: Annotated[int | None, typer.Option(
        help=f"Largest batch Triton's dynamic batcher forms (and the TensorRT profile's max batch); default: cpu "
             f"{DEFAULT_MAX_BATCH_SIZE} ({', '.join(f'{t} {n}' for t, n in CPU_MAX_BATCH_SIZE.items())}), gpu the "
             "card's TensorRT profile maximum (see serving/repository.py)")] = None,
    queue_delay_us: Annotated[int, typer.Option(
        help="Dynamic batching max_queue_delay_microseconds (why the default: serving/repository.py; measure "
             "with `unroll bench serve`)")] = DEFAULT_QUEUE_DELAY_US,
    autolam: Annotated[bool, typer.Option(
        "--autolam/--no-autolam", help="Also serve the λ-rule graph a classifier's card names (lam=auto)")] = True,
    card: Annotated[list[str] | None, typer.Option(
        help="Attach a card to a graph in --onnx-dir that has none (a third-party graph, e.g. from `unroll fuse`) "
             "or replace its card: NAME=FILE, or FILE when --models names one model; FILE is the JSON of an "
             "unroll ModelCard. Repeatable")] = None,
) -> None:
    """Write a Triton model repository (config.pbtxt, version 1, labels) for the exported models and validate it.

    Builds missing ONNX exports first. Every written config is re-parsed with Triton's
    model_config schema and checked tensor by tensor against its ONNX graph.
    """
    if target not in ("cpu", "gpu"):
        raise _fail(f"--target must be cpu or gpu, not {target!r}")
    if precision not in PRECISIONS:
        raise _fail(f"--precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if models is None:
        from unroll.app.serve import default_models

        names = default_models()
    else:
        names = [m.strip() for m in models.split(",") if m.strip()]
    if not names:
        raise _fail("--models names no model" if models is not None else
                    "no registered model has committed weights; name the models with --models")
    _attach_cards(card or [], names, onnx_dir, precision)
    served = _ensure_exports(names, onnx_dir, autolam)
    try:
        written = write_repository(target, served, out, precision=precision, onnx_dir=onnx_dir, plan_dir=plan_dir,
                                   threads=threads, max_batch_size=max_batch_size, queue_delay_us=queue_delay_us,
                                   instances=instances, spinning=spinning)
    except RepositoryError as e:
        raise _fail(str(e)) from None
    table = Table("model", "runs as", "inputs", "outputs", "files", title=f"{out} (target {target}, {precision})")
    for name in served:
        try:
            cfg = validate_model(out / name, reference_onnx=_reference_onnx(out / name, onnx_dir))
        except RepositoryError as e:
            raise _fail(str(e)) from None
        runtime = cfg.parameters["cpu_runtime"].string_value if "cpu_runtime" in cfg.parameters else "onnxruntime"
        runs = f"{cfg.backend} ({runtime}, CPU)" if cfg.backend == "python" else cfg.platform
        if cfg.platform == "onnxruntime_onnx":
            runs += f" + TensorRT, strongly typed ({cfg.parameters['unroll_source_onnx'].string_value})"
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


def _attach_cards(items: list[str], names: list[str], onnx_dir: Path, precision: str) -> None:
    """``--card NAME=FILE`` / ``--card FILE``: the card goes into NAME.onnx and NAME.PRECISION.onnx (if there)."""
    from unroll.export.fuse import attach_card_where_present

    from unroll.card import CardError

    for item in items:
        name, sep, file = item.partition("=")
        if not sep:
            if len(names) != 1:
                raise _fail(f"--card {item}: give it as NAME=FILE when --models names more than one model")
            name, file = names[0], item
        if name not in names:
            raise _fail(f"--card {item}: {name!r} is not one of the models written ({', '.join(names)})")
        paths = [onnx_dir / f"{name}.onnx", onnx_dir / f"{name}.{precision}.onnx"]
        if not paths[0].exists():
            raise _fail(f"--card {item}: {paths[0]} does not exist (put the graph there, e.g. with `unroll fuse`)")
        try:
            attach_card_where_present(paths, file, name)
        except CardError as e:
            raise _fail(str(e)) from None


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
