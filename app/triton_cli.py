"""``unroll repo`` and ``unroll triton``: Typer command functions, registered on the main CLI.

Plain functions (no Typer app here) so ``app/cli.py`` can do ``app.command("repo")(repo)`` and
``app.command("triton")(triton)``. Errors print one sentence to stderr and exit 1 (no traceback; :mod:`.errors`).
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

from unroll import artifacts, pipeline
from unroll.app.errors import fail, handles_errors
from unroll.app.serve import default_models
from unroll.card import CardError
from unroll.errors import ExportError, ServingError, TritonStartError
from unroll.export.card_attach import NO_CARD_HINT, attach_card_where_present
from unroll.pipeline import choice
from unroll.serving.repository import (
    CPU_MAX_BATCH_SIZE,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_QUEUE_DELAY_US,
    GPU_RUNTIMES,
    INTRA_OP_SPINNING,
    PRECISIONS,
    TORCH_NOTE_KEY,
    RepositoryError,
    bundled_gpu,
)
from unroll.serving.repository_check import validate_model, validate_repository
from unroll.serving.runtimes import RUNTIMES
from unroll.serving.triton import start

console = Console()
err = Console(stderr=True)
DEFAULT_LOG = artifacts.TRITON_LOG


def repo_plan(names: list[str], out: Path, onnx_dir: Path = artifacts.ONNX_DIR, plan_dir: Path = artifacts.TRT_DIR,
              options: pipeline.RepoOptions | None = None, autolam: bool = True,
              rebuild: bool = False) -> list[pipeline.Step]:
    """What ``unroll repo`` brings up to date: the models' graphs (and quantized graphs) and their directories in
    ``out``, as :mod:`unroll.pipeline` plans them (``unroll serve`` plans the same way)."""
    return pipeline.plan(names, onnx_dir=onnx_dir, repo=out, options=options, plan_dir=plan_dir, companions=autolam,
                         force=rebuild)


def _bring_up_to_date(names: list[str], out: Path, onnx_dir: Path, plan_dir: Path, options: pipeline.RepoOptions,
                      autolam: bool, rebuild: bool) -> list[str]:
    """Run what :mod:`unroll.pipeline` finds missing or stale for ``names`` (export, quantize, the repository);
    returns the Triton model names, each followed by its companions (its λ rule, unless ``autolam`` is off).

    The same plan as ``unroll serve``'s, so the two agree on what is stale. Nothing heavy (torch) is imported
    when every export is up to date.
    """
    try:
        steps = repo_plan(names, out, onnx_dir, plan_dir, options, autolam, rebuild)
        served = pipeline.graphs_of(names, onnx_dir, autolam)
    except CardError as e:  # the line says how to get a card
        raise CardError(f"{e}; delete it to re-export, {NO_CARD_HINT}") from None
    with Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), TimeElapsedColumn(), console=err,
                  transient=True) as bar:
        for step in steps:
            task = bar.add_task(str(step), total=None)
            try:
                pipeline.run([step], progress=None)
            except ExportError as e:  # the line names the model
                raise ExportError(f"exporting {step.name} failed: {e}") from None
            bar.remove_task(task)
            if step.stage != "repo":
                console.print(f"[green]✓[/] {step.stage} {step.name} ({step.reason})")
    return served


TargetOpt = Annotated[str, typer.Option(
    help="cpu: Python-backend models that run the ONNX with the card's CPU runtime (ONNX Runtime or "
         "OpenVINO; what the bundled Triton serves); "
         "gpu: TensorRT plans, or ONNX Runtime with the TensorRT accelerator, for the NGC tritonserver "
         "container")]
ModelsOpt = Annotated[str | None, typer.Option(
    help="Comma-separated model names (see `unroll models`, or graphs already in --onnx-dir); default: every "
         "model with committed weights")]
PrecisionOpt = Annotated[str, typer.Option(
    help="fp32, fp16 or int8: the graph that carries it, build/onnx/NAME.PRECISION.onnx from `unroll quantize` "
         "(fp32: NAME.onnx). gpu serves build/trt/NAME.PRECISION.plan when present (checked against its JSON), "
         "else that graph through ONNX Runtime's TensorRT provider, strongly typed (precision_mode FP32: "
         "TensorRT runs the graph's own precision, nothing is cast)")]
RepoOutOpt = Annotated[Path, typer.Option(help="Model repository folder to write")]
OnnxDirOpt = Annotated[Path, typer.Option(help="Where `unroll export` wrote NAME.onnx (missing or stale ones "
                                               "are exported first)")]
PlanDirOpt = Annotated[Path, typer.Option(help="Where `unroll build` wrote TensorRT plans (gpu)")]
ThreadsOpt = Annotated[int, typer.Option(help="cpu: ONNX Runtime intra-op threads per model instance")]
InstancesOpt = Annotated[int, typer.Option(help="Model instances (parallel executions) per model")]
SpinningOpt = Annotated[bool, typer.Option(
    "--spinning/--no-spinning",
    help="cpu: ONNX Runtime's threads spin briefly for the next work before sleeping: lower latency and more "
         "throughput from Triton, but less CPU left for a gateway on the same cores (compare both with "
         "`unroll bench serve`)")]
MaxBatchSizeOpt = Annotated[int | None, typer.Option(
    help=f"Largest batch Triton's dynamic batcher forms (and the TensorRT profile's max batch); default: cpu "
         f"{DEFAULT_MAX_BATCH_SIZE} ({', '.join(f'{t} {n}' for t, n in CPU_MAX_BATCH_SIZE.items())}), gpu the "
         "card's TensorRT profile maximum (see serving/repository.py)")]
QueueDelayOpt = Annotated[int, typer.Option(
    help="Dynamic batching max_queue_delay_microseconds (why the default: serving/repository.py; measure "
         "with `unroll bench serve`)")]
OptimizedOpt = Annotated[bool, typer.Option(
    "--optimized/--no-optimized",
    help="cpu: serve each model with the runtime, precision and configuration `unroll optimize` chose for it "
         "(build/optimize/NAME.cpu.json) where there is a choice, overriding the options above")]
AutolamOpt = Annotated[bool, typer.Option(
    "--autolam/--no-autolam", help="Also serve the λ-rule graph a classifier's card names (lam=auto)")]
CardOpt = Annotated[list[str] | None, typer.Option(
    help="Attach a card to a graph in --onnx-dir that has none (a third-party graph, e.g. from `unroll fuse`) "
         "or replace its card: NAME=FILE, or FILE when --models names one model; FILE is the JSON of an "
         "unroll ModelCard. Repeatable")]
RebuildOpt = Annotated[bool, typer.Option("--rebuild", help="Re-export and rewrite every model even if up to date")]
RuntimeOpt = Annotated[str | None, typer.Option(
    help="What runs every model, instead of each card's (and of `unroll optimize`'s choice): cpu: "
         f"{', '.join(RUNTIMES)}; gpu: torch, the bundled Triton on a CUDA machine (Python-backend instances on "
         "the GPU running each model's PyTorch module, a CUDA graph per input shape; a model without one is "
         "served on the CPU and its config says why). Default: cpu each card's, gpu the NGC container's "
         "TensorRT / ONNX Runtime configs")]


@handles_errors
def repo(
    target: TargetOpt = "cpu",
    models: ModelsOpt = None,
    precision: PrecisionOpt = "fp32",
    out: RepoOutOpt = artifacts.REPOSITORY_DIR,
    onnx_dir: OnnxDirOpt = artifacts.ONNX_DIR,
    plan_dir: PlanDirOpt = artifacts.TRT_DIR,
    threads: ThreadsOpt = 2,
    instances: InstancesOpt = 1,
    spinning: SpinningOpt = INTRA_OP_SPINNING,
    max_batch_size: MaxBatchSizeOpt = None,
    queue_delay_us: QueueDelayOpt = DEFAULT_QUEUE_DELAY_US,
    optimized: OptimizedOpt = True,
    autolam: AutolamOpt = True,
    card: CardOpt = None,
    rebuild: RebuildOpt = False,
    runtime: RuntimeOpt = None,
) -> None:
    """Write a Triton model repository (config.pbtxt, version 1, labels) for the exported models and validate it.

    Brings what is missing or stale up to date first (export, quantize, the model directories: the pipeline's
    rules, as `unroll serve`). Every config is re-parsed with Triton's model_config schema and checked tensor by
    tensor against its ONNX graph.
    """
    _check_target(target, precision)
    names = _model_names(models)
    _check_runtime(target, runtime)
    _attach_cards(card or [], names, onnx_dir, precision)
    options = pipeline.RepoOptions(target=target, precision=precision, threads=threads, max_batch_size=max_batch_size,
                                   queue_delay_us=queue_delay_us, instances=instances, spinning=spinning,
                                   runtime=runtime, optimized=optimized and runtime is None)
    served = _bring_up_to_date(names, out, onnx_dir, plan_dir, options, autolam, rebuild)
    console.print(_summary(served, out, onnx_dir, f"{out} (target {target}, {precision})", optimized))
    _print_next_step(out, served, target, runtime)


def _check_target(target: str, precision: str) -> None:
    """Refuse a ``--target`` or ``--precision`` that ``unroll repo`` does not take (one sentence)."""
    if target not in ("cpu", "gpu"):
        raise fail(f"--target must be cpu or gpu, not {target!r}")
    if precision not in PRECISIONS:
        raise fail(f"--precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")


def _check_runtime(target: str, runtime: str | None) -> None:
    """Refuse a ``--runtime`` that ``--target`` does not run (the CPU runtimes, or torch on a GPU)."""
    allowed = RUNTIMES if target == "cpu" else GPU_RUNTIMES
    if runtime is not None and runtime not in allowed:
        raise fail(f"--runtime {runtime}: --target {target} takes {', '.join(allowed)}")


def _model_names(models: str | None) -> list[str]:
    """The models ``--models`` names (comma-separated), else every model with committed weights; never none."""
    if models is None:
        names = default_models()
    else:
        names = [m.strip() for m in models.split(",") if m.strip()]
    if not names:
        raise fail("--models names no model" if models is not None else
                   "no registered model has committed weights; name the models with --models")
    return names


def _print_next_step(out: Path, served: list[str], target: str, runtime: str | None) -> None:
    """Say what else ``out`` holds (Triton serves it too) and how to serve the repository: the bundled Triton, or
    NVIDIA's container for the NGC configs."""
    others = sorted(p.name for p in Path(out).iterdir() if p.is_dir() and not p.name.startswith(".")
                    and p.name not in served)
    if others:
        console.print(f"[yellow]note:[/] {out} also holds {', '.join(others)} (not rewritten; Triton serves them too)")
    console.print(f"[green]✓[/] {len(served)} models written and validated against their ONNX graphs. "
                  + (f"Serve them with `unroll triton --repo {out}`."
                     if target == "cpu" or bundled_gpu(target, runtime) else
                     f"Serve them in the NGC container: docker run --gpus all --rm -p 8000-8002:8000-8002 "
                     f"-v {Path(out).resolve()}:/models nvcr.io/nvidia/tritonserver:<yy.mm>-py3 tritonserver "
                     f"--model-repository=/models"))


