"""The project's load engine: open-loop request rates and closed-loop concurrency against any HTTP endpoint.

Open loop (:func:`schedule`): the send times are fixed before the level starts (constant, Poisson, gamma with a
stated coefficient of variation, or a replayed trace) and each request's latency is timed from its *scheduled*
send time, so a server that stalls shows the queue a user population would build (no coordinated omission).
Closed loop: ``concurrency`` requests in flight, each sent when the previous one of its slot is answered.

One asyncio event loop and one ``httpx.AsyncClient`` (connections opened as needed, never a pool cap that would
queue sends on the client), on the default event loop: uvloop was no faster here and its clock ticks in whole
milliseconds. Weighed, not taken: a thread per in-flight request (``http.client``: a stall needs one thread per
outstanding request, and the GIL's switching adds its own lateness; not measured) and aiohttp (lighter per request,
but not a declared dependency). Each send's lateness is measured, so a level the client could not send is reported
as such (:attr:`LevelResult.client_bound`), never as if offered; a send :data:`ABORT_LATE_S` late stops the level.
"""

from __future__ import annotations

import asyncio
import math
import resource
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from unroll.errors import BenchError

ARRIVALS = ("constant", "poisson", "gamma", "trace")
#: A level is client-bound when its sends fell behind schedule at the 99th percentile by more than this or than the
#: mean gap between sends, whichever is larger (a send later than that reorders the arrivals it was meant to make) …
LATE_TOLERANCE_MS = 10.0
#: … or its achieved send rate is below the scheduled one by more than this fraction.
RATE_TOLERANCE = 0.05
#: A send this late stops the level's schedule at once (the client is far behind; the rest would only pile up).
ABORT_LATE_S = 1.0


@dataclass(frozen=True)
class Payload:
    """One request body to send (the engine cycles through a list of them)."""

    path: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    method: str = "POST"


@dataclass(frozen=True)
class Load:
    """One level: an open-loop ``rate`` (req/s, with its ``arrivals``), or a closed-loop ``concurrency`` (with a
    ``rate`` too: paced, each slot sending at most every ``concurrency / rate`` s, as wrk-style clients do)."""

    rate: float | None = None
    concurrency: int | None = None
    arrivals: str = "constant"
    cv: float = 1.0  #: coefficient of variation of gamma inter-arrival times (1 = Poisson, > 1 bursty)
    trace: tuple[float, ...] | None = None  #: send offsets in seconds (``arrivals="trace"``)

    def __post_init__(self) -> None:
        if self.rate is None and self.concurrency is None and self.arrivals != "trace":
            raise BenchError("a load level needs a request rate, a concurrency or a trace")
        if self.arrivals not in ARRIVALS:
            raise BenchError(f"unknown arrivals {self.arrivals!r}: one of {', '.join(ARRIVALS)}")
        if self.rate is not None and self.rate <= 0:
            raise BenchError(f"a request rate must be positive, not {self.rate:g}")
        if self.concurrency is not None and self.concurrency < 1:
            raise BenchError(f"a concurrency must be at least 1, not {self.concurrency}")
        if self.arrivals == "gamma" and self.cv <= 0:
            raise BenchError(f"gamma arrivals need a coefficient of variation > 0, not {self.cv:g}")

    @property
    def open_loop(self) -> bool:
        return self.concurrency is None

    @property
    def label(self) -> str:
        if not self.open_loop:
            return f"concurrency {self.concurrency}" + (f" paced at {self.rate:g} req/s" if self.rate else "")
        if self.arrivals == "trace":
            return "trace"
        return f"{self.rate:g} req/s {self.arrivals}" + (f" (cv {self.cv:g})" if self.arrivals == "gamma" else "")


