"""Where a profile level's time went: what the deployment itself reports, read before and after the level.

Each observer is started before a level and stopped after it with the level's request count, and answers a dict
for the level's row (``None``: nothing to report this level):

- :class:`TritonStats`: Triton's statistics of the model (HTTP ``/v2/models/M/stats`` on Triton or through the
  gateway's ``/v2`` front, or Triton's gRPC port): queue, compute input / infer / output per request, executed
  batch sizes (the dynamic batcher's real batches).
- :class:`GatewayMetrics`: the gateway's own Prometheus counters (``/metrics``): requests by route and status, the
  gateway's mean time per request, its Triton calls and the items each carried, refusals and cancellations.
- :class:`ServiceCpu`: CPU seconds per request of each local process of the deployment (``unroll serve``'s
  supervisor, gateway workers, tritonserver, backend stubs), found from the process listening on the URL's port;
  a remote deployment's processes cannot be seen from here, and the profile says so.
- :class:`Gpu`: GPU utilisation and memory through NVML (:mod:`.nvml`), where a GPU is present.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from unroll.benchmarks.nvml import GpuSampler
from unroll.benchmarks.processes import descendants, kind_of
from unroll.benchmarks.serve_triton import stats_delta
from unroll.serving.process_watch import read_stat

#: The gateway routes whose counts are its own bookkeeping, not the profiled requests.
_QUIET_ROUTES = ("/metrics", "/v1/models", "/health", "/v2/models/{model}/stats", "/v2/models/{model}/versions")


class Observer:
    """Read before a level (:meth:`start`) and after it (:meth:`stop`); :attr:`why_absent` when it cannot."""

    name = ""
    why_absent: str | None = None

    def start(self) -> None:
        return None

    def stop(self, requests: int) -> dict[str, Any] | None:
        return None


# ------------------------------------------------------------------------------------------- Triton statistics


def sum_versions(stats: list[dict]) -> dict:
    """Triton's per-version statistics summed: ``{"inference_stats": {name: {count, ns}}, "batch_stats": {bs: …}}``."""
    inf: dict[str, dict[str, int]] = {}
    batches: dict[int, dict[str, int]] = {}
    for v in stats:
        for name, d in (v.get("inference_stats") or {}).items():
            acc = inf.setdefault(name, {"count": 0, "ns": 0})
            acc["count"] += int(d.get("count", 0))
            acc["ns"] += int(d.get("ns", 0))
        for b in v.get("batch_stats") or []:
            acc = batches.setdefault(int(b["batch_size"]), {"count": 0, "ns": 0})
            acc["count"] += int(b.get("compute_infer", {}).get("count", 0))
            acc["ns"] += int(b.get("compute_infer", {}).get("ns", 0))
    return {"inference_stats": inf, "batch_stats": batches,
            "execution_count": sum(int(v.get("execution_count", 0)) for v in stats),
            "inference_count": sum(int(v.get("inference_count", 0)) for v in stats)}


def triton_stats_delta(before: dict | None, after: dict | None) -> dict | None:
    """What Triton did over a level: :func:`~unroll.benchmarks.serve_triton.stats_delta`'s split (requests,
    executions, mean ms per request of queue / compute input / infer / output, average batch) and the batch sizes
    executed (``{size: executions}``)."""
    out = stats_delta(before, after)
    if out is None or before is None or after is None:
        return out
    sizes = {}
    for bs, a in after["batch_stats"].items():
        n = a["count"] - before["batch_stats"].get(bs, {"count": 0})["count"]
        if n > 0:
            sizes[str(bs)] = n
    out["batch_sizes"] = sizes
    return out


def http_stats_reader(url: str, model: str, headers: dict[str, str], timeout_s: float = 5.0
                      ) -> Callable[[], dict | None]:
    """Reads ``GET URL/v2/models/MODEL/stats`` (Triton's HTTP port, or the gateway's ``/v2`` front), summed."""
    def read() -> dict | None:
        try:
            r = httpx.get(f"{url.rstrip('/')}/v2/models/{model}/stats", headers=headers, timeout=timeout_s)
            stats = r.json()["model_stats"] if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError):
            return None
        return sum_versions(stats) if stats else None

    return read


def grpc_stats_reader(url: str, model: str, headers: dict[str, str], timeout_s: float = 5.0
                      ) -> Callable[[], dict | None]:
    """Reads Triton's statistics of ``model`` from its gRPC port (``grpc://host:port``), summed."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from unroll.serving.gateway.triton_client import proto_json

    def read() -> dict | None:
        client = grpcclient.InferenceServerClient(url.removeprefix("grpc://"))
        try:
            stats = client.get_inference_statistics(model, headers=headers, client_timeout=timeout_s)
        except InferenceServerException:
            return None
        finally:
            client.close()
        return sum_versions(proto_json(stats)["model_stats"])

    return read


class TritonStats(Observer):
    """Triton's statistics deltas of the model over the level."""

    name = "triton"

    def __init__(self, read: Callable[[], dict | None]) -> None:
        self.read = read
        self._before: dict | None = None

    def start(self) -> None:
        self._before = self.read()

    def stop(self, requests: int) -> dict[str, Any] | None:
        return triton_stats_delta(self._before, self.read())


