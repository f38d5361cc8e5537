"""``unroll serve``: build what is missing, start Triton and the REST gateway, stop both cleanly.

Serves ``--models`` (default: the registered models with committed weights) and the companion graphs their cards
name: brings their graphs and the Triton repository up to date, starts the bundled tritonserver under a
:class:`~unroll.serving.supervisor.TritonSupervisor` (or uses ``--triton-url``), loading exactly those models and
locked with a key only the gateway gets, writes a sample input per model to ``build/samples``, and runs the gateway
(``--workers`` processes on one port). Ctrl-C or SIGTERM stops the gateway gracefully, then Triton.

A warm standby, a second tritonserver on the same repository and models (other ports, a supervisor of its own), is
the default where the machine's memory allows it: when the server the gateway uses loses a backend process or dies,
the gateway's calls go to the other at once instead of waiting for a restart (a single server is replaced whole and
reloads every model: seconds of 503s), at the cost of a second copy of every model in memory. ``--standby`` always
runs one, ``--no-standby`` never; by default (``UNROLL_STANDBY=auto``) :func:`unroll.serving.standby.decide` chooses
once the first server is ready (on when the memory available is at least twice what that server holds), and not
with ``--triton-url`` (your Triton), with ``--target gpu`` (the copy would sit in GPU memory) or when the default
standby ports are taken. One printed line says which was chosen and why.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any

import typer

from unroll import artifacts, pipeline, tasks
from unroll.app.errors import handles_errors
from unroll.card import CardError, ModelCard, from_onnx
from unroll.data import dataset
from unroll.errors import ExportError, ServeError, UnrollError
from unroll.pipeline import choice, graphs_of
from unroll.registry import get_spec, list_models
from unroll.serving import standby as standby_rule
from unroll.serving import torch_runtime
from unroll.serving.gateway import Settings, create_app
from unroll.serving.gateway.http_settings import ACCESS_LOG_ENV
from unroll.serving.gateway.server import uvicorn_options
from unroll.serving.gateway.triton_client import TRITON_API_KEY_ENV
from unroll.serving.gateway.workers import Stopper, check_workers, default_workers, run_workers
from unroll.serving.running import ServeState, remove_state
from unroll.serving.supervisor import TritonSupervisor
from unroll.serving.tracing_env import triton_trace_args
from unroll.serving.triton import new_api_key, start
from unroll.tasks import denoising

if TYPE_CHECKING:
    import numpy as np

    from unroll.serving.triton import TritonHandle

#: Noise level (0–255 scale) of the denoising samples in the printed ``curl`` lines (the denoising task's).
SAMPLE_SIGMA = denoising.SAMPLE_SIGMA
#: What runs the models of `unroll serve --target gpu` on the bundled Triton (its only backend is Python).
GPU_RUNTIME = "torch"


def _say(msg: str) -> None:
    print(msg, flush=True)


def default_models() -> list[str]:
    """Every registered model with committed weights (the ones whose answers mean something) that its registration
    does not keep for serving by name only (``served_by_default``)."""
    return [n for n in list_models() if get_spec(n).has_weights and get_spec(n).served_by_default]


def triton_load_args(graphs: list[str]) -> tuple[str, list[str]]:
    """Triton's model-control mode and flags that load exactly ``graphs`` at start and nothing else.

    ``model_repository/`` keeps every model ever written to it; with ``--model-control-mode=none`` Triton would
    load them all. ``explicit`` with one ``--load-model`` per graph loads only these (the others are listed in
    its repository index without a state). The load/unload API this mode opens is behind the run's key.
    """
    if not graphs:
        raise ServeError("no model to serve")
    return "explicit", [f"--load-model={g}" for g in graphs]


def serve_plan(models: list[str], onnx_dir: Path, repo: Path, target: str = "cpu",
               rebuild: bool = False) -> list[pipeline.Step]:
    """What ``unroll serve`` brings up to date before it starts Triton: the models' graphs and their directories
    in ``repo`` (default repository options), as :mod:`unroll.pipeline` plans them (the plan ``unroll repo``
    makes for the same models and options)."""
    gpu = target == "gpu"  # the bundled Triton on a GPU: the torch runtime, whatever `unroll optimize` chose
    options = pipeline.RepoOptions(target=target, runtime=GPU_RUNTIME if gpu else None, optimized=not gpu)
    return pipeline.plan(models, onnx_dir=onnx_dir, repo=repo, options=options, force=rebuild)


def _first_sample(card: ModelCard) -> tuple[np.ndarray, int | None] | None:
    """The first sample of the card's test data (else validation, else training data) and its label, if any;
    ``None`` when the card names no data (the banner then shows the curl with a placeholder image)."""
    import numpy as np

    ids = [d for d in (card.data.test, card.data.validation, card.data.train) if d is not None]
    if not ids:
        return None
    loaded = dataset(ids[0]).load()
    if isinstance(loaded, dict):  # images: {name: gray [H, W]}
        return np.asarray(next(iter(loaded.values())))[None], None
    x, y = loaded
    return np.asarray(x[0]), (int(y[0]) if y is not None else None)


def _to_png(image: np.ndarray, card: ModelCard, path: Path) -> None:
    """Save a ``[C, H, W]`` float image in [0, 1] as PNG in the card's colour (and size, for a fixed input)."""
    import numpy as np
    from PIL import Image

    rgb = card.input.colour == "rgb"
    a = np.rint(np.clip(image, 0, 1) * 255).astype(np.uint8)
    if rgb and a.shape[0] == 1:
        a = np.repeat(a, 3, axis=0)
    img = Image.fromarray(a.transpose(1, 2, 0) if rgb else a.mean(axis=0).astype(np.uint8))
    if card.input.fixed_hw is not None and img.size != card.input.fixed_hw[::-1]:
        img = img.resize(card.input.fixed_hw[::-1], Image.Resampling.LANCZOS)
    img.save(path)


