"""Whether ``unroll serve`` runs a warm standby tritonserver: the mode asked for, and the memory rule of ``auto``.

A standby is a second copy of every model and of Triton's Python-backend processes; it is what keeps a lost backend
process or a dead tritonserver within the 3 s fault window (a single server must be replaced whole and reload every
model, :mod:`unroll.serving.supervisor`). ``auto`` (the default) starts it when, with the first server ready, the
memory still available is at least :data:`HEADROOM` times that server's resident memory: the copy takes about one
such share and leaves at least as much again for load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from unroll.serving.triton import group_members

#: ``auto`` starts a standby when the memory available is at least this many times the first server's resident set.
HEADROOM = 2.0
#: The environment variable that sets the mode when neither ``--standby`` nor ``--no-standby`` is given.
STANDBY_ENV = "UNROLL_STANDBY"
_ON, _OFF = ("1", "on", "true", "yes"), ("0", "off", "false", "no")
MEMINFO = Path("/proc/meminfo")
#: cgroup v2: the container's limit and its current use (``max`` when unlimited).
CGROUP_MAX, CGROUP_CURRENT = Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")


def parse_mode(value: str) -> bool | None:
    """``UNROLL_STANDBY``'s value: ``auto`` → ``None``, ``1``/``on``/``true``/``yes`` → ``True``, ``0``/``off``/
    ``false``/``no`` → ``False``; anything else raises ``ValueError`` naming the accepted values."""
    v = value.strip().lower()
    if v == "auto":
        return None
    if v in _ON or v in _OFF:
        return v in _ON
    raise ValueError(f"{STANDBY_ENV}={value!r}: use auto, 1 (on) or 0 (off)")


def resident_mb(server_pid: int) -> float:
    """Resident memory of a tritonserver and its stubs, summed (MiB; shared pages count once per process)."""
    total_kb = 0
    for pid in group_members(server_pid):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total_kb += next((int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmRSS:")), 0)
    return round(total_kb / 1024, 1)


def available_mb(meminfo: Path = MEMINFO, cgroup_max: Path = CGROUP_MAX,
                 cgroup_current: Path = CGROUP_CURRENT) -> tuple[float, str]:
    """Memory available to new processes (MiB) and where the figure comes from: the kernel's ``MemAvailable``, or
    the container's cgroup limit less its use when that is smaller (a container sees the host's ``MemAvailable``)."""
    fields = dict(ln.split(":", 1) for ln in meminfo.read_text().splitlines() if ":" in ln)
    if "MemAvailable" not in fields:
        raise OSError(f"{meminfo} has no MemAvailable (a Linux kernel before 3.14?)")
    best = (int(fields["MemAvailable"].split()[0]) / 1024, "MemAvailable")
    try:
        limit = cgroup_max.read_text().strip()
        if limit != "max":
            left = (int(limit) - int(cgroup_current.read_text().strip())) / 1024 ** 2
            best = min(best, (left, "the cgroup's memory.max less memory.current"))
    except (OSError, ValueError):
        pass  # no cgroup v2 memory controller here: MemAvailable is the figure
    return round(best[0], 1), best[1]


@dataclass(frozen=True)
class Decision:
    """``auto``'s choice and the one line that says why (printed by ``unroll serve``)."""

    on: bool
    why: str


def decide(primary_mb: float, available: float, source: str, headroom: float = HEADROOM) -> Decision:
    """The memory rule (module doc): on when ``available`` ≥ ``headroom`` × ``primary_mb``."""
    need = headroom * primary_mb
    facts = (f"tritonserver and its backend processes hold {primary_mb:,.0f} MiB resident; {available:,.0f} MiB "
             f"available ({source})")
    if available >= need:
        return Decision(True, f"{facts} ≥ {headroom:g} × that")
    return Decision(False, f"{facts} < {headroom:g} × that ({need:,.0f} MiB)")
