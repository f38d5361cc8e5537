"""``unroll serve``: build what is missing, start Triton and the REST gateway, stop both cleanly.

Which models: ``--models`` (registry names), by default every registered model with committed weights;
each brings the companion graphs its card names (its λ rule, ``card.lam.auto``). Steps: export a model
to ONNX when one of its graphs is missing or stale (``build/onnx``; staleness is read from each graph's
card and report, see :func:`stale_reason`), write the Triton repository when a model directory is missing,
stale or for another target (``model_repository``), start the bundled tritonserver on 127.0.0.1 (unless
``--triton-url`` points at one already running, e.g. the NGC container on a GPU server) loading exactly
those graphs (Triton's explicit model control, :func:`triton_load_args`: other models a repository holds stay
unloaded, so ``/v1/models`` and ``/readyz`` show only what was asked for), write one sample
input per served model to ``build/samples`` (chosen from its card), then run the gateway with uvicorn and
print the URLs and a ``curl`` per model. The gateway finds the models and their cards in Triton.
``--workers N`` (``UNROLL_WORKERS``; default half the cores, 1 to 4) runs N gateway processes behind the
one port, with metrics that add up across them (:mod:`unroll.serving.gateway.workers`).
Ctrl-C or SIGTERM stops the gateway gracefully (every worker), then Triton — also when they arrive during set-up.

The bundled Triton runs under a :class:`~unroll.serving.supervisor.TritonSupervisor` (restarted with
back-off when it dies or hangs, its stubs and shared memory cleaned up; ``unroll serve`` exits if it
keeps failing) and is locked down: every Triton API but health needs a key generated for this run,
which only the gateway gets (``UNROLL_TRITON_API_KEY`` in this process, see
:mod:`unroll.serving.gateway.triton_client`). Its log is ``build/triton.log``, rotated at each start.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    import numpy as np
    from unroll.serving.triton import TritonHandle

    from unroll.card import ModelCard

#: Noise level (0–255 scale) of the denoising samples in the printed ``curl`` lines.
SAMPLE_SIGMA = 25.0
#: Tasks the gateway has routes for; other served graphs (λ rules, solver blocks) are Triton-only.
GATEWAY_TASKS = ("classification", "denoising")


class ServeError(RuntimeError):
    """A set-up step cannot be done; the message says what to do instead."""


def _say(msg: str) -> None:
    print(msg, flush=True)


def default_models() -> list[str]:
    """Every registered model with committed weights (the ones whose answers mean something)."""
    from unroll.registry import get_spec, list_models

    return [n for n in list_models() if get_spec(n).has_weights]


def is_registered(name: str) -> bool:
    from unroll.registry import list_models

    return name in list_models()


def card_of(name: str, onnx_dir: Path | None = None) -> ModelCard:
    """A served model's card: the registry's, or (a model exported with ``--model``/``--checkpoint --name`` or
    fused from a third-party graph, not registered here) the one inside ``onnx_dir/NAME.onnx``."""
    from unroll.card import from_onnx
    from unroll.registry import get_spec

    if is_registered(name) or onnx_dir is None:
        return get_spec(name).card  # KeyError lists the registered names
    return from_onnx(onnx_dir / f"{name}.onnx")


def graphs_of(models: list[str], onnx_dir: Path | None = None) -> list[str]:
    """Triton model names to serve: each model, followed by the companions its card names (``lam.auto``)."""
    out: list[str] = []
    for m in models:
        card = card_of(m, onnx_dir)
        out += [m] + ([card.lam.auto] if card.lam is not None and card.lam.auto is not None else [])
    return list(dict.fromkeys(out))


def triton_load_args(graphs: list[str]) -> tuple[str, list[str]]:
    """Triton's model-control mode and flags that load exactly ``graphs`` at start and nothing else.

    ``model_repository/`` keeps every model ever written to it; with ``--model-control-mode=none`` Triton would
    load them all. ``explicit`` with one ``--load-model`` per graph loads only these (the others are listed in
    its repository index without a state). The load/unload API this mode opens is behind the run's key.
    """
    if not graphs:
        raise ServeError("no model to serve")
    return "explicit", [f"--load-model={g}" for g in graphs]


def stale_reason(graph: str, onnx_dir: Path) -> str | None:
    """Why the export ``onnx_dir/<graph>.onnx`` must be (re)built, or ``None`` when it is up to date.

    The graph's own card says which registered model it comes from (``companion_of`` for a λ rule), and
    the report whether it was exported from committed weights; both are compared with the registry.
    """
    import json

    from unroll.card import CardError, from_onnx
    from unroll.registry import get_spec

    path, report_path = onnx_dir / f"{graph}.onnx", onnx_dir / f"{graph}.report.json"
    if not path.exists() or not report_path.exists():
        return "not exported yet"
    try:
        card = from_onnx(path)
    except CardError:
        return "exported without a model card (an older export)"
    if not is_registered(card.companion_of or card.name):
        return None  # a user's graph: nothing here could rebuild it, and it carries its card
    spec = get_spec(card.companion_of or card.name)
    if spec.has_weights:
        if json.loads(report_path.read_text()).get("weights") != "committed":
            return "exported before its weights were committed"
        if spec.weights_path.stat().st_mtime > path.stat().st_mtime:
            return "weights are newer than the export"
    return None


def ensure_onnx(onnx_dir: Path, models: list[str], force: bool = False) -> list[str]:
    """Export every model one of whose graphs is missing or stale; returns the graph names written.

    The exporter (torch, onnxslim) is imported only when something must be exported, so a serving image built
    without them serves its pre-exported repository.
    """
    from unroll.registry import get_spec

    done: list[str] = []
    for m in models:
        if not is_registered(m):
            continue  # an exported graph with its card (checked by resolve_models): served as it is
        reasons = {g: "--rebuild" if force else stale_reason(g, onnx_dir) for g in graphs_of([m])}
        why = "; ".join(f"{g}: {r}" for g, r in reasons.items() if r is not None)
        if not why:
            continue
        spec = get_spec(m)
        if not spec.has_weights:
            _say(f"warning: {m} has no committed weights ({spec.weights_path}); serving a seeded random "
                 "initialisation — its predictions are meaningless until it is trained")
        _say(f"export {m} → {onnx_dir} ({why})")
        from unroll.export.onnx_export import ExportError, export_model

        try:
            result = export_model(m, onnx_dir, naive=False)
        except ExportError as e:
            raise ServeError(str(e)) from None
        done += [r.onnx_path.stem for r in (result, *result.companions)]
    return done


def ensure_repository(repo: Path, onnx_dir: Path, target: str, graphs: list[str], force: bool = False) -> list[str]:
    """(Re)write the Triton repository for graphs that are missing, older than their ONNX, or for another target."""
    from unroll.serving.repository import BACKEND_MODEL, write_repository

    backend = BACKEND_MODEL.read_bytes() if target == "cpu" else None
    todo = []
    for g in graphs:
        cfg = repo / g / "config.pbtxt"
        model_py = repo / g / "1" / "model.py"
        if force or not cfg.exists() or f"--target {target} " not in cfg.read_text().split("\n", 1)[0] \
                or cfg.stat().st_mtime < (onnx_dir / f"{g}.onnx").stat().st_mtime \
                or (backend is not None and (not model_py.exists() or model_py.read_bytes() != backend)):
            todo.append(g)  # the last test: a repository written by an older unroll runs an outdated model.py
    if todo:
        _say(f"write Triton repository {repo} ({target}): {', '.join(todo)}")
        write_repository(target, todo, repo, onnx_dir=onnx_dir)
    return todo


def _first_sample(card: ModelCard) -> tuple[np.ndarray, int | None] | None:
    """The first sample of the card's test data (else validation, else training data) and its label, if any;
    ``None`` when the card names no data (the banner then shows the curl with a placeholder image)."""
    import numpy as np

    from unroll.data import dataset

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
    """One sample input per gateway model, chosen by task from its card, for the printed ``curl`` lines.

    Classification: the first sample of the card's test data, at the card's input size and colour (its
    label beside it, ``NAME.label.txt``). Denoising: the first image of the card's test data with seeded
    noise at σ = :data:`SAMPLE_SIGMA`.
    """
    from unroll.data import add_noise, noise_seed

    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for card in cards:
        if card.task not in GATEWAY_TASKS:
            continue
        sample = _first_sample(card)
        if sample is None:
            continue
        image, label = sample
        path = out / f"{card.name}.png"
        if card.task == "denoising":
            image = add_noise(image, SAMPLE_SIGMA, noise_seed(card.name, SAMPLE_SIGMA))
        elif label is not None:
            (out / f"{card.name}.label.txt").write_text(
                f"{card.labels[label] if card.labels is not None else label}\n")
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
                             "matching --…-port option") from None


def banner(base: str, cards: list[ModelCard], samples: dict[str, Path], api_key: bool, triton: str) -> str:
    """URLs and one ``curl`` per served model (by its card's task, with its sample file), as printed once ready.

    The lines work when pasted into a shell anywhere: the key is ``"$UNROLL_API_KEY"`` in double quotes (so the
    shell expands it) and sample paths are absolute (quoted when they need it).
    """
    auth = ' -H "X-API-Key: $UNROLL_API_KEY"' if api_key else ""
    tries = []
    for card in cards:
        sample = samples.get(card.name)
        sample = Path(sample).resolve() if sample is not None else Path("your-image.png")
        if card.task == "classification":
            url = f"{base}/v1/classify?model={card.name}&top_k=3"
            form = shlex.quote(f"image=@{sample}")
            tries.append(f"  curl{auth} -F {form} '{url}'")
            if card.lam is not None and card.lam.auto is not None:
                tries.append(f"  curl{auth} -F {form} '{url}&lam=auto'")
        elif card.task == "denoising":
            post = f"  curl{auth} --data-binary {shlex.quote(f'@{sample}')} -H 'Content-Type: image/png'"
            tries.append(f"{post} '{base}/v1/denoise?model={card.name}&sigma={SAMPLE_SIGMA:g}' -o denoised.png")
            tries.append(f"{post} '{base}/v1/denoise?model={card.name}' -D - -o denoised.png"
                         "   # σ estimated: see X-Sigma-Used")
    triton_only = [c.name for c in cards if c.task not in GATEWAY_TASKS and c.companion_of is None]
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
        "",
        "Ctrl-C stops the gateway and Triton.",
        "",
    ])


def resolve_models(models: list[str] | None, onnx_dir: Path | None = None) -> list[str]:
    """The models to serve: ``models`` (registered names, or graphs in ``onnx_dir`` that carry a card), else
    :func:`default_models`."""
    from unroll.card import CardError, from_onnx
    from unroll.registry import list_models

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
        path = onnx_dir / f"{m}.onnx" if onnx_dir is not None else None
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
    from unroll.card import from_onnx
    from unroll.registry import get_spec

    if onnx_dir is None:
        return [get_spec(m).card for m in models]
    return [from_onnx(onnx_dir / f"{m}.onnx") for m in models]  # what is served, whoever registered it


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
          triton_protocol: str = "grpc", api_key: str | None = None, repo: Path = Path("model_repository"),
          onnx_dir: Path = Path("build/onnx"), samples_dir: Path = Path("build/samples"), rebuild: bool = False,
          log_level: str = "info", on_ready: Callable[[str], None] | None = None,
          models: list[str] | None = None, workers: int | None = None) -> None:
    """Build what is missing, start Triton (unless ``triton_url``) and the gateway; block until Ctrl-C/SIGTERM.

    ``workers``: gateway processes behind ``port`` (default ``UNROLL_WORKERS``, else half the cores, 1 to 4;
    see :mod:`unroll.serving.gateway.workers`).

    ``models`` are registry names (default :func:`default_models`); their companions are served too.

    Gateway limits (body size, pixels, concurrency, timeouts) come from ``UNROLL_*`` variables
    (see :class:`unroll.serving.gateway.settings.Settings`); ``api_key`` defaults to ``UNROLL_API_KEY``.
    """
    import uvicorn
    from unroll.serving.gateway import Settings, create_app
    from unroll.serving.gateway.server import uvicorn_options
    from unroll.serving.gateway.triton_client import TRITON_API_KEY_ENV
    from unroll.serving.gateway.workers import Stopper, check_workers, default_workers, run_workers
    from unroll.serving.supervisor import TritonSupervisor
    from unroll.serving.triton import new_api_key, start

    if target not in ("cpu", "gpu"):
        raise ServeError(f"--target must be cpu or gpu, not {target!r}")
    if triton_url is None and target != "cpu":
        raise ServeError("the bundled tritonserver has only the Python backend, so it serves --target cpu; for "
                         "--target gpu run `unroll repo --target gpu` in the NGC container and pass --triton-url")
    models = resolve_models(models, None if triton_url else onnx_dir)
    workers = check_workers(workers) if workers is not None else default_workers()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # finally-blocks run on SIGTERM during set-up
    supervisor = None
    server = None
    gave_up: list[str] = []
    try:
        _check_port_free(host, port, "gateway")
        if triton_url is None:
            for p, what in ((triton_http_port, "Triton HTTP"), (triton_grpc_port, "Triton gRPC"),
                            (triton_metrics_port, "Triton metrics")):
                _check_port_free("127.0.0.1", p, what)
            onnx_dir.mkdir(parents=True, exist_ok=True)
            rebuilt = ensure_onnx(onnx_dir, models, force=rebuild)
            graphs = graphs_of(models, onnx_dir)
            ensure_repository(repo, onnx_dir, target, graphs, force=rebuild or bool(rebuilt))
            control, load_args = triton_load_args(graphs)
            log_file = (onnx_dir.parent / "triton.log").resolve()
            _say(f"start tritonserver on 127.0.0.1:{triton_http_port} (log: {log_file}, rotated at each start)")
            triton_key = new_api_key()  # this run's: Triton's APIs but health need it; only the gateway has it
            os.environ[TRITON_API_KEY_ENV] = triton_key

            def launch() -> TritonHandle:
                return start(repo, http_port=triton_http_port, grpc_port=triton_grpc_port,
                             metrics_port=triton_metrics_port, host="127.0.0.1", log_file=log_file,
                             api_key=triton_key, any_thread=True, model_control=control, extra_args=load_args)

            def give_up(why: str) -> None:
                gave_up.append(why)
                if isinstance(server, Stopper):
                    server.stop()
                elif server is not None:
                    server.should_exit = True

            _log_supervisor()
            supervisor = TritonSupervisor(launch, on_give_up=give_up)
            triton = supervisor.start()
            url = triton.url if triton_protocol == "http" else triton.grpc_url
        else:
            url = triton_url
        cards = served_cards(models, None if triton_url else onnx_dir)
        samples = write_samples(samples_dir, cards)
        settings = Settings.from_env(triton_url=url, triton_protocol=triton_protocol, api_key=api_key)
        shown = "0.0.0.0" if host in ("0.0.0.0", "::") else host
        base = f"http://{'127.0.0.1' if shown == '0.0.0.0' else shown}:{port}"
        text = banner(base, cards, samples, settings.api_key is not None, f"{triton_protocol}://{url}")

        def announce() -> None:  # once the gateway listens
            _say(text)
            if on_ready is not None:
                on_ready(base)

        if workers > 1:
            os.environ.update(settings.env())  # the workers build their app from the UNROLL_* variables
            stopper = Stopper()
            server = stopper
            if gave_up:  # Triton failed again while the gateway was being set up
                raise ServeError(gave_up[0])
            started = run_workers(host, port, workers, log_level, on_ready=announce, stopper=stopper,
                                  timeout_graceful_shutdown=10)
        else:
            class _Server(uvicorn.Server):
                async def startup(self, sockets: list[socket.socket] | None = None) -> None:
                    await super().startup(sockets)
                    if self.started:
                        announce()

            server = _Server(uvicorn.Config(create_app(settings), host=host, port=port, log_level=log_level,
                                            timeout_graceful_shutdown=10, **uvicorn_options()))
            if gave_up:  # Triton failed again while the gateway was being set up
                raise ServeError(gave_up[0])
            server.run()
            started = server.started
        if gave_up:
            raise ServeError(f"{gave_up[0]}; its log: {(onnx_dir.parent / 'triton.log').resolve()}")
        if not started:
            raise ServeError(f"the gateway could not start on {host}:{port} (see the log above)")
    except KeyboardInterrupt:
        _say("stopping")
    finally:
        if supervisor is not None:
            supervisor.stop()
            _say("tritonserver stopped")
        signal.signal(signal.SIGTERM, previous)


def serve_command(
    models: Annotated[str | None, typer.Option(
        envvar="UNROLL_MODELS", show_envvar=True,
        help="Comma-separated models to serve: registered names (see `unroll models`) or graphs exported into "
             "--onnx-dir with a card (`unroll export --model`, `unroll fuse --card`), each with the companion "
             "graphs its card names; default: every registered model with committed weights")] = None,
    host: Annotated[str, typer.Option(help="Gateway address (0.0.0.0 to expose it; Triton stays on 127.0.0.1)")]
    = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Gateway port")] = 8080,
    target: Annotated[str, typer.Option(help="Repository target; the bundled Triton serves cpu")] = "cpu",
    triton_http_port: Annotated[int, typer.Option(help="Triton HTTP port")] = 8000,
    triton_grpc_port: Annotated[int, typer.Option(help="Triton gRPC port")] = 8001,
    triton_metrics_port: Annotated[int, typer.Option(help="Triton metrics port")] = 8002,
    triton_url: Annotated[str | None, typer.Option(help="Use a Triton already running at HOST:PORT (its gRPC "
                                                        "port, or HTTP with --triton-protocol http)")] = None,
    triton_protocol: Annotated[str, typer.Option(help="How the gateway talks to Triton: grpc (faster here) or "
                                                      "http")] = "grpc",
    api_key: Annotated[str | None, typer.Option(envvar="UNROLL_API_KEY", show_envvar=True,
                                                help="Require this key on /v1/* (X-API-Key or Bearer)")] = None,
    repo: Annotated[Path, typer.Option(help="Triton model repository")] = Path("model_repository"),
    onnx_dir: Annotated[Path, typer.Option(help="ONNX exports")] = Path("build/onnx"),
    rebuild: Annotated[bool, typer.Option("--rebuild", help="Re-export and rewrite the repository even if up to "
                                                            "date")] = False,
    log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "info",
    workers: Annotated[int | None, typer.Option(
        envvar="UNROLL_WORKERS", show_envvar=True, min=1, metavar="N",
        help="Gateway worker processes behind the one port (metrics add up across them); default: half the "
             "cores, 1 to 4 (Triton's models take the rest)")] = None,
) -> None:
    """Build what is missing, start Triton and the REST gateway, print a curl per endpoint; Ctrl-C stops both."""
    from unroll.serving.repository import RepositoryError
    from unroll.serving.triton import TritonStartError

    try:
        serve(host=host, port=port, target=target, triton_http_port=triton_http_port,
              triton_grpc_port=triton_grpc_port, triton_metrics_port=triton_metrics_port, triton_url=triton_url,
              triton_protocol=triton_protocol, api_key=api_key, repo=repo, onnx_dir=onnx_dir, rebuild=rebuild,
              log_level=log_level, models=models.split(",") if models is not None else None, workers=workers)
    except (ServeError, TritonStartError, RepositoryError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(1) from None


if __name__ == "__main__":  # python -m unroll.app.serve [options]
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    typer.run(serve_command)