# ----------------------------------------------------------------------------------------------- gateway metrics


def read_metrics(url: str, headers: dict[str, str], timeout_s: float = 5.0) -> dict[tuple, float] | None:
    """The gateway's ``/metrics`` as ``{(sample name, sorted labels): value}`` (``None``: unreadable)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = httpx.get(f"{url.rstrip('/')}/metrics", headers=headers, timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def metrics_delta(before: dict[tuple, float], after: dict[tuple, float], model: str) -> dict[str, Any]:
    """The gateway's work over a level: requests by route and status with its mean ms per request, its Triton calls
    for ``model`` (count, mean ms, outcomes) and the mean items each carried, refusals, rate limiting, cancellations."""
    def d(key: tuple) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    routes: dict[str, dict[str, Any]] = {}
    triton: dict[str, float] = {"calls": 0.0, "seconds": 0.0}
    outcomes: dict[str, float] = {}
    items = {"count": 0.0, "sum": 0.0}
    other: dict[str, float] = {}
    for key in after:
        name, labels = key[0], dict(key[1])
        n = d(key)
        if n <= 0:
            continue
        route = labels.get("route", "")
        if name == "unroll_gateway_requests_total" and route not in _QUIET_ROUTES:
            r = routes.setdefault(route, {"requests": 0.0, "by_status": {}})
            r["requests"] += n
            r["by_status"][labels.get("status", "")] = r["by_status"].get(labels.get("status", ""), 0.0) + n
        elif name.startswith("unroll_gateway_request_duration_seconds_") and route not in _QUIET_ROUTES:
            r = routes.setdefault(route, {"requests": 0.0, "by_status": {}})
            if name.endswith("_sum"):
                r["seconds"] = r.get("seconds", 0.0) + n
            elif name.endswith("_count"):
                r["timed"] = r.get("timed", 0.0) + n
        elif name.startswith("unroll_gateway_triton_request_duration_seconds_") and labels.get("model") == model:
            if name.endswith("_sum"):
                triton["seconds"] += n
            elif name.endswith("_count"):
                triton["calls"] += n
                outcomes[labels.get("outcome", "")] = outcomes.get(labels.get("outcome", ""), 0.0) + n
        elif name.startswith("unroll_gateway_batch_items_") and labels.get("model") == model:
            if name.endswith("_sum"):
                items["sum"] += n
            elif name.endswith("_count"):
                items["count"] += n
        elif name in ("unroll_gateway_rate_limited_total", "unroll_gateway_cancelled_total",
                      "unroll_gateway_http_refused_total"):
            other[name.removeprefix("unroll_gateway_").removesuffix("_total")] = other.get(name, 0.0) + n
    by_route = {}
    for route, r in routes.items():
        if not r["requests"]:
            continue
        timed = r.get("timed", 0.0)
        by_route[route] = {"requests": int(r["requests"]), "by_status": {k: int(v) for k, v in r["by_status"].items()},
                           "mean_ms": 1e3 * r.get("seconds", 0.0) / timed if timed else None}
    out: dict[str, Any] = {"routes": by_route}
    if triton["calls"]:
        out["triton_calls"] = int(triton["calls"])
        out["triton_call_mean_ms"] = 1e3 * triton["seconds"] / triton["calls"]
        out["triton_outcomes"] = {k: int(v) for k, v in outcomes.items()}
    if items["count"]:
        out["items_per_triton_call"] = items["sum"] / items["count"]
    out.update({k: int(v) for k, v in other.items()})
    return out


class GatewayMetrics(Observer):
    """The gateway's own counters over the level (:func:`metrics_delta`)."""

    name = "gateway"

    def __init__(self, url: str, model: str, headers: dict[str, str]) -> None:
        self.url, self.model, self.headers = url, model, headers
        self._before: dict[tuple, float] | None = None
        if read_metrics(url, headers) is None:
            self.why_absent = f"{url.rstrip('/')}/metrics cannot be read"

    def start(self) -> None:
        self._before = read_metrics(self.url, self.headers) if self.why_absent is None else None

    def stop(self, requests: int) -> dict[str, Any] | None:
        after = read_metrics(self.url, self.headers) if self._before is not None else None
        return None if after is None or self._before is None else metrics_delta(self._before, after, self.model)


# ------------------------------------------------------------------------------------------ local processes' CPU


