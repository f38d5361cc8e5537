"""``unroll serve``: build what is missing, start Triton and the REST gateway, stop both cleanly.

Steps: export the demo models to ONNX when an export is missing or older than its weights
(``build/onnx``), write the Triton repository when a model directory is missing, stale or for another
target (``model_repository``), start the bundled tritonserver on 127.0.0.1 (unless ``--triton-url``
points at one already running, e.g. the NGC container on a GPU server), write sample inputs to
``build/samples``, then run the gateway with uvicorn and print the URLs and a ``curl`` per endpoint.
Ctrl-C or SIGTERM stops the gateway gracefully, then Triton — also when they arrive during set-up.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer

GATEWAY_MODELS = ("sdnet-mnist", "csc-denoiser")
#: The Triton models behind them: each classifier's λ rule is a model of its own (lam=auto).
TRITON_MODELS = ("sdnet-mnist", "sdnet-mnist-autolam", "csc-denoiser")
SAMPLE_DIGIT_INDEX = 0


class ServeError(RuntimeError):
    """A set-up step cannot be done; the message says what to do instead."""


def _say(msg: str) -> None:
    print(msg, flush=True)


def _onnx_stem(model: str) -> tuple[str, str]:
    """Triton model → (registry name, ONNX file stem)."""
    if model.endswith("-autolam"):
        base = model.removesuffix("-autolam")
        return base, f"{base}.autolam"
    return model, model


def stale_reason(model: str, onnx_dir: Path) -> str | None:
    """Why ``model``'s export must be (re)built, or ``None`` when it is up to date with its weights."""
    from unroll.registry import get_spec

    name, stem = _onnx_stem(model)
    spec = get_spec(name)
    graph, report = onnx_dir / f"{stem}.onnx", onnx_dir / f"{stem}.report.json"
    if not graph.exists() or not report.exists():
        return "not exported yet"
    if spec.has_weights:
        if json.loads(report.read_text()).get("weights") != "committed":
            return "exported before its weights were committed"
        if spec.weights_path.stat().st_mtime > graph.stat().st_mtime:
            return "weights are newer than the export"
    return None


def ensure_onnx(onnx_dir: Path, models: tuple[str, ...] = TRITON_MODELS, force: bool = False) -> list[str]:
    """Export every model whose ONNX is missing or stale; returns the names exported."""
    from unroll.export.onnx_export import export_auto_lam, export_model

    from unroll.registry import get_spec

    done = []
    for m in models:
        why = "--rebuild" if force else stale_reason(m, onnx_dir)
        if why is None:
            continue
        name, _ = _onnx_stem(m)
        if not get_spec(name).has_weights:
            _say(f"warning: {name} has no committed weights ({get_spec(name).weights_path}); serving a seeded "
                 "random initialisation — its predictions are meaningless until it is trained")
        _say(f"export {m} → {onnx_dir} ({why})")
        if m.endswith("-autolam"):
            export_auto_lam(name, onnx_dir)
        else:
            export_model(name, onnx_dir, naive=False)
        done.append(m)
    return done


def ensure_repository(repo: Path, onnx_dir: Path, target: str, models: tuple[str, ...] = TRITON_MODELS,
                      force: bool = False) -> list[str]:
    """(Re)write the Triton repository for models that are missing, older than their ONNX, or for another target."""
    from unroll.serving.repository import write_repository

    todo = []
    for m in models:
        cfg = repo / m / "config.pbtxt"
        _, stem = _onnx_stem(m)
        if force or not cfg.exists() or f"--target {target} " not in cfg.read_text().split("\n", 1)[0] \
                or cfg.stat().st_mtime < (onnx_dir / f"{stem}.onnx").stat().st_mtime:
            todo.append(m)
    if todo:
        _say(f"write Triton repository {repo} ({target}): {', '.join(todo)}")
        write_repository(target, todo, repo, onnx_dir=onnx_dir)
    return todo


def write_samples(out: Path) -> dict[str, Path]:
    """A test digit (white on black, 28×28) and a noisy photo (σ = 25) for the printed ``curl`` lines."""
    import numpy as np
    from PIL import Image

    from unroll.data import add_noise, bundled_image, mnist_split, noise_seed

    out.mkdir(parents=True, exist_ok=True)
    paths = {"digit": out / "digit.png", "noisy": out / "noisy.png"}
    if not paths["digit"].exists():
        _, _, x, y = mnist_split()
        Image.fromarray(np.rint(x[SAMPLE_DIGIT_INDEX, 0] * 255).astype(np.uint8)).save(paths["digit"])
        (out / "digit.label.txt").write_text(f"{int(y[SAMPLE_DIGIT_INDEX])}\n")
    if not paths["noisy"].exists():
        clean = bundled_image("camera")
        noisy = add_noise(clean, 25.0, noise_seed("camera", 25.0))
        Image.fromarray(np.rint(np.clip(noisy, 0, 1) * 255).astype(np.uint8)).save(paths["noisy"])
    return paths


def _check_port_free(host: str, port: int, what: str) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ServeError(f"{what} port {host}:{port} is not free ({e.strerror}); pick another with the "
                             "matching --…-port option") from None


