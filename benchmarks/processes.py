"""The service's processes by kind (gateway, tritonserver, Python-backend stubs, load client) and what each uses.

The benchmarks start Triton and the gateway as children of their own process, so the tree below it is the whole
service; each process is sorted by its command line. CPU seconds per request, per kind, is the serving figure
that carries from one machine to another (latency on 2 shared cores does not).
"""

from __future__ import annotations

import os
from pathlib import Path

from unroll.serving.process_watch import read_stat
from unroll.serving.triton import proc_stats

KINDS = ("gateway", "tritonserver", "backends", "client")


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (from ``/proc/*/stat``'s parent pids)."""
    children: dict[int, list[int]] = {}
    for ps in proc_stats():
        children.setdefault(ps.ppid, []).append(ps.pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def kind_of(pid: int, client: int | None = None) -> str | None:
    """``gateway``, ``tritonserver``, ``backends`` (stubs) or ``client`` (``client`` pid, perf_analyzer); ``None``
    once the process is gone."""
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return None
    if "python_backend_stub" in argv0:
        return "backends"
    if argv0.endswith("tritonserver"):
        return "tritonserver"
    if pid == client or "perf_analyzer" in argv0:
        return "client"
    return "gateway"


def cpu_by_pid(root: int | None = None) -> dict[int, tuple[str, float]]:
    """Every process of the tree below ``root`` (default: this process): ``{pid: (kind, CPU seconds)}``."""
    me = os.getpid()
    out = {}
    for pid in descendants(root or me):
        kind, stat = kind_of(pid, client=me), read_stat(pid)
        if kind is not None and stat is not None:
            out[pid] = (kind, stat.cpu_s)
    return out


def cpu_ms_per_request(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                       requests: int) -> dict[str, float] | None:
    """CPU milliseconds per request by kind between two :func:`cpu_by_pid` snapshots (a process that started in
    between counts from zero, one that ended is lost: both are rare within a level)."""
    if requests <= 0:
        return None
    spent = dict.fromkeys(KINDS, 0.0)
    for pid, (kind, cpu) in after.items():
        spent[kind] += cpu - before.get(pid, (kind, 0.0))[1]
    return {k: v * 1e3 / requests for k, v in spent.items()}
