"""Start and stop a real Triton Inference Server: the ``tritonserver`` binary from the nvidia-pytriton wheel.

The binary is run directly (not pytriton's in-process proxy), so the repository :mod:`unroll.serving.repository`
writes is served as the NGC container serves it; pytriton's path helpers are loaded without its heavy package import.
:func:`start` returns a :class:`TritonHandle` once every model is ready, or raises :class:`TritonStartError` with
the log's reason. No orphans: the server runs in its own process group with the parent-death signal (so it follows
the thread that started it: call :func:`start` from the main thread), and ``stop()`` escalates SIGTERM → SIGKILL and
removes the shared-memory regions of *this* server's stubs. ``api_key`` locks every API but health; it is kept off
the server's command line (:mod:`unroll.serving.hidden_args`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, TracebackType

from unroll.errors import TritonStartError
from unroll.serving import hidden_args, malloc
from unroll.serving.process_watch import ProcStat, read_stat

log = logging.getLogger("unroll.serve")

LOG_TAIL_LINES = 40
#: The server inside the pinned nvidia-pytriton wheel (pyproject.toml); the tests check the running one says so.
BUNDLED_TRITON_VERSION = "2.45.0"
#: Triton's own drain time on SIGTERM (``--exit-timeout-secs``): in-flight requests and open client
#: connections (keep-alive clients like the gateway hold one) get this long before it exits anyway.
EXIT_TIMEOUT_S = 5
#: Our wait after SIGTERM before SIGKILL: Triton's drain time plus model unloading.
STOP_GRACE_S = EXIT_TIMEOUT_S + 15.0
#: ``prctl`` option (linux/prctl.h): signal this process when its parent (thread) exits.
PR_SET_PDEATHSIG = 1
#: Header (lower case: gRPC metadata keys must be) that carries the key of a locked-down server over HTTP.
RESTRICTED_HEADER = "unroll-triton-key"
#: Over gRPC Triton expects the header under this prefix (``triton-grpc-protocol-unroll-triton-key``).
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"
#: Triton's API groups that need the key: all but ``health`` (live/ready probes stay open on loopback).
RESTRICTED_APIS = ("metadata", "inference", "shared-memory", "model-config", "model-repository", "statistics",
                   "trace", "logging")
#: How often :func:`start` asks a starting server whether it is ready (a restart's 503s last until it says so).
READY_POLL_S = 0.05
#: Starts of one server before a crash while starting is reported (:func:`start`; a refusal is reported at once).
START_ATTEMPTS = 3
#: Earlier logs kept beside the current one (``<log>.1`` is the newest).
LOG_KEEP = 5
#: Name prefix of the Python backend's shared-memory regions in ``/dev/shm``.
SHM_PREFIX = "triton_python_backend_shm_region_"
SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True)
class ServerLayout:
    """Where the pieces of the wheel's Triton live on this machine."""

    binary: Path
    backends: Path  #: backend directory holding ``python/libtriton_python.so`` and the stub
    lib_dirs: tuple[Path, ...]


@functools.cache
def _distribution() -> ModuleType:
    """``pytriton.utils.distribution`` (stdlib-only path helpers), without running ``pytriton/__init__``."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonStartError("the nvidia-pytriton wheel is not installed (pip install -e '.[serve]')")
    path = Path(next(iter(spec.submodule_search_locations))) / "utils" / "distribution.py"
    mod_spec = importlib.util.spec_from_file_location("_unroll_pytriton_distribution", path)
    if mod_spec is None or mod_spec.loader is None or not path.exists():
        raise TritonStartError(f"nvidia-pytriton has no {path}: install the version pinned in pyproject.toml")
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


def _python_libdir() -> Path | None:
    """The folder holding this interpreter's ``libpython3.X.so.1.0``, which the stub must load."""
    libdir = sysconfig.get_config_var("LIBDIR")
    soname = sysconfig.get_config_var("INSTSONAME") or f"libpython{sys.version_info[0]}.{sys.version_info[1]}.so.1.0"
    if libdir and (Path(libdir) / soname).exists():
        return Path(libdir)
    return None  # a static interpreter: the stub then falls back to the system's libpython of the same version


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK)