def write_samples(out: Path, cards: list[ModelCard]) -> dict[str, Path]:
    """One sample input per gateway model, for the printed ``curl`` lines: the first sample of the card's test data,
    at the card's input size and colour, as its task makes it (``Task.sample``: a classifier's label beside it in
    ``NAME.label.txt``, a denoiser's image with seeded noise at σ = :data:`SAMPLE_SIGMA`).
    """
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for card in cards:
        if tasks.get(card.task).route is None:
            continue
        sample = _first_sample(card)
        if sample is None:
            continue
        image, label = sample
        path = artifacts.sample(card.name, ".png", out)
        image = tasks.get(card.task).sample(card, image, label, out)
        _to_png(image, card, path)
        paths[card.name] = path
    return paths


def _check_port_free(host: str, port: int, what: str) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ServeError(f"{what} port {host}:{port} is not free ({e.strerror}); pick another with the "
                             "matching --…-port option (a standby's: --standby-ports)") from None


def served_as(cards: list[ModelCard], target: str) -> dict[str, str]:
    """Per served model: ``unroll optimize``'s choice with the precision and what it loses on the gate data, or
    the exported FP32 graph on the card's CPU runtime when nothing was chosen; on a GPU (the bundled Triton), the
    PyTorch module on the GPU, or why a model runs on the CPU instead."""
    if target == "gpu":
        return {c.name: "torch on the GPU: its PyTorch module, fp32, a CUDA graph per input shape"
                if (why := torch_runtime.why_not(c)) is None else f"{c.cpu_runtime} on the CPU, fp32: {why}"
                for c in cards}
    return {c.name: choice.served_as(c.name, target) or f"{c.cpu_runtime}, fp32 graph as exported (no "
            "`unroll optimize` choice)" for c in cards}