def is_local(host: str) -> bool:
    """Whether ``host`` is this machine (loopback, or an address of this host's name)."""
    try:
        addrs = {a[4][0] for a in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    mine = {"127.0.0.1", "::1"}
    try:
        mine |= {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        pass
    return any(ipaddress.ip_address(a.split("%")[0]).is_loopback or a in mine for a in addrs)


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
    return inodes


def listener_pids(port: int) -> list[int]:
    """The processes holding a socket listening on ``port`` (several where workers share it)."""
    wanted = {f"socket:[{i}]" for i in _listening_inodes(port)}
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in wanted for fd in (entry / "fd").iterdir()):
                pids.append(int(entry.name))
        except OSError:
            continue
    return sorted(pids)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


_SUPERVISOR = re.compile(r"\bunroll(\.app(\.cli)?)?\b.*\bserve\b")


def service_root(pid: int) -> int:
    """The deployment ``pid`` belongs to: the ``unroll serve`` supervisor above it, else the topmost of its
    ancestors that also listens for it, else ``pid`` itself."""
    me = {os.getpid(), os.getppid()}
    stat = read_stat(pid)
    root = pid
    while stat is not None and stat.ppid > 1 and stat.ppid not in me:
        if _SUPERVISOR.search(_cmdline(stat.ppid)):
            return stat.ppid
        stat = read_stat(stat.ppid)
    return root


class ServiceCpu(Observer):
    """CPU ms per request of each kind of local process serving the URL (``unroll serve``'s whole tree)."""

    name = "service_cpu"

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
        self.root: int | None = None
        if not is_local(host):
            self.why_absent = f"{host} is not this machine: its processes cannot be read from here"
            return
        pids = listener_pids(port)
        if not pids:
            self.why_absent = f"no process of this machine visibly listens on port {port} (another user's?)"
            return
        self.root = service_root(pids[0])
        self._before: dict[int, tuple[str, float]] = {}

    def snapshot(self) -> dict[int, tuple[str, float]]:
        assert self.root is not None
        out = {}
        for pid in descendants(self.root):
            stat = read_stat(pid)
            if pid == self.root and _SUPERVISOR.search(_cmdline(pid)) or "resource_tracker" in _cmdline(pid):
                kind = "supervisor"  # unroll serve itself, and the bookkeeping process its workers' spawning starts
            else:
                kind = kind_of(pid)
            if stat is not None and kind is not None:
                out[pid] = (kind, stat.cpu_s)
        return out

    def start(self) -> None:
        if self.root is not None:
            self._before = self.snapshot()

    def stop(self, requests: int) -> dict[str, Any] | None:
        if self.root is None or requests <= 0:
            return None
        spent: dict[str, float] = {}
        count: dict[str, int] = {}
        for pid, (kind, cpu) in self.snapshot().items():
            spent[kind] = spent.get(kind, 0.0) + cpu - self._before.get(pid, (kind, 0.0))[1]
            count[kind] = count.get(kind, 0) + 1
        return {"cpu_ms_per_request": {k: 1e3 * v / requests for k, v in sorted(spent.items())},
                "processes": dict(sorted(count.items())),
                "total_cpu_ms_per_request": 1e3 * sum(spent.values()) / requests}


# ------------------------------------------------------------------------------------------------------- GPU


class Gpu(Observer):
    """GPU 0's utilisation and memory over the level (a local GPU: the deployment's, when it is on this machine)."""

    name = "gpu"

    def __init__(self) -> None:
        self.sampler = GpuSampler()
        self.why_absent = self.sampler.why_absent

    def start(self) -> None:
        self.sampler.start()

    def stop(self, requests: int) -> dict[str, Any] | None:
        return self.sampler.stop()


# ------------------------------------------------------------------------------------------------- the set


def observers_for(target: str, url: str, model: str, key: str | None = None, triton_url: str | None = None,
                  triton_key: str | None = None) -> list[Observer]:
    """What a profile of ``model`` at ``url`` can read around each level: Triton's statistics (from ``triton_url``,
    else from the URL itself: Triton direct, or the gateway's ``/v2`` front, which serves them behind its key), the
    gateway's metrics (a gateway target), the local processes' CPU and the GPU (a deployment on this machine)."""
    from unroll.benchmarks.profile_target import key_headers

    triton_key = triton_key or (key if target == "triton" else None)
    stats_url, stats_headers = (triton_url, key_headers("triton", triton_key, triton_url)) if triton_url else \
        (url, key_headers(target, key, url))
    read = grpc_stats_reader if stats_url.startswith("grpc://") else http_stats_reader
    out: list[Observer] = [TritonStats(read(stats_url, model, stats_headers))]
    if target in ("v1", "v2"):
        out.append(GatewayMetrics(url, model, key_headers(target, key)))
    cpu = ServiceCpu(url)
    out.append(cpu)
    if cpu.root is not None:
        out.append(Gpu())
    return out
