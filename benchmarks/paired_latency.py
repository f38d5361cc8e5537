"""The latency one endpoint adds over another, measured in pairs: one request to each, back to back, over and over.

A small difference (tens of microseconds on a request of half a millisecond) is lost in the drift of a shared
machine when each side is measured in its own stretch of time: the two stretches see different loads. Here each
pair's two requests are a few hundred microseconds apart, so drift falls on both, and the median of the per-pair
differences estimates what the second endpoint adds; which goes first alternates, so neither is always the one that
finds a warm cache. Requests go one at a time (the project's load engine, :mod:`.loadgen`, in closed loop at
concurrency 1, cycling through the pairs) on a kept-alive connection per endpoint: the engine's own overhead is in
both latencies and cancels in the difference. The confidence interval of that median is the distribution-free one
from order statistics (the binomial ranks around ``n / 2``).

:func:`latencies` times one endpoint alone the same way, and :func:`mean_ci` is the interval of a mean of a few
independent differences (one per whole-server run, :mod:`~unroll.benchmarks.ood_served`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from urllib.parse import urlsplit

import numpy as np

from unroll.benchmarks import loadgen
from unroll.errors import BenchError


@dataclass(frozen=True)
class Endpoint:
    """One POST: where, what, and its headers (the content type among them)."""

    url: str
    body: bytes
    headers: dict[str, str]

    def payload(self, tag: str) -> tuple[str, loadgen.Payload]:
        """Its base URL and its request for the engine (``tag``: which endpoint it is)."""
        parts = urlsplit(self.url)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        return f"{parts.scheme}://{parts.netloc}", loadgen.Payload(path, self.body, self.headers, tag=tag)


class _Endpoints(loadgen.Sender):
    """Each request to its own endpoint (the payload's ``tag``): an HTTP sender, its own kept-alive connection, per
    endpoint, even where two share a server."""

    def __init__(self, bases: dict[str, str], timeout_s: float) -> None:
        self.senders = {tag: loadgen.HttpSender(base, timeout_s) for tag, base in bases.items()}
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> _Endpoints:
        for sender in self.senders.values():
            await self._stack.enter_async_context(sender)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def send(self, payload: loadgen.Payload) -> loadgen.Outcome:
        return await self.senders[payload.tag].send(payload)


def _timed(endpoints: Sequence[Endpoint], order: Sequence[int], seconds: float, warmup: int, timeout_s: float,
           on_measure_start: Callable[[], object] | None = None) -> list[tuple[int, float]]:
    """One request at a time, cycling through ``endpoints`` in ``order`` (indices): ``warmup`` unmeasured cycles, then
    ``seconds`` measured; each measured request as (endpoint index, ms), in send order. An answer other than 200
    stops the measurement with a :class:`BenchError` naming the endpoint."""
    bases, payloads = {}, []
    for i, e in enumerate(endpoints):
        bases[str(i)], p = e.payload(str(i))
        payloads.append(p)
    cycle = [payloads[i] for i in order]
    one = loadgen.Load(concurrency=1)
    times: list[tuple[int, float]] = []
    failed: list[loadgen.Answer] = []
    stop = asyncio.Event()

    def answered(a: loadgen.Answer, keep: bool) -> None:
        if not a.outcome.ok:
            failed.append(a)
            stop.set()
        elif keep:
            times.append((int(a.payload.tag), 1e3 * (a.end - a.start)))

    async def main() -> None:
        async with _Endpoints(bases, timeout_s) as sender:
            if warmup:
                await loadgen.run_level(sender, cycle, one, 0.0, 0.0, requests=warmup * len(cycle), until=stop,
                                        on_answer=lambda a: answered(a, False))
            if not failed and on_measure_start is not None:
                on_measure_start()
            if not failed:
                await loadgen.run_level(sender, cycle, one, seconds, 0.0, until=stop,
                                        on_answer=lambda a: answered(a, True))

    asyncio.run(main())
    if failed:
        o = failed[0].outcome
        raise BenchError(f"{endpoints[int(failed[0].payload.tag)].url} answered {o.cause}: {o.detail[:300]}")
    return times


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


def latencies(endpoint: Endpoint, seconds: float, warmup: int = 0, timeout_s: float = 30.0,
              on_measure_start: Callable[[], object] | None = None) -> np.ndarray:
    """One request after another to ``endpoint`` for ``seconds`` after ``warmup`` unmeasured ones: each latency, ms
    (``on_measure_start`` runs between the two: a CPU snapshot)."""
    return np.array([ms for _, ms in _timed([endpoint], [0], seconds, warmup, timeout_s, on_measure_start)])


def added(base: Endpoint, other: Endpoint, seconds: float, warmup: int = 50, timeout_s: float = 30.0) -> dict:
    """What ``other`` adds over ``base``: pairs of requests for ``seconds`` after ``warmup`` unmeasured pairs.
    Returns the pairs' count, each side's p50 (ms), the median per-pair difference (ms) with its 95 % confidence
    interval and quartiles, and that median as a share of ``base``'s p50."""
    times = _timed([base, other], [0, 1, 1, 0], seconds, warmup, timeout_s)  # which goes first alternates
    pairs = [dict(times[k:k + 2]) for k in range(0, len(times) - 1, 2)]  # a pair cut by the deadline is dropped
    if len(pairs) < 10:
        raise BenchError(f"only {len(pairs)} request pairs in {seconds:g} s to {base.url} and {other.url}")
    ms = np.array([(p[0], p[1]) for p in pairs], dtype=np.float64)
    diff = ms[:, 1] - ms[:, 0]
    p50_base = float(np.median(ms[:, 0]))
    lo, hi = median_ci(diff)
    return {"pairs": len(ms), "seconds": seconds, "base_p50_ms": p50_base, "other_p50_ms": float(np.median(ms[:, 1])),
            "added_ms": float(np.median(diff)), "added_ci_ms": [lo, hi],
            "added_quartiles_ms": [float(np.percentile(diff, 25)), float(np.percentile(diff, 75))],
            "added": float(np.median(diff)) / p50_base, "added_ci": [lo / p50_base, hi / p50_base]}