def _install_stub(backends: Path, stub: Path) -> Path:
    """Put the stub beside ``libtriton_python.so``; idempotent, atomic, and elsewhere when read-only.

    Returns the backend directory to use: the wheel's own when it is writable, otherwise a copy in
    the user's cache (keyed by the wheel path, so two venvs never share one).
    """
    if not _writable(backends / "python"):
        key = hashlib.sha1(str(backends).encode()).hexdigest()[:12]
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "unroll" / f"triton-backends-{key}"
        if not (cache / "python" / "libtriton_python.so").exists():
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=cache.parent))  # same filesystem: the rename below is atomic
            shutil.copytree(backends, tmp / "b")
            with contextlib.suppress(OSError):  # a concurrent start may have won the race: theirs is identical
                os.replace(tmp / "b", cache)
            shutil.rmtree(tmp, ignore_errors=True)
        backends = cache
    dst = backends / "python" / "triton_python_backend_stub"
    if not dst.exists() or dst.stat().st_size != stub.stat().st_size or dst.read_bytes() != stub.read_bytes():
        tmp_dst = dst.with_name(f".{dst.name}.{os.getpid()}")
        shutil.copy2(stub, tmp_dst)
        os.chmod(tmp_dst, 0o755)
        os.replace(tmp_dst, dst)
    return backends


def server_layout() -> ServerLayout:
    """Locate the wheel's tritonserver (pytriton's helpers) and prepare its backend directory (stub for this Python)."""
    dist = _distribution()
    ts = Path(dist.get_root_module_path()) / "tritonserver"
    binary = ts / "bin" / "tritonserver"
    if not binary.exists():
        raise TritonStartError(f"no tritonserver binary at {binary}: reinstall nvidia-pytriton")
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    stub = Path(dist.get_stub_path(version))
    if not stub.exists():
        raise TritonStartError(f"nvidia-pytriton has no Python-backend stub for Python {version} (looked in {stub})")
    backends = _install_stub(ts / "backends", stub)
    libs = Path(dist.get_libs_path())
    if not libs.is_dir():
        raise TritonStartError(f"nvidia-pytriton's server libraries are missing ({libs}): reinstall nvidia-pytriton")
    pylib = _python_libdir()
    return ServerLayout(binary, backends, (libs, pylib) if pylib is not None else (libs,))


def server_env(layout: ServerLayout) -> dict[str, str]:
    """The server's environment: its libraries, and this interpreter's packages for ``model.py``.

    The stub's embedded Python runs isolated (``PYTHONPATH`` is ignored) and finds its prefix by
    looking up ``python3`` on ``PATH``; with this interpreter's ``bin`` first, a venv's
    ``pyvenv.cfg`` is found and its site-packages (onnxruntime, NumPy) are on ``sys.path``.
    """
    env = os.environ.copy()
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*map(str, layout.lib_dirs), *filter(None, [env.get("LD_LIBRARY_PATH")])])
    env["PATH"] = os.pathsep.join([str(Path(sys.prefix) / "bin"), *filter(None, [env.get("PATH")])])
    env.update(malloc.env())  # freed tensors go back to the OS after large requests (serving/malloc.py)
    return env


def new_api_key() -> str:
    """A fresh random key for a locked-down server (:data:`RESTRICTED_HEADER`)."""
    return secrets.token_urlsafe(24)


def restricted_api_args(api_key: str) -> list[str]:
    """Triton flags that put every API but health behind ``RESTRICTED_HEADER: api_key`` on HTTP and gRPC."""
    if not re.fullmatch(r"[A-Za-z0-9_\-]+", api_key):
        raise TritonStartError("the Triton API key may hold only letters, digits, '-' and '_'")
    spec = f"{','.join(RESTRICTED_APIS)}:{RESTRICTED_HEADER}={api_key}"
    return [f"--http-restricted-api={spec}", f"--grpc-restricted-protocol={spec}"]


