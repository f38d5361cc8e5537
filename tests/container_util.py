"""Build and run the serving images with podman, for the tests (tests/test_container.py, the deploy tests).

``build_image(target)`` runs ``scripts/container_setup.sh`` (tools, containers.conf, local base image, staged build
context, cached build) and returns the image name; ``run_container(image, ...)`` starts a container with the
gateway's port published on loopback and waits for ``/readyz``; ``podman(...)`` runs any podman command with the
set-up's ``containers.conf`` (e.g. ``podman("kube", "play", ...)``). Where podman cannot be had or cannot run a
container, :class:`ContainerUnavailable` carries the one-line reason (tests skip with it).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "scripts" / "container_setup.sh"
CONTAINERS_CONF = ROOT / "build" / "container" / "containers.conf"
#: scripts/container_setup.sh's exit status for "this machine cannot build or run containers".
UNAVAILABLE = 75
GATEWAY_PORT = 8080


class ContainerUnavailable(RuntimeError):
    """podman cannot be installed or cannot run a container here; the message is the one-line reason."""


@dataclass(frozen=True)
class Built:
    image: str
    seconds: float  #: wall time of the set-up script (tools, base, staging, build or cache hit)


_built: dict[str, Built] = {}


def podman_env() -> dict[str, str]:
    """This process's environment with ``CONTAINERS_CONF`` pointing at the set-up's file."""
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}


def podman(*args: str, check: bool = True, timeout: float = 120, input: str | None = None
           ) -> subprocess.CompletedProcess[str]:
    """``podman ARGS`` with the set-up's containers.conf; raises with stderr when ``check`` and it fails."""
    proc = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=podman_env(),
                          input=input)
    if check and proc.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)} exited with {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return proc


def build_image(target: str = "cpu", timeout: float = 2400) -> str:
    """Build (or reuse) the image for ``target`` and return its name; once per process and target."""
    return build(target, timeout).image


def build(target: str = "cpu", timeout: float = 2400) -> Built:
    """:func:`build_image` with the set-up's wall time (cold build or cache hit)."""
    if target in _built:
        return _built[target]
    start = time.monotonic()
    proc = subprocess.run(["bash", str(SETUP), "--target", target], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHON": sys.executable})
    lines = proc.stdout.strip().splitlines()
    last = lines[-1] if lines else ""
    if proc.returncode == UNAVAILABLE:
        raise ContainerUnavailable(last.removeprefix("unavailable: ") or "container set-up unavailable")
    if proc.returncode != 0 or not last.startswith("image: "):
        raise RuntimeError(f"{SETUP.name} exited with {proc.returncode}:\n{proc.stderr[-4000:]}\n{proc.stdout[-1000:]}")
    _built[target] = Built(last.removeprefix("image: ").split()[0], time.monotonic() - start)
    return _built[target]


def free_port() -> int:
    from unroll.serving.triton import free_ports

    return free_ports(1)[0]


@dataclass
class Container:
    """A running container started by :func:`run_container`."""

    name: str
    image: str
    port: int  #: host port of the gateway (127.0.0.1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logs(self) -> str:
        proc = podman("logs", self.name, check=False)
        return proc.stdout + proc.stderr

    def exec(self, *cmd: str, check: bool = False, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return podman("exec", self.name, *cmd, check=check, timeout=timeout)

    def running(self) -> bool:
        proc = podman("inspect", "--format", "{{.State.Running}}", self.name, check=False)
        return proc.stdout.strip() == "true"

    def stop(self, signal: str = "TERM", within_s: float = 15) -> int:
        """Send ``signal`` to the container's init and wait up to ``within_s`` for it to exit; its exit code.

        Raises ``subprocess.TimeoutExpired`` when it is still running after ``within_s``.
        """
        podman("kill", "--signal", signal, self.name)
        proc = podman("wait", self.name, timeout=within_s)
        return int(proc.stdout.strip().splitlines()[-1])

    def remove(self) -> None:
        podman("rm", "--force", "--time", "0", self.name, check=False)


def wait_ready(container: Container, timeout_s: float = 240, path: str = "/readyz") -> None:
    """Poll ``path`` until it answers 200; raise with the container's log if it exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(container.url + path, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if not container.running():
            raise RuntimeError(f"container {container.name} exited before {path} answered 200:\n"
                               f"{container.logs()[-4000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{container.url}{path} not 200 after {timeout_s:g} s:\n{container.logs()[-4000:]}")
        time.sleep(0.5)


def run_container(image: str, *args: str, name: str | None = None, port: int | None = None,
                  env: dict[str, str] | None = None, extra: Sequence[str] = (), ready: bool = True,
                  timeout_s: float = 240) -> Container:
    """``podman run -d`` ``image`` (``args`` go to its entry point) with the gateway on ``127.0.0.1:port``.

    The image's HEALTHCHECK is kept but not scheduled (podman schedules it through systemd, absent here): run it
    with ``podman healthcheck run NAME``. ``ready`` waits for ``/readyz`` (raising with the log on failure).
    """
    name = name or f"unroll-test-{uuid.uuid4().hex[:8]}"
    port = port or free_port()
    cmd = ["run", "-d", "--name", name, "--health-interval", "disable", "-p", f"127.0.0.1:{port}:{GATEWAY_PORT}"]
    for k, v in (env or {}).items():
        cmd += ["-e", f"{k}={v}"]
    podman(*cmd, *extra, image, *args)
    container = Container(name, image, port)
    if ready:
        try:
            wait_ready(container, timeout_s)
        except BaseException:
            container.remove()
            raise
    return container


@contextlib.contextmanager
def running(image: str, *args: str, **kw) -> Iterator[Container]:
    """:func:`run_container` that always removes the container afterwards."""
    container = run_container(image, *args, **kw)
    try:
        yield container
    finally:
        container.remove()