def check_cuda() -> None:
    """``--target gpu`` with the bundled Triton needs a CUDA device PyTorch can use; say what is missing."""
    import torch

    if not torch.cuda.is_available():
        built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ServeError(f"--target gpu: PyTorch sees no CUDA device here (torch {torch.__version__}, {built}); "
                         "the bundled Triton runs each model's PyTorch module on the GPU. `unroll doctor` says what "
                         "this machine has; for NVIDIA's container run `unroll repo --target gpu` there and pass "
                         "--triton-url")


def banner(base: str, cards: list[ModelCard], samples: dict[str, Path], api_key: bool, triton: str,
           served_as: dict[str, str] | None = None) -> str:
    """URLs and one ``curl`` per served model (by its card's task, with its sample file), as printed once ready;
    ``served_as``: how each model runs and at which precision, with what that precision loses (:func:`served_as`).

    The lines work when pasted into a shell anywhere: the key is ``"$UNROLL_API_KEY"`` in double quotes (so the
    shell expands it) and sample paths are absolute (quoted when they need it).
    """
    auth = ' -H "X-API-Key: $UNROLL_API_KEY"' if api_key else ""
    tries = []
    for card in cards:
        sample = samples.get(card.name)
        sample = Path(sample).resolve() if sample is not None else Path("your-image.png")
        tries += tasks.get(card.task).banner(base, card, sample, auth)
    triton_only = [c.name for c in cards if tasks.get(c.task).route is None and c.companion_of is None]
    return "\n".join([
        "",
        f"unroll gateway ready: {base}   (Triton: {triton})",
        f"  API docs     {base}/docs",
        "",
        "try:",
        *tries,
        f"  curl{auth} {base}/v1/models",
        *(f"  curl {base}/{path}" for path in ("healthz", "readyz", "metrics")),
        *([f"  (served by Triton only, no gateway route: {', '.join(triton_only)})"] if triton_only else []),
        *(["", "served as:", *(f"  {n}: {how}" for n, how in served_as.items())] if served_as else []),
        "",
        "Ctrl-C stops the gateway and Triton.",
        "",
    ])


def resolve_models(models: list[str] | None, onnx_dir: Path | None = None) -> list[str]:
    """The models to serve: ``models`` (registered names, or graphs in ``onnx_dir`` that carry a card), else
    :func:`default_models`."""
    if models is None:
        chosen = default_models()
        if not chosen:
            raise ServeError("no registered model has committed weights; name the models to serve with --models")
        return chosen
    chosen = list(dict.fromkeys(m.strip() for m in models if m.strip()))
    unknown = []
    for m in chosen:
        if m in list_models():
            continue
        path = artifacts.graph(m, onnx_dir=onnx_dir) if onnx_dir is not None else None
        try:
            if path is None or not path.exists():
                raise CardError("not exported")
            from_onnx(path)
        except CardError as e:
            unknown.append(f"{m} ({e})" if path is not None and path.exists() else m)
    if not chosen or unknown:
        where = f" or exported with a card in {onnx_dir}" if onnx_dir is not None else ""
        raise ServeError(f"--models: unknown model(s) {', '.join(unknown) or '(none named)'}; registered models: "
                         f"{', '.join(list_models())}{where} (`unroll export --model …`, `unroll fuse --card …`)")
    return chosen


