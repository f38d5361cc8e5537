"""Keep a tritonserver running for ``unroll serve``: notice when it dies or hangs, clean up, restart it.

:class:`TritonSupervisor` owns the server from a thread of its own (Triton's parent-death signal follows the thread
that started it). It is woken the moment the server or one of its Python-backend stubs exits
(:class:`~unroll.serving.process_watch.ExitWatch`) and probes readiness; it then kills and reaps what is left,
removes that server's shared-memory regions, and starts a new server on the same ports after a growing back-off,
giving up (``on_give_up``) after ``max_restarts`` within ``window_s``. A dead stub replaces the whole server,
because Triton 2.45's in-place stub restart reuses the dead stub's unmapped shared memory (issue 22; unloading and
reloading only that model does not help: requests already queued for the dead instance reach it, and Triton
crashes the same way). The gateway reconnects by itself and answers 503 with ``Retry-After`` meanwhile, or, with a
warm standby (``unroll serve``'s default where the memory allows it, :mod:`unroll.serving.standby`), sends its calls
to the second server, which a supervisor of its own keeps running.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from unroll.errors import TritonStartError
from unroll.serving.process_watch import ExitWatch, read_stat
from unroll.serving.triton import STOP_GRACE_S, TritonHandle, group_members, reap_children

log = logging.getLogger("unroll.serve")

#: ``prctl`` option (linux/prctl.h): orphaned descendants are re-parented to this process, not PID 1.
PR_SET_CHILD_SUBREAPER = 36
#: The Python backend's per-instance process (:func:`is_stub`).
STUB_BINARY = "triton_python_backend_stub"
#: Grace (SIGTERM → SIGKILL) when stopping a server that crashed or hung, and when one lost a stub (none: its
#: in-flight work cannot finish cleanly, and every moment it lives is a moment more of 503s).
CRASHED_GRACE_S, STUB_LOST_GRACE_S = 5.0, 0.0
#: A stub started this long before another of the same instance exited was there first: a reload, not a restart.
RELOAD_MARGIN_S = 0.2
#: How long the second request for Triton's repository index may take, when a stub exited and the first went
#: unanswered (a real loss is answered at once: Triton itself is fine then).
INDEX_RETRY_S = 5.0


def stub_name(argv: list[str]) -> str:
    """The model instance a Python-backend stub serves (``csc-denoiser_0_0``; its arguments are the model's
    ``<repo>/<model>/<version>/model.py``, …, the instance name, the runtime)."""
    model = next((Path(a).parent.parent.name for a in argv[1:] if a.endswith(".py")), None)
    instance = next((a for a in argv[2:] if model and a.startswith(f"{model}_")), None)
    return instance or model or " ".join(argv)[:80]


def stub_version(argv: list[str]) -> tuple[str, str] | None:
    """The model and version a Python-backend stub serves, from its ``<repo>/<model>/<version>/model.py``."""
    path = next((Path(a) for a in argv[1:] if a.endswith(".py")), None)
    return (path.parent.parent.name, path.parent.name) if path is not None else None


def is_stub(argv: list[str]) -> bool:
    """A model instance's stub: the stub binary with the model's ``model.py``. Not the bare stub binary that Triton's
    Python backend runs once (``sh -c "<stub> > /dev/null 2>&1"``) to check it can start, which exits at once, and
    not the ``bash -c "exec <stub> …"`` that becomes the stub a moment later."""
    return bool(argv) and argv[0].endswith(STUB_BINARY) and stub_version(argv) is not None


def planned_exit(argv: list[str], pid: int, index: list[dict[str, str]] | None, members: dict[int, list[str]],
                 exited_by_s: float) -> bool:
    """Whether a stub that exited (``pid``, ``argv``) was ended by Triton on purpose, not lost.

    Planned: its model version is no longer loaded (``index``: Triton's repository index; unloading or gone), or
    Triton had already started another stub for the same instance before this one exited (a reload, e.g. `unroll
    deploy` changing the traffic split: new instances load and warm up, then the old ones end). A stub Triton starts
    *after* a death (its in-place restart, unsafe in 2.45) does not count: it started after ``exited_by_s``, less
    :data:`RELOAD_MARGIN_S`. Unknown (no index: Triton does not answer) is not planned."""
    where = stub_version(argv)
    if where is None:
        return False
    model, version = where
    name = stub_name(argv)
    for other, other_argv in members.items():  # a reload: needs no answer from Triton
        if other == pid or not is_stub(other_argv):
            continue
        if stub_name(other_argv) == name and stub_version(other_argv) == where:
            stat = read_stat(other)
            if stat is not None and not stat.gone and stat.started_s < exited_by_s - RELOAD_MARGIN_S:
                return True
    if index is None:
        return False
    return "READY" not in {r["state"] for r in index if r["name"] == model and r["version"] == version}


def busy_on_purpose(index: list[dict[str, str]] | None) -> bool:
    """Triton is loading or unloading a model version (``unroll deploy``, a slow warm-up): unready, yet not hung."""
    return index is not None and any(r["state"] in ("LOADING", "UNLOADING") for r in index)


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (a crashed Triton's stubs); ``False`` if refused."""
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    return False


def describe_exit(code: int | None) -> str:
    """``exited with code 1`` / ``was killed by SIGKILL`` for a ``Popen.returncode``."""
    if code is None:
        return "is still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


class TritonSupervisor:
    """Runs ``launch()`` (which returns a ready :class:`TritonHandle`) and keeps its server alive; see the module doc.

    ``launch`` must accept being called from the supervisor's thread (``triton.start(..., any_thread=True)``).
    """

    def __init__(self, launch: Callable[[], TritonHandle], *,
                 backoff_s: Sequence[float] = (0, 0.5, 1, 2, 4, 8, 15, 30),
                 max_restarts: int = 10, window_s: float = 600.0, stable_s: float = 60.0,
                 probe_every_s: float = 0.5, unready_restart_s: float = 20.0, restart_on_stub_exit: bool = True,
                 on_give_up: Callable[[str], None] | None = None, name: str = "tritonserver") -> None:
        if not backoff_s or min(backoff_s) < 0 or max_restarts < 0:
            raise ValueError("backoff_s must be non-empty and non-negative, max_restarts >= 0")
        self._launch = launch
        #: How the log names this server (``unroll serve --standby`` runs two supervisors).
        self.name = name
        self.backoff_s, self.max_restarts, self.window_s = tuple(backoff_s), max_restarts, window_s
        self.stable_s, self.probe_every_s, self.unready_restart_s = stable_s, probe_every_s, unready_restart_s
        self.restart_on_stub_exit = restart_on_stub_exit
        self._on_give_up = on_give_up
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle: TritonHandle | None = None
        #: Processes of stopped servers not yet seen gone (a stub can outlive its server's stop by a moment).
        self._leftovers: set[int] = set()
        self._first_error: BaseException | None = None
        #: Restarts done so far (successful launches after the first).
        self.restarts = 0
        #: Why the supervisor gave up, once it has.
        self.gave_up: str | None = None

    @property
    def handle(self) -> TritonHandle | None:
        """The server running now (``None`` between a crash and its restart)."""
        return self._handle

    def start(self) -> TritonHandle:
        """Launch the first server (errors raise here, as from ``launch``) and start watching it."""
        if self._thread is not None:
            raise RuntimeError("the supervisor is already running")
        become_subreaper()
        self._thread = threading.Thread(target=self._run, name="triton-supervisor", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._first_error is not None:
            self._thread.join()
            raise self._first_error
        assert self._handle is not None
        return self._handle

    def stop(self) -> None:
        """Stop watching and stop the server (from the supervisor's thread, which started it); idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(STOP_GRACE_S + 30)

    def __enter__(self) -> TritonSupervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- the supervisor's thread

    def _run(self) -> None:
        try:
            self._handle = self._launch()
        except BaseException as e:  # reported by start() in the caller's thread
            self._first_error = e
            self._started.set()
            return
        self._started.set()
        handle: TritonHandle | None = self._handle
        crashes: deque[float] = deque()
        in_a_row = 0
        try:
            while not self._stop.is_set():
                if handle is not None:
                    up_since = time.monotonic()
                    watched = self._watch(handle)
                    if watched is None:  # asked to stop
                        break
                    reason, grace_s = watched
                    self._handle = None
                    if grace_s == 0:  # the server still runs: end it before reading its log
                        handle.stop(grace_s=grace_s)
                    log.warning("%s (pid %d) %s; last lines of its log %s:\n%s", self.name, handle.pid, reason,
                                handle.log_path, handle.log_tail(15))
                    handle.stop(grace_s=grace_s)
                    self._leftovers |= set(group_members(handle.pid, zombies=True))
                    log.warning("%s (pid %d): stopped what was left of its process group and removed its "
                                "shared memory (%d regions)", self.name, handle.pid, len(handle.regions))
                    handle = None
                    if time.monotonic() - up_since >= self.stable_s:
                        in_a_row = 0
                now = time.monotonic()
                crashes.append(now)
                while crashes and now - crashes[0] > self.window_s:
                    crashes.popleft()
                if len(crashes) > self.max_restarts:
                    self._give_up(f"{self.name} failed {len(crashes)} times within {self.window_s:g} s; "
                                  "not restarting it again")
                    break
                delay = self.backoff_s[min(in_a_row, len(self.backoff_s) - 1)]
                in_a_row += 1
                log.warning("restarting %s in %g s (restart %d; at most %d within %g s)", self.name, delay,
                            len(crashes), self.max_restarts, self.window_s)
                if self._stop.wait(delay):
                    break
                t0 = time.monotonic()
                try:
                    handle = self._launch()
                except TritonStartError as e:
                    log.error("%s did not restart: %s", self.name, e.reason)
                    continue
                self._handle = handle
                self.restarts += 1
                log.warning("%s restarted (pid %d) and ready in %.1f s", self.name, handle.pid,
                            time.monotonic() - t0)
        except BaseException:
            log.exception("the Triton supervisor failed")
            self._give_up("the Triton supervisor failed (see the traceback above)")
        finally:
            if handle is not None:
                handle.stop()
            self._handle = None

    def _watch(self, handle: TritonHandle) -> tuple[str, float] | None:
        """Block until the server exits (reaped here), loses a stub, or stays unready too long: why, and the grace
        to stop it with; ``None`` once asked to stop."""
        unready_since: float | None = None
        stubs: dict[int, list[str]] = {}  # pid → argv
        next_probe = time.monotonic()
        with ExitWatch() as watch:
            watch.add([handle.pid])
            while not self._stop.is_set():
                exited = watch.wait(max(0.0, next_probe - time.monotonic()))
                code = handle.wait() if handle.pid in exited else handle.poll()  # exited: the wait returns at once
                if code is not None:
                    return describe_exit(code), CRASHED_GRACE_S
                lost = sorted(p for p in exited if p in stubs)
                if lost:
                    lost = self._crashed(handle, stubs, lost, watch)
                if lost:
                    names = ", ".join(f"{stub_name(stubs[p])} (pid {p})" for p in lost)
                    return (f"lost its Python-backend stub {names}; replacing the server (Triton 2.45's in-place "
                            "stub restart uses the dead stub's unmapped shared memory)", STUB_LOST_GRACE_S)
                if time.monotonic() < next_probe:
                    continue
                next_probe = time.monotonic() + self.probe_every_s
                self._reap_leftovers(keep=handle.pid)
                handle.snapshot()
                if self.restart_on_stub_exit:
                    fresh = {p: a for p, a in group_members(handle.pid).items()
                             if p != handle.pid and p not in watch.pids and is_stub(a)}
                    stubs.update(fresh)
                    watch.add(fresh)
                if handle.ready() or busy_on_purpose(handle.index()):
                    unready_since = None  # a load takes as long as it takes (a TensorRT build: minutes)
                    continue
                now = time.monotonic()
                unready_since = unready_since if unready_since is not None else now
                if now - unready_since >= self.unready_restart_s:
                    return f"has not been ready for {now - unready_since:.0f} s", CRASHED_GRACE_S
        return None

    def _crashed(self, handle: TritonHandle, stubs: dict[int, list[str]], exited: list[int],
                 watch: ExitWatch) -> list[int]:
        """Of the stubs that ``exited``, those lost (:func:`planned_exit` says which Triton ended on purpose: an
        unload or reload, after which nothing is replaced); the planned ones are forgotten."""
        exited_by = time.clock_gettime(time.CLOCK_BOOTTIME)
        members = group_members(handle.pid)
        # A Triton slow to answer (a loaded machine, a long reload) is asked once more before a loss is called.
        index = handle.index()
        if index is None:  # (an empty index is an answer)
            index = handle.index(timeout_s=INDEX_RETRY_S)
        planned = [p for p in exited if planned_exit(stubs[p], p, index, members, exited_by)]
        for p in planned:
            log.info("%s ended the Python-backend stub %s (pid %d) on purpose (its model was unloaded or "
                     "reloaded); nothing to replace", self.name, stub_name(stubs[p]), p)
            stubs.pop(p)
        watch.forget(planned)
        return [p for p in exited if p not in planned]

    def _reap_leftovers(self, keep: int) -> None:
        """Reap (we are their subreaper) what stopped servers left that has exited since; forget what is gone.
        ``keep``: the running server's pid, never waited for here (a reused pid must not steal its exit status)."""
        self._leftovers.discard(keep)
        if self._leftovers:
            reap_children(self._leftovers)
            self._leftovers = {p for p in self._leftovers if Path(f"/proc/{p}").exists()}

    def _give_up(self, why: str) -> None:
        self.gave_up = why
        log.error("%s", why)
        if self._on_give_up is not None:
            self._on_give_up(why)
