"""Run the gateway as one process or as ``N`` worker processes behind one port (``--workers`` / ``UNROLL_WORKERS``).

One gateway process is bound by the GIL to about one core, so ``workers > 1`` runs uvicorn's multi-process
supervisor on one listening socket: each worker has its own app, Triton client, catalog and admission limits (per
worker), a dead one is replaced, SIGINT/SIGTERM drain them all. Metrics add up across workers through
prometheus_client's multiprocess mode in a per-run ``PROMETHEUS_MULTIPROC_DIR``; the rate limit's buckets are one table
the workers share, a file in that directory (:class:`~.rate_limit.SharedBuckets`), so a client gets the stated rate
whichever workers answer it, not ``N`` times it. The default is half the cores (:func:`default_workers`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from unroll.serving.gateway.http_settings import HttpSettings
from unroll.serving.gateway.rate_limit import SHARED_FILE_ENV, SharedBuckets
from unroll.serving.gateway.server import uvicorn_options
from unroll.serving.gateway.settings import ENV_PREFIX

log = logging.getLogger("unroll.gateway")

#: Number of gateway worker processes for ``unroll serve`` (``--workers`` wins).
WORKERS_ENV = ENV_PREFIX + "WORKERS"
#: prometheus_client's multiprocess directory (set by the parent for its workers only).
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: The app factory the workers import (``uvicorn`` needs an import string to spawn workers).
APP_FACTORY = "unroll.serving.gateway.app:create_app"
#: The HTTP protocol the workers import: the gateway's httptools protocol with its limits from ``UNROLL_*`` variables.
HTTP_PROTOCOL = "unroll.serving.gateway.server:EnvGatewayProtocol"
#: Most workers chosen by default (beyond the cores, or a few, more processes only add contention).
MAX_DEFAULT_WORKERS = 4


def default_workers() -> int:
    """``UNROLL_WORKERS`` when set, else half the cores (at least 1, at most :data:`MAX_DEFAULT_WORKERS`).

    Half, because the gateway shares the machine with Triton, whose model instances want the other cores: on the
    a 2-core machine a second worker can lower throughput (``unroll bench gateway-profile`` measures 1 vs N workers,
    benchmarks/results/gateway_profile.md), so the default there is one; on 8 cores it is 4.
    """
    raw = os.environ.get(WORKERS_ENV, "").strip()
    if raw:
        return check_workers(raw)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores // 2, MAX_DEFAULT_WORKERS))


def check_workers(value: int | str) -> int:
    """A worker count ≥ 1; ``ValueError`` naming :data:`WORKERS_ENV` otherwise."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{WORKERS_ENV}/--workers: expected a whole number ≥ 1 (got {value!r})") from None
    if n < 1:
        raise ValueError(f"{WORKERS_ENV}/--workers: expected a whole number ≥ 1 (got {value!r})")
    return n


_DIR_PREFIX = "unroll-gateway-metrics-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_metrics_dirs(root: str | None = None) -> list[str]:
    """Remove the metrics directories of earlier runs whose parent process is gone (killed before it could clean
    up); returns the paths removed."""
    root = root or tempfile.gettempdir()
    removed = []
    for path in Path(root).glob(_DIR_PREFIX + "*"):
        pid = path.name[len(_DIR_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


@contextlib.contextmanager
def shared_buckets(directory: str) -> Iterator[Path]:
    """A fresh rate-limit bucket file in ``directory`` for this run's workers, named in ``os.environ``
    (:data:`~.rate_limit.SHARED_FILE_ENV`, so spawned workers inherit it) and unset afterwards."""
    path = SharedBuckets.create(Path(directory) / "rate-limit.buckets")
    with _environ(SHARED_FILE_ENV, str(path)):
        yield path


@contextlib.contextmanager
def metrics_dir() -> Iterator[str]:
    """A fresh, empty ``PROMETHEUS_MULTIPROC_DIR`` for this run's workers (set in ``os.environ``, so spawned
    workers inherit it), removed and unset afterwards; left-overs of killed earlier runs are removed first."""
    remove_stale_metrics_dirs()
    path = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")
    try:
        with _environ(METRICS_DIR_ENV, path):
            yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` for the block (spawned workers inherit it), then as it was."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def _supervisor_class() -> type:
    from prometheus_client import multiprocess
    from uvicorn.supervisors import Multiprocess

    class GatewayWorkers(Multiprocess):
        """uvicorn's supervisor; a replaced worker's live gauges are removed from the metrics directory."""

        def keep_subprocess_alive(self) -> None:
            before = {p.pid for p in self.processes}
            super().keep_subprocess_alive()
            for pid in before - {p.pid for p in self.processes}:
                if pid is not None:
                    multiprocess.mark_process_dead(pid)

    return GatewayWorkers


class Stopper:
    """Lets another thread (e.g. the Triton supervisor giving up) stop a running gateway, one or many workers."""

    def __init__(self) -> None:
        self._target: Any = None
        self._requested = False

    def attach(self, target: Any) -> None:
        self._target = target
        if self._requested:
            self.stop()

    def stop(self) -> None:
        self._requested = True
        t = self._target
        if t is None:
            return
        if hasattr(t, "should_exit") and isinstance(t.should_exit, threading.Event):
            t.should_exit.set()  # uvicorn's Multiprocess
        else:
            t.should_exit = True  # uvicorn.Server


def _announce_when_up(url: str, on_ready: Callable[[], None], done: threading.Event) -> None:
    while not done.is_set():
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    on_ready()
                    return
        except OSError:
            pass
        time.sleep(0.1)


def run_workers(host: str, port: int, workers: int, log_level: str, on_ready: Callable[[], None] | None = None,
                stopper: Stopper | None = None, **uvicorn_kwargs: Any) -> bool:
    """``workers`` (> 1) gateway processes on ``host:port``, settings from ``UNROLL_*`` variables; blocks until
    SIGINT/SIGTERM or ``stopper.stop()``. ``on_ready`` runs (in a thread) once the port answers ``/healthz``.
    Returns whether a worker ever answered."""
    import uvicorn

    limits = HttpSettings()  # fail here, in the parent, on a bad UNROLL_* variable
    up = threading.Event()
    done = threading.Event()

    def ready() -> None:
        up.set()
        if on_ready is not None:
            on_ready()

    with metrics_dir() as directory, shared_buckets(directory):
        config = uvicorn.Config(APP_FACTORY, factory=True, host=host, port=port, workers=workers,
                                **uvicorn_options(limits, http=HTTP_PROTOCOL, log_level=log_level), **uvicorn_kwargs)
        sock = config.bind_socket()
        probe = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        watcher = threading.Thread(target=_announce_when_up, args=(f"http://{probe}:{port}/healthz", ready, done),
                                   daemon=True)
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            supervisor = _supervisor_class()(config, sockets=[sock])  # installs its own SIGINT/SIGTERM handlers
            if stopper is not None:
                stopper.attach(supervisor)
            watcher.start()
            supervisor.run()
        finally:
            done.set()
            sock.close()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
    return up.is_set()