def served_cards(models: list[str], onnx_dir: Path | None) -> list[ModelCard]:
    """The cards of the served models: from their exported graphs, or (Triton elsewhere) from the registry."""
    if onnx_dir is None:
        return [get_spec(m).card for m in models]
    return [from_onnx(artifacts.graph(m, onnx_dir=onnx_dir)) for m in models]  # what is served, whoever registered it


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _log_supervisor() -> None:
    """Show the supervisor's messages (restarts, clean-ups) on stderr like the gateway's own log lines."""
    logger = logging.getLogger("unroll.serve")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     triton supervisor: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def serve(host: str = "127.0.0.1", port: int = 8080, target: str = "cpu", triton_http_port: int = 8000,
          triton_grpc_port: int = 8001, triton_metrics_port: int = 8002, triton_url: str | None = None,
          triton_protocol: str = "grpc", api_key: str | None = None, repo: Path = artifacts.REPOSITORY_DIR,
          onnx_dir: Path = artifacts.ONNX_DIR, samples_dir: Path = artifacts.SAMPLES_DIR, rebuild: bool = False,
          log_level: str = "info", on_ready: Callable[[str], None] | None = None,
          models: list[str] | None = None, workers: int | None = None, access_log: bool = False,
          standby: bool | None = None, standby_ports: tuple[int, int, int] | None = None,
          slo: str | None = None) -> None:
    """Build what is missing, start Triton (unless ``triton_url``) and the gateway; block until Ctrl-C/SIGTERM.

    ``workers``: gateway processes behind ``port`` (default ``UNROLL_WORKERS``, else half the cores, 1 to 4;
    see :mod:`unroll.serving.gateway.workers`).

    ``models`` are registry names (default :func:`default_models`); their companions are served too.

    Gateway limits (body size, pixels, concurrency, timeouts) come from ``UNROLL_*`` variables
    (see :class:`unroll.serving.gateway.settings.Settings`); ``api_key`` defaults to ``UNROLL_API_KEY``.
    ``access_log``: one JSON line per request (else as ``UNROLL_ACCESS_LOG`` says, off by default).
    ``standby``: a warm standby tritonserver, ``True`` always, ``False`` never, ``None`` as the memory allows (module
    doc); ``standby_ports``: its HTTP, gRPC and metrics ports (default: Triton's + 100).
    ``slo``: the objective held with fewer solver iterations (``UNROLL_SLO``; :mod:`unroll.serving.gateway.anytime`).
    """
    if target not in ("cpu", "gpu"):
        raise ServeError(f"--target must be cpu or gpu, not {target!r}")
    Settings.from_env(slo=slo)  # a bad objective (or UNROLL_* value) stops here, before anything is built
    if triton_url is not None and standby:
        raise ServeError("--standby runs a second bundled tritonserver; with --triton-url list both of your Tritons "
                         "instead (comma-separated)")
    if triton_url is not None and standby is None:
        _say("standby: none (auto): --triton-url names your Triton, and `unroll serve` starts no tritonserver of its "
             "own; for a standby, list two of your Tritons in --triton-url (comma-separated)")
    if triton_url is None and target == "gpu":
        check_cuda()
    models = resolve_models(models, None if triton_url else onnx_dir)
    workers = check_workers(workers) if workers is not None else default_workers()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # finally-blocks run on SIGTERM during set-up
    run = _Run()
    try:
        _check_port_free(host, port, "gateway")
        if triton_url is None:
            ports = (triton_http_port, triton_grpc_port, triton_metrics_port)
            url = _start_triton(run, models, onnx_dir, repo, target, rebuild, ports, triton_protocol, standby,
                                standby_ports)
        else:
            url = triton_url
        cards = served_cards(models, None if triton_url else onnx_dir)
        samples = write_samples(samples_dir, cards)
        settings = Settings.from_env(triton_url=url, triton_protocol=triton_protocol, api_key=api_key, slo=slo)
        shown = "0.0.0.0" if host in ("0.0.0.0", "::") else host
        base = f"http://{'127.0.0.1' if shown == '0.0.0.0' else shown}:{port}"
        text = banner(base, cards, samples, settings.api_key is not None, f"{triton_protocol}://{url}",
                      served_as(cards, target) if triton_url is None else None)

        def announce() -> None:  # once the gateway listens
            _say(text)
            if on_ready is not None:
                on_ready(base)

        started = _run_gateway(run, settings, host, port, workers, log_level, announce, access_log)
        if run.gave_up:
            raise ServeError(f"{run.gave_up[0]}; its log: {(onnx_dir.parent / artifacts.TRITON_LOG.name).resolve()}")
        if not started:
            raise ServeError(f"the gateway could not start on {host}:{port} (see the log above)")
    except KeyboardInterrupt:
        _say("stopping")
    finally:
        if run.state is not None:
            remove_state(run.state)
        for supervisor in run.supervisors:
            supervisor.stop()
            _say(f"{supervisor.name} stopped")
        signal.signal(signal.SIGTERM, previous)