def _summary(served: list[str], out: Path, onnx_dir: Path, title: str, optimized: bool = True) -> Table:
    """One row per served model, each validated against its graph: how it runs, its tensors and its files."""
    table = Table("model", "runs as", "inputs", "outputs", "files", title=title)
    for name in served:
        cfg = validate_model(out / name, reference_onnx=_reference_onnx(out / name, onnx_dir))
        runtime = cfg.parameters["cpu_runtime"].string_value if "cpu_runtime" in cfg.parameters else "onnxruntime"
        if "static_shapes" in cfg.parameters and cfg.parameters["static_shapes"].string_value == "1":
            runtime += ", static shapes"
        device = "GPU" if cfg.instance_group[0].kind == cfg.instance_group[0].KIND_GPU else "CPU"
        runs = f"{cfg.backend} ({runtime}, {device})" if cfg.backend == "python" else cfg.platform
        if TORCH_NOTE_KEY in cfg.parameters:
            runs += f" — {cfg.parameters[TORCH_NOTE_KEY].string_value}"
        applied = choice.apply(name, pipeline.RepoOptions(optimized=optimized), onnx_dir)
        if cfg.backend == "python" and applied.source is not None:
            runs += f"; configured by `unroll optimize` ({applied.source}{'; ' + applied.note if applied.note else ''})"
        if cfg.platform == "onnxruntime_onnx":
            runs += f" + TensorRT, strongly typed ({cfg.parameters['unroll_source_onnx'].string_value})"
        ins = ", ".join(f"{i.name}{list(i.dims)}{' (optional)' if i.optional else ''}" for i in cfg.input)
        outs = ", ".join(f"{o.name}{list(o.dims)}" + (" +labels" if o.label_filename else "") for o in cfg.output)
        files = ", ".join(sorted(str(p.relative_to(out / name)) for p in (out / name).rglob("*")
                                 if p.is_file() and p.name != artifacts.REPOSITORY_SOURCE_FILE))
        table.add_row(name, runs, ins, outs, files)
    return table


