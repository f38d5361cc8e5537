"""Running the README's shell commands verbatim in a test: bash in a clone-like directory, curl pointed at the
test's free ports by its own config file, and `unroll serve` kept running in the background while the commands
after it run (``tests/test_readme_rest.py``, ``tests/test_readme_deploy.py``).

The commands say ``127.0.0.1:8080`` (the default gateway port); tests take free ports where they start the server
themselves. curl reads ``$CURL_HOME/.curlrc`` before its arguments: ``connect-to`` sends 127.0.0.1:8080 to the
test's gateway (a command naming another port or host is not redirected and fails), ``fail-with-body`` makes HTTP
≥ 400 a non-zero exit, and ``write-out`` prints ``HTTP <status>`` on stderr. An ``unroll serve`` line of the README
takes no port options, so it runs on the default ports (:data:`DEFAULT_PORTS`, unless :func:`ports_taken` names one).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from unroll.serving.triton import free_ports

#: What the README's commands address.
README_BASE = "http://127.0.0.1:8080"
READY_MARK = "unroll gateway ready"
#: `unroll serve`'s defaults: gateway, Triton HTTP, gRPC, metrics.
DEFAULT_PORTS = (8080, 8000, 8001, 8002)


def ports_taken(ports: tuple[int, ...]) -> list[int]:
    """Those of ``ports`` that something on 127.0.0.1 holds (empty when all are free)."""
    taken = []
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                taken.append(port)
    return taken


def write_curlrc(home: Path, port: int) -> Path:
    """``home/.curlrc`` sending the README's 127.0.0.1:8080 to ``port`` (see the module docstring)."""
    home.mkdir(parents=True, exist_ok=True)
    (home / ".curlrc").write_text(
        f'connect-to = "127.0.0.1:8080:127.0.0.1:{port}"\n'
        "fail-with-body\nsilent\nshow-error\n"
        'write-out = "%{stderr}HTTP %{http_code}\\n"\n')
    return home


@dataclass
class Shell:
    """Where and with what environment the README's commands run: ``cwd`` laid out as the user's, ``unroll`` on
    ``PATH`` (this venv's), curl redirected to ``ports[0]``; no ``UNROLL_*`` variable of the test's environment."""

    cwd: Path
    curl_home: Path
    ports: tuple[int, int, int, int] = field(default_factory=lambda: tuple(free_ports(4)))  # type: ignore[assignment]

    def __post_init__(self) -> None:
        write_curlrc(self.curl_home, self.ports[0])

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.ports[0]}"

    def port_flags(self) -> str:
        """`unroll serve`'s options for :attr:`ports` (for a server the test starts itself)."""
        gateway, http, grpc, metrics = self.ports
        return f"--port {gateway} --triton-http-port {http} --triton-grpc-port {grpc} --triton-metrics-port {metrics}"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("UNROLL_", "CURL_"))}
        env.update(PATH=os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]),
                   CURL_HOME=str(self.curl_home), PYTHONUNBUFFERED="1")
        return env

    def run(self, command: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """``command`` exactly as written, by bash, in :attr:`cwd`."""
        return subprocess.run(["bash", "-c", command], cwd=self.cwd, env=self.env(), capture_output=True,
                              timeout=timeout)


@dataclass
class Background:
    """A long-running command (``unroll serve …``) started by bash, ready once it prints :data:`READY_MARK`."""

    proc: subprocess.Popen
    output: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    @classmethod
    def start(cls, shell: Shell, command: str, timeout: float = 300) -> Background:
        # exec: bash becomes the command, so SIGINT reaches `unroll serve` itself; its own session, so a
        # forgotten one can be stopped as a group.
        proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=shell.cwd, env=shell.env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        bg = cls(proc)
        ready = threading.Event()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                bg.output.append(line)
                if READY_MARK in line:
                    ready.set()
            ready.set()

        bg.reader = threading.Thread(target=pump, daemon=True)
        bg.reader.start()
        if not ready.wait(timeout) or proc.poll() is not None:
            bg.stop()
            raise AssertionError(f"`{command}` did not become ready:\n" + "".join(bg.output)[-4000:])
        return bg

    def stop(self) -> int:
        """Ctrl-C, as a user stops it; SIGKILL to its group after a minute. Returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.reader is not None:
            self.reader.join(10)
        if self.proc.stdout is not None and (self.reader is None or not self.reader.is_alive()):
            self.proc.stdout.close()
        return self.proc.returncode