@dataclass
class _Run:
    """What :func:`serve` started, shared with the supervisor's give-up callback that must stop the gateway."""

    #: One per tritonserver (two with ``--standby``).
    supervisors: list[TritonSupervisor] = field(default_factory=list)
    server: Any = None  # the one-process uvicorn.Server, or the Stopper of the worker processes
    gave_up: list[str] = field(default_factory=list)
    #: The file that tells `unroll deploy` where this run's Triton is (written once Triton is up).
    state: Path | None = None

    def give_up(self, why: str) -> None:
        """Triton failed for good: remember why and stop the gateway (or keep it from starting)."""
        self.gave_up.append(why)
        if isinstance(self.server, Stopper):
            self.server.stop()
        elif self.server is not None:
            self.server.should_exit = True


def write_key_file(path: Path, key: str) -> None:
    """``key`` in ``path``, readable by its owner only (created so: never world-readable, even for a moment)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")


def _ports_taken(ports: tuple[int, int, int], name: str) -> str | None:
    """Why one of a server's three ports cannot be bound here (the first that fails), or ``None`` when all are free."""
    for p, what in zip(ports, ("HTTP", "gRPC", "metrics"), strict=True):
        try:
            _check_port_free("127.0.0.1", p, f"{name} {what}")
        except ServeError as e:
            return str(e).split(";")[0]
    return None


def standby_before_start(standby: bool | None, target: str, spare: tuple[int, int, int],
                         ports_given: bool) -> tuple[bool | None, str | None]:
    """What can be settled about the standby before any server starts: ``(True, line)`` (run one) or ``(False,
    line)`` (none), with the line to print, or ``(None, None)`` (auto: decided by memory once the first server is
    ready). Explicit ``--standby``, or auto with ``--standby-ports`` given, on a taken port raises
    :class:`ServeError`."""
    if standby is False:
        return False, (f"standby: off (--no-standby or {standby_rule.STANDBY_ENV}=0): a lost backend process or a dead "
                       "tritonserver costs 503s while the server is replaced and reloads every model")
    if standby is None and target == "gpu":
        return False, ("standby: off (auto): --target gpu, where a second copy of every model would sit in GPU "
                       "memory; --standby to run one anyway")
    taken = _ports_taken(spare, "standby tritonserver")
    if taken is not None and (standby or ports_given):
        raise ServeError(f"{taken}; pick free ones with --standby-ports HTTP,GRPC,METRICS (or --no-standby)")
    if taken is not None:
        return False, (f"standby: off (auto): {taken} (the default, Triton's ports + 100); --standby-ports "
                       "HTTP,GRPC,METRICS to put it elsewhere")
    if standby:
        return True, (f"standby: on (--standby or {standby_rule.STANDBY_ENV}=1): a second, warm tritonserver on "
                      f"127.0.0.1:{spare[0]} takes the calls when the first fails (about as much memory again)")
    return None, None