def _attach_cards(items: list[str], names: list[str], onnx_dir: Path, precision: str) -> None:
    """``--card NAME=FILE`` / ``--card FILE``: the card goes into NAME.onnx and NAME.PRECISION.onnx (if there)."""
    for item in items:
        name, sep, file = item.partition("=")
        if not sep:
            if len(names) != 1:
                raise fail(f"--card {item}: give it as NAME=FILE when --models names more than one model")
            name, file = names[0], item
        if name not in names:
            raise fail(f"--card {item}: {name!r} is not one of the models written ({', '.join(names)})")
        paths = [artifacts.graph(name, onnx_dir=onnx_dir), artifacts.graph(name, precision, onnx_dir)]
        if not paths[0].exists():
            raise fail(f"--card {item}: {paths[0]} does not exist (put the graph there, e.g. with `unroll fuse`)")
        attach_card_where_present(paths, file, name)


def _reference_onnx(model_dir: Path, onnx_dir: Path) -> Path | None:
    """The graph to check a model against: its own model.onnx, else (a plan) the export it was built from."""
    if any((v / "model.onnx").exists() for v in model_dir.iterdir() if v.is_dir()):
        return None
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    cfg = text_format.Parse(artifacts.model_config(model_dir).read_text(), mc.ModelConfig())
    return onnx_dir / cfg.parameters["unroll_source_onnx"].string_value


