"""The latency one endpoint adds over another, measured in pairs: one request to each, back to back, over and over.

A small difference (tens of microseconds on a request of half a millisecond) is lost in the drift of a shared
machine when each side is measured in its own stretch of time: the two stretches see different loads. Here each
pair's two requests are a few hundred microseconds apart, so drift falls on both, and the median of the per-pair
differences estimates what the second endpoint adds; which goes first alternates, so neither is always the one that
finds a warm cache. Requests go one at a time (concurrency 1) on a kept-alive connection per endpoint, from this
process (``http.client``): its own overhead is in both latencies and cancels in the difference. The confidence
interval of that median is the distribution-free one from order statistics (the binomial ranks around ``n / 2``).

:func:`latencies` times one endpoint alone the same way, and :func:`mean_ci` is the interval of a mean of a few
independent differences (one per whole-server run, :mod:`~unroll.benchmarks.ood_served`).
"""

from __future__ import annotations

import http.client
import math
import socket
import time
from dataclasses import dataclass
from statistics import NormalDist
from urllib.parse import urlsplit

import numpy as np

from unroll.errors import BenchError


@dataclass(frozen=True)
class Endpoint:
    """One POST: where, what, and its headers (the content type among them)."""

    url: str
    body: bytes
    headers: dict[str, str]


class _Client:
    """A kept-alive connection to one endpoint that times each POST (ns) and refuses an answer other than 200."""

    def __init__(self, endpoint: Endpoint, timeout_s: float) -> None:
        parts = urlsplit(endpoint.url)
        self.endpoint, self.path = endpoint, parts.path + (f"?{parts.query}" if parts.query else "")
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)

    def post(self) -> int:
        e = self.endpoint
        if self.conn.sock is None:  # first, or the server closed it: connect outside the timing
            self.conn.connect()
            self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each request sent as written
        start = time.perf_counter_ns()
        self.conn.request("POST", self.path, e.body, e.headers)
        response = self.conn.getresponse()
        answer = response.read()
        took = time.perf_counter_ns() - start
        if response.status != 200:
            raise BenchError(f"{e.url} answered {response.status}: {answer[:300]!r}")
        return took

    def close(self) -> None:
        self.conn.close()


def median_ci(values: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval for the median of ``values`` (order statistics at the binomial
    ranks ``n/2 ± z·√n/2``); the whole range where there are too few values for one."""
    s = np.sort(values)
    n = len(s)
    z = NormalDist().inv_cdf(0.5 + level / 2)
    half = z * math.sqrt(n) / 2
    lo, hi = math.floor(n / 2 - half), math.ceil(n / 2 + half)
    if lo < 0 or hi >= n:
        return float(s[0]), float(s[-1])
    return float(s[lo]), float(s[hi])


def mean_ci(values: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The Student-t confidence interval of the mean of ``values`` (independent, few: ``n - 1`` degrees of freedom);
    needs at least two values."""
    from scipy import stats

    n = len(values)
    if n < 2:
        raise BenchError(f"an interval of a mean needs at least 2 values, not {n}")
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * float(np.std(values, ddof=1)) / math.sqrt(n)
    mean = float(np.mean(values))
    return mean - half, mean + half


def latencies(endpoint: Endpoint, seconds: float, warmup: int = 0, timeout_s: float = 30.0) -> np.ndarray:
    """One request after another to ``endpoint`` for ``seconds`` after ``warmup`` unmeasured ones: each latency, ms."""
    client = _Client(endpoint, timeout_s)
    try:
        for _ in range(warmup):
            client.post()
        times: list[int] = []
        stop = time.perf_counter() + seconds
        while time.perf_counter() < stop:
            times.append(client.post())
    finally:
        client.close()
    return np.array(times, dtype=np.float64) / 1e6


def added(base: Endpoint, other: Endpoint, seconds: float, warmup: int = 50, timeout_s: float = 30.0) -> dict:
    """What ``other`` adds over ``base``: pairs of requests for ``seconds`` after ``warmup`` unmeasured pairs.
    Returns the pairs' count, each side's p50 (ms), the median per-pair difference (ms) with its 95 % confidence
    interval and quartiles, and that median as a share of ``base``'s p50."""
    clients = _Client(base, timeout_s), _Client(other, timeout_s)
    try:
        for _ in range(warmup):
            clients[0].post(), clients[1].post()
        times: list[tuple[int, int]] = []
        stop = time.perf_counter() + seconds
        while time.perf_counter() < stop:
            if len(times) % 2 == 0:
                a = clients[0].post()
                b = clients[1].post()
            else:
                b = clients[1].post()
                a = clients[0].post()
            times.append((a, b))
    finally:
        for c in clients:
            c.close()
    if len(times) < 10:
        raise BenchError(f"only {len(times)} request pairs in {seconds:g} s to {base.url} and {other.url}")
    ms = np.array(times, dtype=np.float64) / 1e6
    diff = ms[:, 1] - ms[:, 0]
    p50_base = float(np.median(ms[:, 0]))
    lo, hi = median_ci(diff)
    return {"pairs": len(ms), "seconds": seconds, "base_p50_ms": p50_base, "other_p50_ms": float(np.median(ms[:, 1])),
            "added_ms": float(np.median(diff)), "added_ci_ms": [lo, hi],
            "added_quartiles_ms": [float(np.percentile(diff, 25)), float(np.percentile(diff, 75))],
            "added": float(np.median(diff)) / p50_base, "added_ci": [lo / p50_base, hi / p50_base]}