def _start_triton(run: _Run, models: list[str], onnx_dir: Path, repo: Path, target: str, rebuild: bool,
                  ports: tuple[int, int, int], protocol: str, standby: bool | None = False,
                  standby_ports: tuple[int, int, int] | None = None) -> str:
    """Bring the graphs and the repository up to date, then start the bundled tritonserver under a supervisor
    (locked with a fresh key that only the gateway gets), and its warm standby on ``standby_ports`` (default
    Triton's + 100) as ``standby`` says (:func:`standby_before_start`, then :func:`unroll.serving.standby.decide`);
    the gRPC or HTTP address of each, comma-separated (the gateway's ``triton_url``)."""
    for p, what in zip(ports, ("HTTP", "gRPC", "metrics"), strict=True):
        _check_port_free("127.0.0.1", p, f"tritonserver {what}")
    spare = standby_ports or (ports[0] + 100, ports[1] + 100, ports[2] + 100)
    standby, said = standby_before_start(standby, target, spare, standby_ports is not None)
    if said is not None:
        _say(said)
    onnx_dir.mkdir(parents=True, exist_ok=True)
    try:
        pipeline.run(serve_plan(models, onnx_dir, repo, target, rebuild), _say)
    except ExportError as e:
        raise ServeError(str(e)) from None
    graphs = graphs_of(models, onnx_dir)
    control, load_args = triton_load_args(graphs)
    triton_key = new_api_key()  # this run's: Triton's APIs but health need it; only the gateway has it
    os.environ[TRITON_API_KEY_ENV] = triton_key
    write_key_file(onnx_dir.parent / artifacts.TRITON_KEY.name, triton_key)  # and the operator, for `unroll deploy`
    _log_supervisor()

    def supervised(name: str, server_ports: tuple[int, int, int], log_name: Path, role: str = "") -> TritonHandle:
        http_port, grpc_port, metrics_port = server_ports
        log_file = (onnx_dir.parent / log_name.name).resolve()
        _say(f"start {name}{role} on 127.0.0.1:{http_port} (log: {log_file}, rotated at each start)")

        def launch() -> TritonHandle:
            return start(repo, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                         host="127.0.0.1", log_file=log_file, api_key=triton_key, any_thread=True,
                         model_control=control, extra_args=[*load_args, *triton_trace_args()])  # OTEL_*: Triton's too

        supervisor = TritonSupervisor(launch, on_give_up=run.give_up, name=name)
        run.supervisors.append(supervisor)
        return supervisor.start()

    handles = [supervised("tritonserver A" if standby else "tritonserver", ports, artifacts.TRITON_LOG)]
    if standby is None:  # auto: the memory rule, now that the first server holds its models
        decision = standby_rule.decide(standby_rule.resident_mb(handles[0].pid), *standby_rule.available_mb())
        taken = _ports_taken(spare, "standby tritonserver") if decision.on else None
        standby = decision.on and taken is None
        how = (f"a second, warm tritonserver on 127.0.0.1:{spare[0]} takes the calls when this one fails (about as "
               f"much memory again; --no-standby or {standby_rule.STANDBY_ENV}=0 turns it off)" if standby else
               f"{taken} since the first server started" if taken else
               "without one a lost backend process or a dead tritonserver costs 503s while the server is replaced "
               "(--standby to run one anyway)")
        _say(f"standby: {'on' if standby else 'off'} (auto): {decision.why}; {how}")
        if standby:
            run.supervisors[0].name = "tritonserver A"
    if standby:
        handles.append(supervised("tritonserver B", spare, artifacts.TRITON_STANDBY_LOG, ", the warm standby,"))
    if handles[0].key_exposed:
        _say(f"warning: Triton's key is on its command line, readable by every local user ({handles[0].key_exposed}); "
             "install a C compiler, or run the service in its own container or with /proc mounted hidepid=2")
    run.state = onnx_dir.parent / artifacts.SERVE_STATE.name  # where `unroll deploy` finds this Triton
    first = handles[0]
    ServeState(os.getpid(), first.url, first.grpc_url, f"127.0.0.1:{first.metrics_port}", str(repo.resolve()),
               standby_http=handles[1].url if len(handles) > 1 else None).write(run.state)
    return ",".join(h.url if protocol == "http" else h.grpc_url for h in handles)