@handles_errors
def triton(
    repo: Annotated[Path, typer.Option(help="Model repository to serve (write it with `unroll repo`)")]
        = artifacts.REPOSITORY_DIR,
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
    try:  # a clear message for a half-built repository (fresh clone: configs only) before Triton says it
        validate_repository(repo, onnx_dir=artifacts.ONNX_DIR)
    except RepositoryError as e:  # one line, however many models it names
        raise RepositoryError(str(e).replace("\n", " ")) from None
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with console.status(f"starting Triton on {repo} (loading and warming up models)…"):
            try:
                handle = start(repo, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port, host=host,
                               log_file=log_file, timeout_s=timeout_s)
            except TritonStartError as e:  # the short reason and where the log is, not the log's tail
                where = f" (full log: {e.log_path})" if e.log_path else ""
                raise ServingError(e.reason.replace("\n", "; ") + where) from None
        with handle:
            console.print(f"[green]✓[/] Triton ready (pid {handle.pid}) — models from {repo}")
            console.print(f"  HTTP     http://{handle.url}   (try: curl {handle.url}/v2/models/stats)")
            console.print(f"  gRPC     {handle.grpc_url}")
            console.print(f"  metrics  {handle.metrics_url}")
            console.print(f"  log      {handle.log_path}")
            console.print("Press Ctrl-C to stop.")
            while not stop.wait(0.5):
                if not handle.is_alive():
                    raise fail(f"tritonserver exited unexpectedly (code {handle.wait()}); see {handle.log_path}")
            console.print("stopping Triton…")
            code = handle.stop()
        if code == 0:
            console.print("[green]✓[/] Triton stopped")
        else:
            err.print(f"[yellow]Triton did not shut down cleanly (exit code {code}); see {handle.log_path}[/]")
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