def rotate_log(path: Path, keep: int = LOG_KEEP) -> None:
    """Move ``path`` to ``path.1`` (and ``.1`` to ``.2`` …), dropping what is older than ``keep``."""
    if not path.exists() or path.stat().st_size == 0:
        return
    if keep <= 0:
        path.unlink()
        return
    for i in range(keep, 0, -1):
        older = path.with_name(f"{path.name}.{i}")
        if i == keep:
            older.unlink(missing_ok=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                older.rename(path.with_name(f"{path.name}.{i + 1}"))
    path.rename(path.with_name(f"{path.name}.1"))


def proc_stats() -> Iterator[ProcStat]:
    """Every process's :class:`~unroll.serving.process_watch.ProcStat` (those that exit meanwhile are skipped)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := read_stat(int(entry.name))) is not None:
            yield stat


def group_members(pgid: int, zombies: bool = False) -> dict[int, list[str]]:
    """Processes of process group ``pgid`` (Triton and its stubs): ``{pid: argv}``; zombies only if asked."""
    found: dict[int, list[str]] = {}
    for ps in proc_stats():
        if ps.pgrp != pgid or (ps.gone and not zombies):
            continue
        try:
            argv = Path(f"/proc/{ps.pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # exited meanwhile
        found[ps.pid] = [a.decode(errors="replace") for a in argv if a]
    return found


def processes_with(marker: str) -> dict[int, list[str]]:
    """Live processes (zombies and this one excluded) whose command line contains ``marker``: ``{pid: argv}``.

    How the tests, the soak and a post-mortem find what a server left (by its repository path or ``--id``).
    """
    found: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0") if a]
            state = next(ln for ln in (entry / "status").read_text().splitlines() if ln.startswith("State:"))
        except (OSError, StopIteration):
            continue  # exited meanwhile
        if "zombie" not in state and any(marker in a for a in argv):
            found[int(entry.name)] = argv
    return found


def shm_prefix(server_id: str) -> str:
    """The Python-backend shared-memory prefix of the server launched with ``--id=server_id`` (one per server)."""
    return f"{SHM_PREFIX}{server_id}_"


def shm_regions(argvs: list[list[str]]) -> set[str]:
    """The Python-backend shared-memory regions named on these command lines (a stub's second argument)."""
    return {a for argv in argvs for a in argv if a.startswith(SHM_PREFIX) and "/" not in a}


class TritonHandle:
    """A running tritonserver: its URLs, PID and log; ``stop()`` (or leaving the ``with``) ends it."""

    def __init__(self, proc: subprocess.Popen, host: str, http_port: int, grpc_port: int, metrics_port: int,
                 log_path: Path, api_key: str | None = None, server_id: str = "") -> None:
        self._proc = proc
        self.host = host
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.log_path = log_path
        self.api_key = api_key
        self.server_id = server_id
        #: Why the key is on tritonserver's command line (readable by every local user); ``None``: it is not.
        self.key_exposed: str | None = None
        #: Shared-memory regions this server's stubs have used (see :meth:`snapshot`), removed by ``stop()``.
        self.regions: set[str] = set()
        self._stopped = False
        _LIVE.add(self)

    @property
    def headers(self) -> dict[str, str]:
        """What an HTTP client must send on every non-health call (empty when the server is not locked down)."""
        return {RESTRICTED_HEADER: self.api_key} if self.api_key else {}

    @property
    def grpc_headers(self) -> dict[str, str]:
        """The same for a gRPC client (Triton prefixes the header name there)."""
        return {GRPC_HEADER_PREFIX + RESTRICTED_HEADER: self.api_key} if self.api_key else {}

    def snapshot(self) -> set[str]:
        """Record the shared-memory regions of the stubs running now (Triton restarts dead stubs under new
        names); returns every region seen so far."""
        self.regions |= shm_regions(list(group_members(self.pid).values()))
        return self.regions

    def ready(self) -> bool:
        """Triton answers ready (every model loaded) and is the server we launched."""
        return _ready(_client_host(self.host), self.http_port, self.server_id, self.headers)

    def index(self, timeout_s: float = 2.0) -> list[dict[str, str]] | None:
        """Its repository index (:func:`repository_index`), ``None`` when it does not answer within ``timeout_s``."""
        return repository_index(_client_host(self.host), self.http_port, self.headers, timeout_s)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def url(self) -> str:
        """HTTP endpoint as tritonclient wants it (``host:port``, no scheme)."""
        return f"{_client_host(self.host)}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{_client_host(self.host)}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{_client_host(self.host)}:{self.metrics_port}/metrics"

    def is_alive(self) -> bool:
        return self._proc.poll() is None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return _tail(self.log_path, lines)

    def wait(self) -> int:
        """Block until the server exits on its own; returns its exit code."""
        return self._proc.wait()

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM the server's process group, SIGKILL it after ``grace_s``; then kill the stubs a crashed
        server left, reap them when they are ours (a child subreaper), and unlink their shared memory.
        Idempotent.

        Returns tritonserver's exit code (0 after a clean shutdown, -9 when it had to be killed).
        """
        if self._stopped:  # the group id may belong to someone else by now
            return self._proc.returncode
        self.snapshot()
        if self._proc.returncode is None:
            _signal_group(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self.snapshot()  # stubs a dead server left behind still name their regions
        _signal_group(self._proc.pid, signal.SIGKILL)  # stubs left in the group after tritonserver exited
        deadline = time.monotonic() + 10.0
        while True:
            reap_children(group_members(self._proc.pid, zombies=True))
            if not group_members(self._proc.pid) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        reap_children(group_members(self._proc.pid, zombies=True))
        for name in self.regions:  # a clean shutdown removed them already; after a crash nobody else will
            with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
                (SHM_DIR / name).unlink()
        self._stopped = True
        return self._proc.returncode

    @property
    def returncode(self) -> int | None:
        """tritonserver's exit code once it has exited (and been reaped by :meth:`poll`), else ``None``."""
        return self._proc.returncode

    def poll(self) -> int | None:
        """Reap the server if it has exited; its exit code, or ``None`` while it runs."""
        return self._proc.poll()

    def __enter__(self) -> TritonHandle:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_alive() else f"exited {self._proc.returncode}"
        return f"TritonHandle(pid={self.pid}, http={self.url}, grpc={self.grpc_url}, {state})"


_LIVE: weakref.WeakSet[TritonHandle] = weakref.WeakSet()


@atexit.register
def _stop_forgotten_servers() -> None:
    """A script that exits (or dies on an exception) without ``stop()`` must not leave Triton running."""
    for handle in list(_LIVE):
        handle.stop(grace_s=5)


def reap_children(pids: Iterable[int]) -> None:
    """Reap those of ``pids`` that are our children: orphaned stubs re-parented to a child subreaper."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


_BENIGN = ("CudaDriverHelper has not been initialized",)  # logged on every CPU-only start
_LOG_PREFIX = re.compile(r"^[IWE]\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] ")


def _failure_summary(log: str) -> str:
    """Triton's reason in a few lines: the models that failed to load, else its other errors."""
    lines = log.splitlines()
    loads = [ln for ln in lines if ln.startswith("E") and "failed to load" in ln]
    errors = [ln for ln in lines if (ln.startswith("E") and not any(b in ln for b in _BENIGN))
              or ln.startswith("error:")]
    return "\n".join(dict.fromkeys(_LOG_PREFIX.sub("", ln) for ln in (loads or errors)))


def _ready(host: str, port: int, server_id: str, headers: dict[str, str] | None = None) -> bool:
    """Ready, and really ours: the server's metadata carries the ``--id`` we launched it with."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/v2/health/ready", timeout=1.0) as r:
            if r.status != 200:
                return False
        req = urllib.request.Request(f"http://{host}:{port}/v2", headers=headers or {})
        with urllib.request.urlopen(req, timeout=1.0) as r:
            return json.loads(r.read()).get("name") == server_id
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
        return False


def repository_index(host: str, port: int, headers: dict[str, str] | None = None,
                     timeout_s: float = 2.0) -> list[dict[str, str]] | None:
    """Triton's repository index (one row per model version: ``name``, ``version``, ``state``, ``reason``), or
    ``None`` when it does not answer in time."""
    try:
        req = urllib.request.Request(f"http://{host}:{port}/v2/repository/index", data=b"{}", method="POST",
                                     headers=headers or {})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            index = json.loads(r.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
        return None
    return [{k: str(m.get(k, "")) for k in ("name", "version", "state", "reason")} for m in index]


def _model_states(host: str, port: int, headers: dict[str, str] | None = None) -> str:
    """``name STATE (reason)`` for every model not READY yet, from the repository index API."""
    index = repository_index(host, port, headers)
    if index is None:
        return ""
    return ", ".join(f"{m['name']} {m.get('state', '?')}" + (f" ({m['reason']})" if m.get("reason") else "")
                     for m in index if m.get("state") != "READY")


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (bound together, so they differ), for servers on spare ports."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _check_ports_free(host: str, ports: dict[str, int]) -> None:
    """Fail early and clearly, rather than let Triton half-start next to another server."""
    if len(set(ports.values())) != len(ports):
        raise TritonStartError(f"HTTP, gRPC and metrics ports must differ, got {ports}")
    for what, port in ports.items():
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is no conflict
            try:
                s.bind((host, port))
            except OSError as e:
                raise TritonStartError(f"{what} port {port} on {host} is not available ({e.strerror}); "
                                       "stop what uses it or pick another port") from None


def start(repo: Path, http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
          host: str = "127.0.0.1", log_file: Path | None = None, timeout_s: float = 120,
          model_control: str = "none", log_verbose: int = 0, extra_args: list[str] | None = None,
          api_key: str | None = None, log_keep: int = LOG_KEEP, any_thread: bool = False) -> TritonHandle:
    """Launch tritonserver on ``repo`` and return once every model is loaded and warm.

    ``model_control`` is Triton's ``--model-control-mode`` (``none``: load everything at start,
    no load/unload API). Configs must be complete (``--disable-auto-complete-config``), so what is
    served is exactly what the repository says. ``log_file`` defaults to a new temporary file (kept
    after the server stops, for post-mortems). Ports are checked first, and readiness is only
    accepted from the server we launched (``--id``), never from another one on the same port.
    Call it from the main thread (the parent-death signal follows the thread that started Triton),
    or pass ``any_thread=True`` from a thread that outlives the server. ``api_key`` locks every API but
    health behind :data:`RESTRICTED_HEADER` (:func:`restricted_api_args`). A given ``log_file`` is rotated
    first (``log_keep`` older ones kept; 0 appends to it instead).
    A server killed by a signal while it starts (Triton 2.45's Python backend aborts at times with
    ``boost::interprocess::lock_exception`` when many stubs start at once on a loaded machine, an upstream race) is
    started again, at most :data:`START_ATTEMPTS` times in all, with a warning; a refusal (a model that does not
    load, a port in use) is not retried. Raises :class:`TritonStartError` with Triton's reason on failure.
    """
    if not any_thread and threading.current_thread() is not threading.main_thread():
        raise TritonStartError("start Triton from the main thread: it gets SIGTERM when the thread that started it "
                               "ends (the parent-death signal that stops it when this process is killed)")
    repo = Path(repo).resolve()
    if not repo.is_dir():
        raise TritonStartError(f"model repository {repo} does not exist (write it with `unroll repo`)")
    if model_control not in ("none", "poll", "explicit"):
        raise TritonStartError(f"model_control must be none, poll or explicit, not {model_control!r}")
    if log_file is None:
        fd, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
        os.close(fd)
        log_file = Path(name)
    log_file = Path(log_file).resolve()
    log_file.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, START_ATTEMPTS + 1):
        _check_ports_free(host, {"HTTP": http_port, "gRPC": grpc_port, "metrics": metrics_port})
        try:
            return _launch(repo, (http_port, grpc_port, metrics_port), host, log_file, timeout_s, model_control,
                           log_verbose, extra_args or [], api_key, log_keep)
        except TritonStartError as e:
            if not e.crashed or attempt == START_ATTEMPTS:
                raise
            log.warning("tritonserver crashed while starting (%s); starting it again (attempt %d of %d; its log: "
                        "%s)", e.reason, attempt + 1, START_ATTEMPTS, e.log_path)
    raise AssertionError("unreachable")


def _launch(repo: Path, ports: tuple[int, int, int], host: str, log_file: Path, timeout_s: float,
            model_control: str, log_verbose: int, extra_args: list[str], api_key: str | None,
            log_keep: int) -> TritonHandle:
    """One start of tritonserver (:func:`start`): launched, then waited for until ready."""
    http_port, grpc_port, metrics_port = ports
    layout = server_layout()
    server_id = f"unroll-{uuid.uuid4().hex[:12]}"
    if log_keep > 0:
        rotate_log(log_file, log_keep)
    log_offset = log_file.stat().st_size if log_file.exists() else 0  # appended: earlier runs are not this one
    cmd = _server_command(layout, server_id, repo, host, ports, model_control, log_verbose, extra_args)
    env = server_env(layout)
    how = hidden_args.launch(cmd, restricted_api_args(api_key) if api_key else [], env)  # key off /proc/PID/cmdline
    with open(log_file, "ab") as sink:
        try:
            proc = subprocess.Popen(how.command, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                                    env={**env, **how.env}, start_new_session=True,
                                    preexec_fn=_die_with_parent(os.getpid()))
        except OSError as e:
            raise TritonStartError(f"could not run {layout.binary}: {e}") from e
    handle = TritonHandle(proc, host, http_port, grpc_port, metrics_port, log_file, api_key, server_id)
    handle.key_exposed = how.exposed
    try:
        return _wait_ready(handle, proc, timeout_s, log_file, log_offset)
    except BaseException:
        handle.stop(grace_s=5)
        raise


def _server_command(layout: ServerLayout, server_id: str, repo: Path, host: str, ports: tuple[int, int, int],
                    model_control: str, log_verbose: int, extra_args: list[str]) -> list[str]:
    """tritonserver's command line: complete configs only, strict readiness, the three endpoints on ``host``."""
    http_port, grpc_port, metrics_port = ports
    return [
        str(layout.binary),
        f"--id={server_id}",
        f"--model-repository={repo}",
        f"--backend-directory={layout.backends}",
        f"--model-control-mode={model_control}",
        "--disable-auto-complete-config",
        "--strict-readiness=true",
        "--exit-on-error=true",
        f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
        "--allow-http=true", f"--http-address={host}", f"--http-port={http_port}",
        "--allow-grpc=true", f"--grpc-address={host}", f"--grpc-port={grpc_port}",
        "--allow-metrics=true", "--allow-gpu-metrics=false", f"--metrics-address={host}",
        f"--metrics-port={metrics_port}",
        "--pinned-memory-pool-byte-size=0",  # CPU-only here; avoids a CUDA host allocation attempt
        f"--log-verbose={log_verbose}",
        # The Python backend names its /dev/shm regions prefix + a counter: two servers started at once on one
        # machine took the same names (boost::interprocess::lock_exception at start) unless each has its own.
        f"--backend-config=python,shm-region-prefix-name={shm_prefix(server_id)}",
        *extra_args,
    ]


def _wait_ready(handle: TritonHandle, proc: subprocess.Popen, timeout_s: float, log_file: Path,
                log_offset: int) -> TritonHandle:
    """Poll the server we launched until every model is ready; its exit or the deadline raises with the log's reason."""
    deadline = time.monotonic() + timeout_s
    client_host = _client_host(handle.host)
    while True:
        if proc.poll() is not None:
            raise _start_failure(f"tritonserver exited with code {proc.returncode}", log_file, log_offset,
                                 crashed=proc.returncode < 0)
        handle.snapshot()
        if handle.ready():
            handle.snapshot()
            return handle
        if time.monotonic() > deadline:
            states = _model_states(client_host, handle.http_port, handle.headers)
            raise _start_failure(f"tritonserver was not ready after {timeout_s:g} s ("
                                 + (f"models: {states}" if states else "still loading or warming up models; "
                                    "raise timeout_s if they are just slow") + ")", log_file, log_offset)
        time.sleep(READY_POLL_S)


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A ``preexec_fn``: in the forked child, ask for SIGTERM when ``parent`` dies, then exec Triton.

    ``libc.prctl`` is resolved before the fork (the child only calls it). If the parent died between
    fork and ``prctl``, the signal would never come: ``getppid()`` then names another process, and the
    child exits instead of starting an orphan server.
    """
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def child() -> None:
        if prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            os.write(2, b"error: prctl(PR_SET_PDEATHSIG) failed; not starting a server that could outlive its parent\n")
            os._exit(126)
        if os.getppid() != parent:
            os.write(2, b"error: the process starting tritonserver exited before it ran\n")
            os._exit(125)

    return child


def _start_failure(what: str, log_file: Path, offset: int, crashed: bool = False) -> TritonStartError:
    with open(log_file, "rb") as f:
        f.seek(offset)
        log = f.read().decode(errors="replace")
    why = _failure_summary(log) or "(no error logged)"
    tail = "\n".join(log.splitlines()[-LOG_TAIL_LINES:])
    # a model that failed to load is a refusal, even when the server then died by a signal on its way out
    refused = any(ln.startswith("E") and "failed to load" in ln for ln in log.splitlines())
    return TritonStartError(f"{what}: {why}\n--- last {LOG_TAIL_LINES} lines of {log_file} ---\n{tail}",
                            reason=f"{what}: {why}", log_path=log_file, crashed=crashed and not refused)
