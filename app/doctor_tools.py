"""The doctor's checks of binaries, run from this process with timeouts: any tool's ``--version`` (and a command
that shows it works, like ``podman info``), the ``perf_analyzer`` that ``unroll bench serve`` runs, and the bundled
``tritonserver`` started on an empty repository until it prints its version.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from unroll.benchmarks import perf_analyzer as pa
from unroll.machine import BINARY_TIMEOUT_S, Component, error_line, failed_component, kill_group, run_binary
from unroll.serving import triton as tr


def _version(text: str) -> str | None:
    m = re.search(r"[Vv]ersion:?\s+v?(\d[\w.\-+]*)", text)
    return m.group(1) if m else None


def check_tool(name: str, version_args: tuple[str, ...] = ("--version",), works_args: tuple[str, ...] | None = None,
               timeout: float = BINARY_TIMEOUT_S, exe: str | None = None) -> Component:
    """A tool on PATH (or at ``exe``): its version, and (``works_args``) a command that shows it really works
    (``podman info``)."""
    exe = exe or shutil.which(name)
    if exe is None:
        return Component(name, "missing", f"{name} is not on PATH")
    facts: dict = {"path": exe}
    r = run_binary([exe, *version_args], timeout)
    facts["version"] = _version(r.text)
    if r.rc != 0:
        if name == "perf_analyzer" and r.rc is not None and "Usage" in r.text:  # built before it had --version
            return Component(name, "ok", "perf_analyzer runs (it predates --version)", facts)
        return failed_component(name, f"{name} {' '.join(version_args)}", r, facts)
    if works_args:
        w = run_binary([exe, *works_args], timeout)
        if w.rc != 0:
            return failed_component(name, f"{name} {' '.join(works_args)}", w, facts,
                                     f"{name} {facts['version'] or ''} is installed but ")
        facts["works"] = f"{name} {' '.join(works_args)}"
    return Component(name, "ok", f"{name} {facts['version'] or '(version not reported)'}"
                     + (f"; `{facts['works']}` works" if works_args else ""), facts)


def check_perf_analyzer(timeout: float = BINARY_TIMEOUT_S) -> Component:
    """The ``perf_analyzer`` that ``unroll bench serve`` would run (:func:`unroll.benchmarks.perf_analyzer.find`),
    not one on PATH: the bench never looks there, so a verdict from PATH would not say what the bench does."""

    exe = pa.find()
    if exe is None:
        return Component("perf_analyzer", "missing", pa.missing_reason())
    return check_tool("perf_analyzer", timeout=timeout, exe=str(exe))


def check_triton(timeout: float = BINARY_TIMEOUT_S) -> Component:
    """The bundled ``tritonserver``: started on an empty repository with every endpoint off until it prints its
    ``server_version``, then stopped. Read-only (unlike ``unroll triton``, it installs no backend stub)."""

    facts: dict = {"pinned": tr.BUNDLED_TRITON_VERSION}
    try:
        dist = tr._distribution()
    except tr.TritonStartError as e:
        return Component("triton", "missing", str(e), facts)
    root = Path(dist.get_root_module_path()) / "tritonserver"
    binary = root / "bin" / "tritonserver"
    facts["binary"] = str(binary)
    if not binary.exists():
        return Component("triton", "broken", f"no tritonserver binary at {binary} (reinstall nvidia-pytriton)", facts)
    py = f"{sys.version_info[0]}.{sys.version_info[1]}"
    stub = Path(dist.get_stub_path(py))
    facts["python_stub"] = str(stub) if stub.exists() else None
    libs = Path(dist.get_libs_path())
    pylib = tr._python_libdir()
    env = tr.server_env(tr.ServerLayout(binary, root / "backends", (libs, pylib) if pylib else (libs,)))
    lines: list[str] = []
    found = threading.Event()
    with tempfile.TemporaryDirectory(prefix="unroll-doctor-") as repo:
        try:
            p = subprocess.Popen([str(binary), f"--model-repository={repo}", "--allow-http=false",
                                  "--allow-grpc=false", "--allow-metrics=false", "--exit-timeout-secs=1",
                                  f"--backend-directory={root / 'backends'}"],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True)
        except OSError as e:
            return Component("triton", "broken", f"tritonserver could not start: {error_line(e)}", facts)

        def read() -> None:
            assert p.stdout is not None
            for raw in p.stdout:
                line = raw.decode(errors="replace").rstrip()
                lines.append(line)
                m = re.match(r"\|\s*server_version\s*\|\s*(\S+)", line)
                if m:
                    facts["version"] = m.group(1)
                    found.set()
            found.set()  # EOF: it exited

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            found.wait(timeout)
            exited = p.poll()  # not None: it ended on its own (a start-up failure)
        finally:
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(3)
            except subprocess.TimeoutExpired:
                kill_group(p)
                p.wait(3)
            reader.join(2)
    version = facts.get("version")
    if version is None:
        tail = next((ln for ln in reversed(lines) if ln.strip()), "")[:200]
        if exited is not None:
            return Component("triton", "broken", f"tritonserver exited {exited} at start: {tail or 'no output'}", facts)
        return Component("triton", "unknown" if lines else "broken",
                         f"tritonserver did not report its version within {timeout:.0f} s"
                         + (f": {tail}" if tail else " (no output)"), facts)
    if facts["python_stub"] is None:
        return Component("triton", "broken", f"tritonserver {version} runs, but nvidia-pytriton has no Python-backend "
                                             f"stub for Python {py} (the served models cannot load)", facts)
    note = "" if version == tr.BUNDLED_TRITON_VERSION else f" (the pinned wheel ships {tr.BUNDLED_TRITON_VERSION})"
    return Component("triton", "ok", f"tritonserver {version} runs (nvidia-pytriton){note}", facts)