def banner(base: str, samples: dict[str, Path], api_key: bool, triton: str) -> str:
    """URLs and one ``curl`` per endpoint (with the sample files), as printed once the gateway listens."""
    auth = " -H 'X-API-Key: $UNROLL_API_KEY'" if api_key else ""
    digit, noisy = samples["digit"], samples["noisy"]
    return "\n".join([
        "",
        f"unroll gateway ready: {base}   (Triton: {triton})",
        f"  API docs     {base}/docs",
        "",
        "try:",
        f"  curl{auth} -F image=@{digit} '{base}/v1/classify?model=sdnet-mnist&top_k=3'",
        f"  curl{auth} -F image=@{digit} '{base}/v1/classify?model=sdnet-mnist&top_k=3&lam=auto'",
        f"  curl{auth} --data-binary @{noisy} -H 'Content-Type: image/png' "
        f"'{base}/v1/denoise?model=csc-denoiser&sigma=25' -o denoised.png",
        f"  curl{auth} --data-binary @{noisy} -H 'Content-Type: image/png' '{base}/v1/denoise' -D - -o denoised.png"
        "   # σ estimated: see X-Sigma-Used",
        f"  curl{auth} {base}/v1/models",
        f"  curl {base}/healthz    curl {base}/readyz    curl {base}/metrics",
        "",
        "Ctrl-C stops the gateway and Triton.",
        "",
    ])


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def serve(host: str = "127.0.0.1", port: int = 8080, target: str = "cpu", triton_http_port: int = 8000,
          triton_grpc_port: int = 8001, triton_metrics_port: int = 8002, triton_url: str | None = None,
          triton_protocol: str = "grpc", api_key: str | None = None, repo: Path = Path("model_repository"),
          onnx_dir: Path = Path("build/onnx"), samples_dir: Path = Path("build/samples"), rebuild: bool = False,
          log_level: str = "info", on_ready: Callable[[str], None] | None = None) -> None:
    """Build what is missing, start Triton (unless ``triton_url``) and the gateway; block until Ctrl-C/SIGTERM.

    Gateway limits (body size, pixels, concurrency, timeouts) come from ``UNROLL_*`` variables
    (see :class:`unroll.serving.gateway.settings.Settings`); ``api_key`` defaults to ``UNROLL_API_KEY``.
    """
    import uvicorn
    from unroll.serving.gateway import Settings, create_app
    from unroll.serving.triton import start

    if target not in ("cpu", "gpu"):
        raise ServeError(f"--target must be cpu or gpu, not {target!r}")
    if triton_url is None and target != "cpu":
        raise ServeError("the bundled tritonserver has only the Python backend, so it serves --target cpu; for "
                         "--target gpu run `unroll repo --target gpu` in the NGC container and pass --triton-url")
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # finally-blocks run on SIGTERM during set-up
    triton = None
    try:
        _check_port_free(host, port, "gateway")
        if triton_url is None:
            for p, what in ((triton_http_port, "Triton HTTP"), (triton_grpc_port, "Triton gRPC"),
                            (triton_metrics_port, "Triton metrics")):
                _check_port_free("127.0.0.1", p, what)
            onnx_dir.mkdir(parents=True, exist_ok=True)
            rebuilt = ensure_onnx(onnx_dir, force=rebuild)
            ensure_repository(repo, onnx_dir, target, force=rebuild or bool(rebuilt))
            log_file = onnx_dir.parent / "triton.log"
            _say(f"start tritonserver on 127.0.0.1:{triton_http_port} (log: {log_file})")
            triton = start(repo, http_port=triton_http_port, grpc_port=triton_grpc_port,
                           metrics_port=triton_metrics_port, host="127.0.0.1", log_file=log_file)
            url = triton.url if triton_protocol == "http" else triton.grpc_url
        else:
            url = triton_url
        samples = write_samples(samples_dir)
        settings = Settings.from_env(triton_url=url, triton_protocol=triton_protocol, api_key=api_key)
        shown = "0.0.0.0" if host in ("0.0.0.0", "::") else host
        base = f"http://{'127.0.0.1' if shown == '0.0.0.0' else shown}:{port}"
        text = banner(base, samples, settings.api_key is not None, f"{triton_protocol}://{url}")

        class _Server(uvicorn.Server):
            async def startup(self, sockets: list[socket.socket] | None = None) -> None:
                await super().startup(sockets)
                if self.started:
                    _say(text)
                    if on_ready is not None:
                        on_ready(base)

        server = _Server(uvicorn.Config(create_app(settings), host=host, port=port, log_level=log_level,
                                        timeout_graceful_shutdown=10))
        server.run()
        if not server.started:
            raise ServeError(f"the gateway could not start on {host}:{port} (see the log above)")
    except KeyboardInterrupt:
        _say("stopping")
    finally:
        if triton is not None:
            triton.stop()
            _say("tritonserver stopped")
        signal.signal(signal.SIGTERM, previous)


def serve_command(
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
    rebuild: Annotated[bool, typer.Option(help="Re-export and rewrite the repository even if up to date")] = False,
    log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "info",
) -> None:
    """Build what is missing, start Triton and the REST gateway, print a curl per endpoint; Ctrl-C stops both."""
    from unroll.export.onnx_export import ExportError
    from unroll.serving.repository import RepositoryError
    from unroll.serving.triton import TritonStartError

    try:
        serve(host=host, port=port, target=target, triton_http_port=triton_http_port,
              triton_grpc_port=triton_grpc_port, triton_metrics_port=triton_metrics_port, triton_url=triton_url,
              triton_protocol=triton_protocol, api_key=api_key, repo=repo, onnx_dir=onnx_dir, rebuild=rebuild,
              log_level=log_level)
    except (ServeError, TritonStartError, RepositoryError, ExportError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(1) from None


if __name__ == "__main__":  # python -m unroll.serving.serve [options]
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    typer.run(serve_command)