def _run_gateway(run: _Run, settings: Settings, host: str, port: int, workers: int, log_level: str,
                 announce: Callable[[], None], access_log: bool = False) -> bool:
    """Run the gateway (one uvicorn process, or ``workers`` processes on one port) until it stops; whether it
    started. ``announce`` runs once it listens; ``access_log`` turns on one JSON line per request."""
    import uvicorn

    if access_log:
        os.environ[ACCESS_LOG_ENV] = "1"  # the workers read it too
    if workers > 1:
        os.environ.update(settings.env())  # the workers build their app from the UNROLL_* variables
        stopper = Stopper()
        run.server = stopper
        if run.gave_up:  # Triton failed again while the gateway was being set up
            raise ServeError(run.gave_up[0])
        return run_workers(host, port, workers, log_level, on_ready=announce, stopper=stopper,
                           timeout_graceful_shutdown=10)

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                announce()

    server = _Server(uvicorn.Config(create_app(settings), host=host, port=port, timeout_graceful_shutdown=10,
                                    **uvicorn_options(log_level=log_level)))
    run.server = server
    if run.gave_up:  # Triton failed again while the gateway was being set up
        raise ServeError(run.gave_up[0])
    server.run()
    return server.started


def standby_mode(env: dict[str, str] | None = None) -> bool | None:
    """The standby mode when neither ``--standby`` nor ``--no-standby`` is given: ``UNROLL_STANDBY`` (``auto`` when
    unset) as :func:`unroll.serving.standby.parse_mode` reads it; a bad value is a :class:`ServeError`."""
    value = (os.environ if env is None else env).get(standby_rule.STANDBY_ENV, "auto")
    try:
        return standby_rule.parse_mode(value)
    except ValueError as e:
        raise ServeError(str(e)) from None


def parse_standby_ports(given: str | None, triton_ports: tuple[int, int, int]) -> tuple[int, int, int]:
    """``--standby-ports HTTP,GRPC,METRICS``, or the Triton ports + 100 when not given."""
    if given is None:
        return triton_ports[0] + 100, triton_ports[1] + 100, triton_ports[2] + 100
    parts = [p.strip() for p in given.split(",")]
    if len(parts) != 3 or not all(p.isascii() and p.isdigit() and 0 < int(p) < 65536 for p in parts):
        raise ServeError(f"--standby-ports takes three ports, HTTP,GRPC,METRICS (e.g. 8100,8101,8102), not {given!r}")
    ports = (int(parts[0]), int(parts[1]), int(parts[2]))
    if set(ports) & set(triton_ports):
        raise ServeError(f"--standby-ports {given} share a port with Triton's own ({triton_ports}); choose others")
    return ports


