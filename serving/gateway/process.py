"""The gateway as its own process: ``python -m unroll.serving.gateway`` under a real uvicorn, on a spare port.

The tests and ``unroll bench serve`` run it this way (settings travel as ``UNROLL_*`` variables), so
what they measure and check is the server a user starts, not an in-process app.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from unroll.errors import GatewayStartError
from unroll.serving.gateway.http_settings import HttpSettings
from unroll.serving.gateway.settings import ENV_PREFIX, Settings
from unroll.serving.triton import free_ports

_REPO_ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def gateway_process(settings: Settings, log: Path, ready_path: str = "/readyz",
                    timeout_s: float = 90.0, http: HttpSettings | None = None, workers: int = 1) -> Iterator[str]:
    """Start the gateway with ``settings`` (and the HTTP layer's ``http`` limits, else their defaults), logging
    to ``log``; yield its base URL once ``ready_path`` answers 200, and always stop it (SIGTERM, then SIGKILL
    after 15 s). ``workers`` > 1: that many worker processes behind the port (:mod:`.workers`)."""
    with gateway_popen(settings, log, ready_path, timeout_s, http, workers) as (base, _):
        yield base


@contextlib.contextmanager
def gateway_popen(settings: Settings, log: Path, ready_path: str = "/readyz", timeout_s: float = 90.0,
                  http: HttpSettings | None = None, workers: int = 1,
                  args: tuple[str, ...] = ()) -> Iterator[tuple[str, subprocess.Popen]]:
    """:func:`gateway_process`, yielding the base URL and the process (the parent of the workers, if any); ``args``
    go after the defaults on ``python -m unroll.serving.gateway``'s command line (e.g. ``--log-level info``)."""
    port = free_ports(1)[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    env.update(settings.env())
    if http is not None:
        env.update(http.env())
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "unroll.serving.gateway", "--port", str(port), "--log-level",
                                 "warning", "--workers", str(workers), *args], env=env, stdout=out,
                                stderr=subprocess.STDOUT, cwd=_REPO_ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base + ready_path, timeout_s, proc, log)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_ready(url: str, timeout_s: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    """Poll ``url`` until it answers 200; :class:`GatewayStartError` when ``proc`` exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise GatewayStartError(f"the gateway exited with code {proc.returncode}:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise GatewayStartError(f"{url} did not answer 200 within {timeout_s:g} s" +
                                    (f":\n{_tail(log)}" if log else ""))
        time.sleep(0.1)


def _tail(log: Path | None) -> str:
    return log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""
