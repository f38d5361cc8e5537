"""Wake up the moment one of a few processes exits (the supervisor's tritonserver and its Python-backend stubs).

Polling ``/proc`` twice a second noticed a dead process up to half a second late, and the supervisor now
restarts Triton when one of its stubs dies (see :mod:`unroll.serving.supervisor`), so every tenth of a second
of that delay was a tenth of a second more of 503s. A *pidfd* (``os.pidfd_open``, Linux ≥ 5.3) becomes
readable when its process exits, whether or not it is our child, so :meth:`ExitWatch.wait` blocks in
``poll(2)`` and returns at once, costing nothing while everything runs. Where pidfds are missing (older
kernels, other systems) it falls back to checking ``/proc/<pid>/stat`` every :data:`FALLBACK_TICK_S`.

An exited process counts as exited while it is a zombie (nobody reaped it yet), as tritonserver's dead
stubs are until Triton or we reap them.
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

#: How often the fallback (no pidfd) looks at ``/proc``.
FALLBACK_TICK_S = 0.05


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/PID/stat`` the process checks need."""

    pid: int
    state: str  # R, S, D, Z (zombie), X (dead), ...
    ppid: int
    pgrp: int
    #: user + system CPU seconds used so far (fields 14 and 15, in clock ticks)
    cpu_s: float
    #: when it started, in seconds since boot (field 22; compare with ``time.clock_gettime(CLOCK_BOOTTIME)``)
    started_s: float = 0.0

    @property
    def gone(self) -> bool:
        return self.state in ("Z", "X")


def read_stat(pid: int) -> ProcStat | None:
    """``/proc/<pid>/stat`` parsed, or ``None`` once the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ... (field 3 on)
        return ProcStat(pid, fields[0], int(fields[1]), int(fields[2]),
                        (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS, int(fields[19]) / _CLOCK_TICKS)
    except (OSError, ValueError, IndexError):
        return None


def has_exited(pid: int) -> bool:
    """The process is gone or a zombie (``/proc/<pid>/stat`` state Z or X)."""
    stat = read_stat(pid)
    return stat is None or stat.gone


class ExitWatch:
    """The processes added; :meth:`wait` returns those that have exited since they were added."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}  # pid → pidfd
        self._polled: set[int] = set()  # pids watched through /proc (no pidfd)
        self._exited: set[int] = set()
        self._poll = select.poll()

    def add(self, pids: Iterable[int]) -> None:
        """Watch ``pids`` too (one already watched is ignored; one already gone counts as exited)."""
        for pid in pids:
            if pid in self._fds or pid in self._polled or pid in self._exited:
                continue
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._exited.add(pid)
                continue
            except (OSError, AttributeError):  # no pidfd here: look at /proc instead
                self._polled.add(pid)
                continue
            self._fds[pid] = fd
            self._poll.register(fd, select.POLLIN)

    def forget(self, pids: Iterable[int]) -> None:
        """Stop watching ``pids`` (exited ones the caller has dealt with), so :meth:`wait` blocks again."""
        for pid in pids:
            fd = self._fds.pop(pid, None)
            if fd is not None:
                self._poll.unregister(fd)
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._polled.discard(pid)
            self._exited.discard(pid)

    @property
    def pids(self) -> set[int]:
        return {*self._fds, *self._polled, *self._exited}

    def wait(self, timeout_s: float) -> set[int]:
        """Block until a watched process exits or ``timeout_s`` passes; every watched pid that has exited."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            self._collect(0)
            left = deadline - time.monotonic()
            if self._exited or left <= 0:
                return set(self._exited)
            self._collect(min(left, FALLBACK_TICK_S) if self._polled else left)

    def _collect(self, timeout_s: float) -> None:
        by_fd = {fd: pid for pid, fd in self._fds.items()}
        for fd, _ in self._poll.poll(timeout_s * 1000 if self._fds else 0):
            self._exited.add(by_fd[fd])
        if not self._fds and timeout_s > 0:
            time.sleep(timeout_s)
        self._exited |= {p for p in self._polled if has_exited(p)}

    def close(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()

    def __enter__(self) -> ExitWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