@handles_errors
def serve_command(
    models: Annotated[str | None, typer.Option(
        envvar="UNROLL_MODELS", show_envvar=True,
        help="Comma-separated models to serve: registered names (see `unroll models`) or graphs exported into "
             "--onnx-dir with a card (`unroll export --model`, `unroll fuse --card`), each with the companion "
             "graphs its card names; default: every registered model with committed weights")] = None,
    host: Annotated[str, typer.Option(help="Gateway address (0.0.0.0 to expose it; Triton stays on 127.0.0.1)")]
    = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Gateway port")] = 8080,
    target: Annotated[str, typer.Option(
        help="cpu: every model on the CPU with its card's runtime; gpu (a CUDA machine): the bundled Triton runs each "
             "model's PyTorch module on the GPU (the torch runtime, `unroll repo --target gpu --runtime torch`; a "
             "model without one stays on the CPU, and the banner says so). With --triton-url: your Triton, e.g. "
             "NVIDIA's container serving `unroll repo --target gpu`")] = "cpu",
    triton_http_port: Annotated[int, typer.Option(help="Triton HTTP port")] = 8000,
    triton_grpc_port: Annotated[int, typer.Option(help="Triton gRPC port")] = 8001,
    triton_metrics_port: Annotated[int, typer.Option(help="Triton metrics port")] = 8002,
    triton_url: Annotated[str | None, typer.Option(help="Use a Triton already running at HOST:PORT (its gRPC "
                                                        "port, or HTTP with --triton-protocol http)")] = None,
    triton_protocol: Annotated[str, typer.Option(help="How the gateway talks to Triton: grpc (faster here) or "
                                                      "http")] = "grpc",
    api_key: Annotated[str | None, typer.Option(envvar="UNROLL_API_KEY", show_envvar=True,
                                                help="Require this key on /v1/* (X-API-Key or Bearer)")] = None,
    repo: Annotated[Path, typer.Option(help="Triton model repository")] = artifacts.REPOSITORY_DIR,
    onnx_dir: Annotated[Path, typer.Option(help="ONNX exports")] = artifacts.ONNX_DIR,
    rebuild: Annotated[bool, typer.Option("--rebuild", help="Re-export and rewrite the repository even if up to "
                                                            "date")] = False,
    log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "info",
    workers: Annotated[int | None, typer.Option(
        envvar="UNROLL_WORKERS", show_envvar=True, min=1, metavar="N",
        help="Gateway worker processes behind the one port (metrics add up across them); default: half the "
             "cores, 1 to 4 (Triton's models take the rest)")] = None,
    access_log: Annotated[bool, typer.Option(
        "--access-log", envvar=ACCESS_LOG_ENV, show_envvar=True,
        help="One JSON line per request on stdout (method, path, status, ms, client, bytes); default: off")] = False,
    standby: Annotated[bool | None, typer.Option(
        "--standby/--no-standby", show_default=False,
        help="A second tritonserver, warm, on --standby-ports: when the one in use loses a model's backend process or "
             "dies, requests go to the other at once instead of waiting for its restart (twice the models' memory). "
             "Default: auto (env UNROLL_STANDBY=auto|1|0): on when, with the first server ready, the memory "
             "available is at least twice what it holds; off with --triton-url, with --target gpu, or when the "
             "default standby ports are taken; one line says which and why")] = None,
    standby_ports: Annotated[str | None, typer.Option(
        metavar="PORTS",
        help="The standby's three ports, HTTP,GRPC,METRICS (e.g. 8100,8101,8102); default: the Triton ports "
             "+ 100")] = None,
    slo: Annotated[str | None, typer.Option(
        envvar="UNROLL_SLO", show_envvar=True, metavar="OBJECTIVE",
        help="Hold a latency objective with fewer solver iterations, e.g. 'p99<=50ms': for models whose card "
             "serves several iteration counts, a request that pins no iters gets the largest count predicted to "
             "answer within the bound, given what is in flight ahead of it; the trained count again as load "
             "falls. Every answer says its count (X-Iters, X-Iters-Set-By). Default: none, the trained count "
             "always")] = None,
) -> None:
    """Build what is missing, start Triton and the REST gateway, print a curl per endpoint; Ctrl-C stops both."""
    try:
        serve(host=host, port=port, target=target, triton_http_port=triton_http_port,
              triton_grpc_port=triton_grpc_port, triton_metrics_port=triton_metrics_port, triton_url=triton_url,
              triton_protocol=triton_protocol, api_key=api_key, repo=repo, onnx_dir=onnx_dir, rebuild=rebuild,
              log_level=log_level, models=models.split(",") if models is not None else None, workers=workers,
              access_log=access_log, standby=standby if standby is not None else standby_mode(),
              standby_ports=None if standby_ports is None else parse_standby_ports(
                  standby_ports, (triton_http_port, triton_grpc_port, triton_metrics_port)), slo=slo)
    except UnrollError:
        raise
    except ValueError as e:  # a set-up value the steps reject (ports, settings): still one line, exit 1
        raise ServeError(str(e)) from None


if __name__ == "__main__":  # python -m unroll.app.serve [options]
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    typer.run(serve_command)