def read_trace(path: Path) -> tuple[float, ...]:
    """Send times in seconds, one a line (``#`` comments and blank lines skipped), as offsets from the first."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise BenchError(f"cannot read the trace {path}: {e.strerror or e}") from None
    times = []
    for n, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            times.append(float(text.split(",")[0]))
        except ValueError:
            raise BenchError(f"{path}:{n}: not a time in seconds: {text!r}") from None
    if len(times) < 2:
        raise BenchError(f"the trace {path} holds {len(times)} send time(s); it needs at least 2")
    times.sort()
    return tuple(t - times[0] for t in times)


def schedule(load: Load, span_s: float, seed: int = 0) -> np.ndarray:
    """Send offsets (seconds from the level's start) covering ``[0, span_s)``: constant spacing ``1/rate``,
    exponential gaps (Poisson), gamma gaps of mean ``1/rate`` and coefficient of variation ``cv`` (shape
    ``1/cv²``), or the trace's own times (cut at ``span_s``)."""
    if load.arrivals == "trace":
        assert load.trace is not None
        t = np.asarray(load.trace, dtype=np.float64)
        return t[t < span_s]
    assert load.rate is not None
    n = int(math.ceil(span_s * load.rate * 1.5)) + 16
    mean = 1.0 / load.rate
    rng = np.random.default_rng(seed)
    if load.arrivals == "constant":
        gaps = np.full(n, mean)
    elif load.arrivals == "poisson":
        gaps = rng.exponential(mean, n)
    else:
        k = 1.0 / load.cv ** 2
        gaps = rng.gamma(k, mean / k, n)
    t = np.concatenate(([0.0], np.cumsum(gaps[:-1])))
    while t[-1] < span_s:  # a rare long draw: extend
        more = schedule(Load(rate=load.rate, arrivals=load.arrivals, cv=load.cv), span_s - t[-1], seed + 1)
        t = np.concatenate((t, t[-1] + mean + more))
    return t[t < span_s]


def coefficient_of_variation(times: Sequence[float]) -> float:
    """Standard deviation ÷ mean of the gaps between consecutive times."""
    gaps = np.diff(np.asarray(times, dtype=np.float64))
    return float(gaps.std() / gaps.mean()) if len(gaps) > 1 and gaps.mean() > 0 else float("nan")


@dataclass
class LevelResult:
    """What one level measured (only requests scheduled after the warm-up count; errors by status and cause)."""

    load: Load
    duration_s: float
    sent: int = 0
    ok: int = 0
    latencies_ms: list[float] = field(default_factory=list)  #: successful requests, from the scheduled send time
    errors: Counter = field(default_factory=Counter)  #: ``"HTTP 503"``, ``"timeout"``, ``"connect"`` … → count
    lateness_ms: list[float] = field(default_factory=list)  #: open loop: actual − scheduled send time
    send_times: list[float] = field(default_factory=list)  #: open loop: actual send times (s from the start)
    scheduled_times: list[float] = field(default_factory=list)  #: open loop: their scheduled times (s)
    wall_s: float = 0.0
    client_cpu_s: float = 0.0  #: the client process's user+system CPU over the whole level (warm-up included)
    client_requests: int = 0  #: every request the client sent in the level (warm-up included)
    aborted: str | None = None  #: why the schedule was stopped early (a send :data:`ABORT_LATE_S` late)
    late_tolerance_ms: float = LATE_TOLERANCE_MS
    rate_tolerance: float = RATE_TOLERANCE

    @property
    def offered_rate(self) -> float | None:
        if not self.load.open_loop:
            return None
        if self.load.arrivals == "trace":
            return self.sent / self.duration_s if self.duration_s > 0 else None
        return self.load.rate

    @property
    def send_rate(self) -> float:
        """Achieved send rate over the measured window (sends per second of actual send time)."""
        if len(self.send_times) > 1:
            span = self.send_times[-1] - self.send_times[0]
            return (len(self.send_times) - 1) / span if span > 0 else float("nan")
        return self.sent / self.duration_s if self.duration_s > 0 else float("nan")

    @property
    def scheduled_rate(self) -> float:
        """The send rate the schedule asked for over the same sends (a Poisson draw's own rate, not the nominal)."""
        t = self.scheduled_times
        return (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else float("nan")

    @property
    def late_tolerance(self) -> float:
        """The lateness (ms, p99) beyond which the level is client-bound: the set tolerance or the mean gap."""
        rate = self.scheduled_rate
        return max(self.late_tolerance_ms, 1e3 / rate if rate == rate and rate > 0 else 0.0)

    @property
    def throughput(self) -> float:
        """Successful answers per second of the measured window."""
        return self.ok / self.duration_s if self.duration_s > 0 else float("nan")

    @property
    def error_rate(self) -> float:
        return (self.sent - self.ok) / self.sent if self.sent else float("nan")

    @property
    def late_p99_ms(self) -> float:
        return float(np.percentile(self.lateness_ms, 99)) if self.lateness_ms else 0.0

    @property
    def client_bound(self) -> str | None:
        """Why the client did not send at the offered rate (``None``: it did, within the tolerances)."""
        if self.aborted:
            return self.aborted
        if not self.load.open_loop or not self.send_times:
            return None
        if self.late_p99_ms > self.late_tolerance:
            return (f"sends fell behind schedule by {self.late_p99_ms:.1f} ms at p99 "
                    f"(tolerance {self.late_tolerance:.3g} ms)")
        if self.send_rate < self.scheduled_rate * (1 - self.rate_tolerance):
            return f"sent {self.send_rate:.1f} req/s of the {self.scheduled_rate:.4g} scheduled"
        return None

    @property
    def cpu_ms_per_request(self) -> float:
        return 1e3 * self.client_cpu_s / self.client_requests if self.client_requests else float("nan")

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")


def _cause(e: BaseException) -> str:
    if isinstance(e, httpx.TimeoutException):
        return "timeout"
    if isinstance(e, httpx.ConnectError):
        return "connect"
    if isinstance(e, httpx.RemoteProtocolError):
        return "disconnected"
    if isinstance(e, httpx.HTTPError):
        return type(e).__name__
    return f"client: {type(e).__name__}"


def _status_cause(r: httpx.Response) -> str:
    """``HTTP 503``, with the gateway's stable error code where the body has one (``HTTP 503 triton_unavailable``)."""
    try:
        code = r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {r.status_code}"
    return f"HTTP {r.status_code} {code}" if isinstance(code, str) else f"HTTP {r.status_code}"


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def run_level(client: httpx.AsyncClient, payloads: Sequence[Payload], load: Load, duration_s: float,
                    warmup_s: float = 1.0, seed: int = 0, requests: int | None = None,
                    progress: Callable[[float], None] | None = None,
                    late_tolerance_ms: float = LATE_TOLERANCE_MS) -> LevelResult:
    """Run one level: ``warmup_s`` of load (not counted), then ``duration_s`` measured (or, with ``requests``, that
    many measured sends); waits for every request sent to be answered or to time out (``client``'s timeout).
    ``progress(fraction)`` is called as the level goes."""
    if not payloads:
        raise BenchError("nothing to send: no inputs")
    res = LevelResult(load=load, duration_s=duration_s, late_tolerance_ms=late_tolerance_ms)
    loop = asyncio.get_running_loop()
    clock = time.perf_counter  # the send schedule and every latency on one fine clock
    cpu0 = _cpu_s()
    t0 = clock() + 0.05
    counter = iter(range(1 << 62))

    async def send(scheduled: float, measured: bool) -> None:
        p = payloads[next(counter) % len(payloads)]
        started = clock()
        res.client_requests += 1
        if load.open_loop and started - scheduled > ABORT_LATE_S and res.aborted is None:
            res.aborted = (f"a send fell {started - scheduled:.1f} s behind schedule at {started - t0:.1f} s into the "
                           "level: stopped")
        if measured:
            res.sent += 1
            if load.open_loop:
                res.lateness_ms.append(1e3 * (started - scheduled))
                res.send_times.append(started - t0)
                res.scheduled_times.append(scheduled - t0)
        try:
            r = await client.request(p.method, p.path, content=p.body, headers=p.headers)
            await r.aread()
        except Exception as e:  # noqa: BLE001  (every failure is counted by its cause, none stops the level)
            if measured:
                res.errors[_cause(e)] += 1
            return
        done = clock()
        if not measured:
            return
        if r.status_code == 200:
            res.ok += 1
            res.latencies_ms.append(1e3 * (done - (scheduled if load.open_loop else started)))
        else:
            res.errors[_status_cause(r)] += 1

    pending: set[asyncio.Task] = set()
    total = warmup_s + duration_s
    if load.open_loop:
        if load.arrivals == "trace":  # replayed whole (its first warmup_s not counted), or its first requests
            span = math.inf
        else:
            span = total if requests is None else warmup_s + requests / load.rate + 1.0
        offsets = schedule(load, span, seed)
        if requests is not None or load.arrivals == "trace":
            warm = int(np.count_nonzero(offsets < warmup_s))
            offsets = offsets[:warm + requests] if requests is not None else offsets
            res.duration_s = float(offsets[-1] - warmup_s) if len(offsets) > warm else 0.0
            total = float(offsets[-1]) if len(offsets) else 0.0
        step = max(1, len(offsets) // 200)
        for i, off in enumerate(offsets):
            at = t0 + off
            if res.aborted:
                break
            await asyncio.sleep(max(0.0, at - clock()))  # yields even when behind: queued sends start first
            task = loop.create_task(send(at, off >= warmup_s))
            pending.add(task)
            task.add_done_callback(pending.discard)
            if progress is not None and i % step == 0:
                progress(min(1.0, off / total) if total else 1.0)
    else:
        assert load.concurrency is not None
        end = t0 + total
        measured_left = [requests] if requests is not None else None

        interval = load.concurrency / load.rate if load.rate else 0.0

        async def slot(k: int) -> None:
            due = t0 + k * interval / load.concurrency  # paced slots start staggered
            await asyncio.sleep(max(0.0, due - clock()))
            while clock() < end or (measured_left is not None and measured_left[0] > 0):
                now = clock()
                measured = now >= t0 + warmup_s
                if measured and measured_left is not None:
                    if measured_left[0] <= 0:
                        return
                    measured_left[0] -= 1
                await send(now, measured)
                if interval:
                    due = max(due + interval, clock())  # no catching up after a slow answer: the closed loop's omission
                    await asyncio.sleep(max(0.0, due - clock()))

        async def ticker() -> None:
            while progress is not None:
                progress(min(1.0, (clock() - t0) / total) if total else 1.0)
                await asyncio.sleep(0.2)

        tick = loop.create_task(ticker())
        await asyncio.sleep(max(0.0, t0 - clock()))
        await asyncio.gather(*(slot(k) for k in range(load.concurrency)))
        tick.cancel()
    if pending:
        if res.aborted:  # far behind: what is still queued would only drain the server's backlog
            for task in list(pending):
                task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    res.wall_s = clock() - t0
    if not load.open_loop and requests is not None:
        res.duration_s = max(1e-9, res.wall_s - warmup_s)
    res.client_cpu_s = _cpu_s() - cpu0
    if progress is not None:
        progress(1.0)
    return res


def new_client(base_url: str, timeout_s: float, headers: dict[str, str] | None = None) -> httpx.AsyncClient:
    """An async client for a level: no connection cap (an open loop must never wait for a free connection on the
    client side), keep-alive, the request timeout on every phase."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
    return httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(timeout_s), limits=limits,
                             headers=headers or {})


def run(base_url: str, payloads: Sequence[Payload], load: Load, duration_s: float, warmup_s: float = 1.0,
        timeout_s: float = 30.0, headers: dict[str, str] | None = None, seed: int = 0,
        requests: int | None = None, progress: Callable[[float], None] | None = None,
        late_tolerance_ms: float = LATE_TOLERANCE_MS) -> LevelResult:
    """:func:`run_level` on a fresh client, from synchronous code."""
    async def main() -> LevelResult:
        async with new_client(base_url, timeout_s, headers) as client:
            return await run_level(client, payloads, load, duration_s, warmup_s, seed, requests, progress,
                                   late_tolerance_ms)

    return asyncio.run(main())
