"""The project's load engine: open-loop request rates and closed-loop concurrency, every client kind on one loop.

Open loop (:func:`schedule`): the send times are fixed before the level starts (constant, Poisson, gamma with a
stated coefficient of variation, or a replayed trace) and each request's latency is timed from its *scheduled*
send time, so a server that stalls shows the queue a user population would build (no coordinated omission).
Closed loop: ``concurrency`` requests in flight, each sent when the previous one of its slot is answered (paced by
``rate`` where one is given; a slot may wait after an answer, as a client told to retry later does: ``pause``).

What a request is and how it travels is the *sender*'s (:class:`Sender`), so the loop, its timing and its accounting
are one for every client kind: :class:`HttpSender` (:mod:`.loadgen_http`, the default: the gateway's ``/v1`` and
``/v2`` routes, Triton's HTTP port, any URL), :class:`TritonGrpcSender` (``tritonclient.grpc.aio``, Triton's gRPC
port, binary tensors: a ``grpc://host:port`` target) and :class:`InProcessSender` (a call in this process, run in a
thread of its own pool: the in-process ONNX Runtime baselines). :func:`run` picks the sender from the target;
:func:`run_processes` runs the same engine in several processes (each its share of the load, one measured window)
where one process's event loop would be the bottleneck; :func:`run_level` is the loop itself, for callers that run
their own coroutines beside it (a conductor that injects faults and ends the level: ``until``; every answer as it
comes: ``on_answer``).

One asyncio event loop and one client per sender (HTTP/1.1 framed by ``h11`` with keep-alive connections opened as
needed, never a pool cap that would queue sends on the client; one gRPC channel), on the default event loop: uvloop
was no faster here and its clock ticks in whole milliseconds. A send is woken :data:`TIMER_SLACK_S` early (the
loop's timers fire late, never early) and its latency timed from the later of its scheduled and actual send. Weighed,
not taken: a thread per in-flight request (``http.client``: a stall needs one thread per outstanding request, and the
GIL's switching adds its own lateness; not measured), ``httpx`` and aiohttp (several times the CPU per request of the
``h11`` client, see :mod:`.loadgen_http`), ApacheBench (C, cheap per request, but closed loop
only, one body per run, and it loses its place in Triton's binary answers) and a raw-socket HTTP/1.1 client (the
GPU check's, before this engine carried it: faster per request, but a second loop with its own timing). Each send's
lateness is measured, so a level the client could not send is reported as such (:attr:`LevelResult.client_bound`),
never as if offered; a send :data:`ABORT_LATE_S` late stops the level.
"""

from __future__ import annotations

import asyncio
import json
import math
import pickle
import resource
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from unroll.benchmarks.loadgen_http import HttpClient, HttpError
from unroll.errors import BenchError

ARRIVALS = ("constant", "poisson", "gamma", "trace")
#: A level is client-bound when its sends fell behind schedule at the 99th percentile by more than this or than the
#: mean gap between sends, whichever is larger (a send later than that reorders the arrivals it was meant to make) …
LATE_TOLERANCE_MS = 10.0
#: … or its achieved send rate is below the scheduled one by more than this fraction.
RATE_TOLERANCE = 0.05
#: Open-loop sends are woken this much before their time: asyncio's timers fire late by up to about a millisecond.
TIMER_SLACK_S = 0.001
#: A send this late stops the level's schedule at once (the client is far behind; the rest would only pile up).
ABORT_LATE_S = 1.0
#: Distinct error messages a level keeps (:attr:`LevelResult.error_samples`; the rest are counted by cause).
MAX_ERROR_SAMPLES = 3
#: Seconds :func:`run_processes` allows its processes to start before the level (a loaded machine starts Python
#: slowly: a process that started after the window had closed would report no request at all).
PROCESS_START_S = 1.5


# ----------------------------------------------------------------------------------------------- what is sent


@dataclass(frozen=True)
class Payload:
    """One HTTP request to send (the engine cycles through a list of them); ``path`` is under the target's URL."""

    path: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    method: str = "POST"
    tag: str = ""  #: the caller's name for the kind of request (carried to :class:`Answer`)


@dataclass(frozen=True, eq=False)
class Tensors:
    """One Triton inference request over gRPC: the model, its input tensors (batch first axis) and the outputs asked
    for (none: every output)."""

    model: str
    inputs: dict[str, np.ndarray]
    outputs: tuple[str, ...] = ()
    tag: str = ""


def v2_infer(model: str, inputs: dict[str, np.ndarray], outputs: Sequence[str] = (), *, binary: bool = True,
             headers: dict[str, str] | None = None) -> Payload:
    """A KServe v2 ``/v2/models/MODEL/infer`` request over HTTP: the inputs in the binary tensor extension (or as JSON
    data), ``outputs`` asked for as binary data (none named: every output, in binary). ``headers`` are added (a key)."""
    from tritonclient.utils import np_to_triton_dtype

    arrays = {k: np.ascontiguousarray(a) for k, a in inputs.items()}
    specs = []
    for name, a in arrays.items():
        spec: dict[str, Any] = {"name": name, "shape": list(a.shape), "datatype": np_to_triton_dtype(a.dtype)}
        if binary:
            spec["parameters"] = {"binary_data_size": a.nbytes}
        else:
            spec["data"] = a.reshape(-1).tolist()
        specs.append(spec)
    head_doc: dict[str, Any] = {"inputs": specs}
    if outputs:
        head_doc["outputs"] = [{"name": o, "parameters": {"binary_data": True}} for o in outputs]
    else:
        head_doc["parameters"] = {"binary_data_output": True}
    head = json.dumps(head_doc).encode()
    path, extra = f"/v2/models/{model}/infer", dict(headers or {})
    if not binary:
        return Payload(path, head, {"Content-Type": "application/json", **extra})
    return Payload(path, head + b"".join(a.tobytes() for a in arrays.values()),
                   {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head)),
                    **extra})


@dataclass(frozen=True)
class Outcome:
    """How one request was answered, as a sender reports it."""

    ok: bool
    status: int | None = None  #: the HTTP status (``None``: no HTTP answer, or not HTTP)
    cause: str = ""  #: a failure's bucket: ``HTTP 503 triton_unavailable``, ``timeout``, ``connect``, ``gRPC …``
    code: str | None = None  #: the gateway's error code, or the exception's class where no answer came
    retry_after: str | None = None  #: the answer's ``Retry-After``
    detail: str = ""  #: a failure's first words (the answer's body, or the exception's message)
    took_s: float | None = None  #: the call's own time, where the sender times it itself (in-process)


OK = Outcome(True, 200)


@dataclass(frozen=True)
class Answer:
    """One answered request, as :func:`run_level` hands it to ``on_answer`` (times on :func:`time.perf_counter`)."""

    i: int  #: the request's number in the level, in send order from 0
    payload: Any
    start: float
    end: float
    outcome: Outcome
    measured: bool  #: sent after the warm-up


# ---------------------------------------------------------------------------------------------------- senders


class Sender:
    """How a request travels: entered inside the running event loop (where its client opens), then
    :meth:`send` once per request. ``send`` never raises for a failed request: it answers an :class:`Outcome`."""

    async def __aenter__(self) -> Sender:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def send(self, payload: Any) -> Outcome:
        raise NotImplementedError


def error_code(status: int, headers: dict[str, str], body: bytes) -> str | None:
    """The gateway's stable error code of a failed answer (``{"error": {"code": …}}``), where its JSON has one."""
    if status < 400 or not headers.get("content-type", "").startswith("application/json"):
        return None
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


class HttpSender(Sender):
    """:class:`Payload` requests over HTTP/1.1 (:class:`.loadgen_http.HttpClient`: keep-alive, a connection per
    request in flight, no cap): a 200 is answered, anything else a failure by status and the gateway's error code
    (``HTTP 503 triton_unavailable``); no answer at all by how (``connect``, ``timeout``, ``disconnected``)."""

    def __init__(self, base_url: str, timeout_s: float = 30.0, headers: dict[str, str] | None = None) -> None:
        self.base_url, self.timeout_s, self.headers = base_url, timeout_s, dict(headers or {})
        self.client: HttpClient | None = None

    async def __aenter__(self) -> HttpSender:
        try:
            self.client = HttpClient(self.base_url, self.timeout_s, self.headers)
        except ValueError as e:
            raise BenchError(str(e)) from None
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def send(self, p: Payload) -> Outcome:
        assert self.client is not None, "enter the sender first (async with)"
        try:
            r = await self.client.request(p.method, p.path, p.body, p.headers)
        except HttpError as e:
            return Outcome(False, None, e.cause, e.cause, None, str(e)[:200])
        if r.status == 200:
            return OK
        code = error_code(r.status, r.headers, r.body)
        return Outcome(False, r.status, f"HTTP {r.status}" + (f" {code}" if code else ""), code,
                       r.headers.get("retry-after"), r.body[:300].decode(errors="replace"))


class TritonGrpcSender(Sender):
    """:class:`Tensors` requests to Triton's gRPC endpoint (``tritonclient.grpc.aio``, one channel, binary tensors;
    ``headers`` go as gRPC metadata, the restricted-API key among them). Each payload's inputs are built once."""

    def __init__(self, url: str, timeout_s: float = 30.0, headers: dict[str, str] | None = None) -> None:
        self.url, self.timeout_s, self.headers = url.removeprefix("grpc://"), timeout_s, dict(headers or {})
        self.client: Any = None
        self._built: dict[int, tuple[list, list | None]] = {}

    async def __aenter__(self) -> TritonGrpcSender:
        import tritonclient.grpc.aio as grpcclient

        self.client = grpcclient.InferenceServerClient(self.url)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.client is not None:
            await self.client.close()

    def _build(self, p: Tensors) -> tuple[list, list | None]:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import np_to_triton_dtype

        ins = []
        for name, a in p.inputs.items():
            t = grpcclient.InferInput(name, list(a.shape), np_to_triton_dtype(a.dtype))
            t.set_data_from_numpy(np.ascontiguousarray(a))
            ins.append(t)
        outs = [grpcclient.InferRequestedOutput(o) for o in p.outputs] or None
        self._built[id(p)] = ins, outs
        return ins, outs

    async def send(self, p: Tensors) -> Outcome:
        from tritonclient.utils import InferenceServerException

        ins, outs = self._built.get(id(p)) or self._build(p)
        try:
            await self.client.infer(p.model, ins, outputs=outs, client_timeout=self.timeout_s, headers=self.headers)
        except InferenceServerException as e:
            status = str(e.status() or "").removeprefix("StatusCode.")
            text = str(e.message() or "")
            cause = ("timeout" if status == "DEADLINE_EXCEEDED" else
                     "connect" if status == "UNAVAILABLE" and "connect" in text.lower() else f"gRPC {status}")
            return Outcome(False, None, cause, status or None, None, text[:300])
        except Exception as e:  # noqa: BLE001
            return Outcome(False, None, f"client: {type(e).__name__}", type(e).__name__, None, str(e)[:200])
        return OK


class InProcessSender(Sender):
    """A call in this process (``call(payload)``; raising is a failure), in a thread of the sender's own pool of
    ``threads`` (the closed loop's concurrency: one per request in flight), timed inside that thread
    (:attr:`Outcome.took_s`: the hand-off to the thread is not the call's)."""

    def __init__(self, call: Callable[[Any], object], threads: int = 1) -> None:
        self.call, self.threads = call, max(1, threads)
        self.pool: ThreadPoolExecutor | None = None

    async def __aenter__(self) -> InProcessSender:
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="loadgen-call")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    def _timed(self, payload: Any) -> float:
        t0 = time.perf_counter()
        self.call(payload)
        return time.perf_counter() - t0

    async def send(self, payload: Any) -> Outcome:
        try:
            took = await asyncio.get_running_loop().run_in_executor(self.pool, self._timed, payload)
        except Exception as e:  # noqa: BLE001
            return Outcome(False, None, f"error: {type(e).__name__}", type(e).__name__, None,
                           f"{type(e).__name__}: {e}"[:200])
        return Outcome(True, took_s=took)


def sender_for(target: str | Sender, timeout_s: float = 30.0, headers: dict[str, str] | None = None) -> Sender:
    """The sender for a target: a :class:`Sender` as it is, ``grpc://host:port`` Triton's gRPC endpoint, any other
    URL HTTP."""
    if isinstance(target, Sender):
        return target
    if target.startswith("grpc://"):
        return TritonGrpcSender(target, timeout_s, headers)
    return HttpSender(target, timeout_s, headers)


# ----------------------------------------------------------------------------------------------------- levels


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
    error_samples: list[str] = field(default_factory=list)  #: the first distinct failures, ``cause: detail``
    processes: int = 1  #: client processes that sent the level (:func:`run_processes`)
    #: each process's measured window on the wall clock (``time.time()``): start, its last answer
    windows: list[tuple[float, float]] = field(default_factory=list)

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

    @property
    def errors_total(self) -> int:
        return sum(self.errors.values())

    @property
    def client_cpu_share(self) -> float:
        """The client's CPU use as a share of its processes' cores over the level (1.0: every one busy all along)."""
        return self.client_cpu_s / (self.wall_s * self.processes) if self.wall_s > 0 else float("nan")

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")

    def add(self, r: LevelResult) -> None:
        """``r``'s requests, latencies, errors, lateness, client CPU and windows added to this result's."""
        self.sent += r.sent
        self.ok += r.ok
        self.latencies_ms += r.latencies_ms
        self.errors.update(r.errors)
        self.lateness_ms += r.lateness_ms
        self.client_cpu_s += r.client_cpu_s
        self.client_requests += r.client_requests
        self.windows += r.windows
        self.error_samples += [e for e in r.error_samples if e not in self.error_samples]


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _failure(e: BaseException) -> Outcome:
    return Outcome(False, None, f"client: {type(e).__name__}", type(e).__name__, None, f"{type(e).__name__}: {e}"[:200])


async def run_level(sender: Sender, payloads: Sequence[Any], load: Load, duration_s: float, warmup_s: float = 1.0,
                    seed: int = 0, requests: int | None = None, progress: Callable[[float], None] | None = None,
                    late_tolerance_ms: float = LATE_TOLERANCE_MS, *, on_answer: Callable[[Answer], None] | None = None,
                    until: asyncio.Event | None = None, pause: Callable[[Outcome], float] | None = None,
                    on_measure_start: Callable[[], object] | None = None,
                    start_at: float | None = None) -> LevelResult:
    """Run one level on an entered ``sender``: ``warmup_s`` of load (not counted), then ``duration_s`` measured (or,
    with ``requests``, that many measured sends; or, closed loop, until ``until`` is set: ``duration_s`` may then be
    ``math.inf``); waits for every request sent to be answered or to time out (the sender's timeout).

    ``progress(fraction)`` is called as the level goes; ``on_answer(answer)`` for every answer, the warm-up's too;
    ``pause(outcome)``: seconds a closed-loop slot waits after that answer before its next send; ``on_measure_start()``
    runs (in a thread) when the measured window opens (a statistics snapshot); ``start_at``: when the level starts on
    the wall clock (``time.time()``), for processes that measure together. A closed loop's measured window ends at
    its last answer (requests in flight at the deadline finish and count; none starts after it)."""
    if not payloads:
        raise BenchError("nothing to send: no inputs")
    if until is not None and load.open_loop:
        raise BenchError("a level ended by an event is a closed loop (an open loop's schedule ends it)")
    res = LevelResult(load=load, duration_s=duration_s, late_tolerance_ms=late_tolerance_ms)
    loop = asyncio.get_running_loop()
    clock = time.perf_counter  # the send schedule and every latency on one fine clock
    cpu0 = _cpu_s()
    t0 = clock() + (0.05 if start_at is None else max(0.0, start_at - time.time()))
    wall_t0 = time.time() + (t0 - clock())
    counter = iter(range(1 << 62))
    last_answer = [t0 + warmup_s]

    def count(o: Outcome, started: float, scheduled: float, done: float) -> None:
        last_answer[0] = max(last_answer[0], done)
        if o.ok:
            res.ok += 1
            took = o.took_s if o.took_s is not None and not load.open_loop else \
                done - (max(scheduled, started) if load.open_loop else started)
            res.latencies_ms.append(1e3 * took)
            return
        res.errors[o.cause] += 1
        sample = f"{o.cause}: {o.detail}" if o.detail else o.cause
        if len(res.error_samples) < MAX_ERROR_SAMPLES and sample not in res.error_samples:
            res.error_samples.append(sample)

    async def send(scheduled: float, measured: bool) -> Outcome:
        i = next(counter)
        p = payloads[i % len(payloads)]
        started = clock()
        res.client_requests += 1
        if load.open_loop and started - scheduled > ABORT_LATE_S and res.aborted is None:
            res.aborted = (f"a send fell {started - scheduled:.1f} s behind schedule at {started - t0:.1f} s into the "
                           "level: stopped")
        if measured:
            res.sent += 1
            if load.open_loop:
                res.lateness_ms.append(1e3 * max(0.0, started - scheduled))
                res.send_times.append(started - t0)
                res.scheduled_times.append(scheduled - t0)
        try:
            o = await sender.send(p)
        except Exception as e:  # noqa: BLE001  (a sender that raised: counted by its cause, as any failure)
            o = _failure(e)
        done = clock()
        if on_answer is not None:
            on_answer(Answer(i, p, started, done, o, measured))
        if measured:
            count(o, started, scheduled, done)
        return o

    snapshot = None
    if on_measure_start is not None:
        async def measure_start() -> None:
            await asyncio.sleep(max(0.0, t0 + warmup_s - clock()))
            await asyncio.to_thread(on_measure_start)

        snapshot = loop.create_task(measure_start())
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
            await asyncio.sleep(max(0.0, at - TIMER_SLACK_S - clock()))  # yields even when behind: queued sends first
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

        def going() -> bool:
            if until is not None and until.is_set():
                return False
            return clock() < end or (measured_left is not None and measured_left[0] > 0)

        async def slot(k: int) -> None:
            due = t0 + k * interval / load.concurrency  # paced slots start staggered
            await asyncio.sleep(max(0.0, due - clock()))
            while going():
                now = clock()
                measured = now >= t0 + warmup_s
                if measured and measured_left is not None:
                    if measured_left[0] <= 0:
                        return
                    measured_left[0] -= 1
                o = await send(now, measured)
                rest = pause(o) if pause is not None else 0.0
                if interval:
                    due = max(due + interval, clock())  # no catching up after a slow answer: the closed loop's omission
                if interval or rest:
                    await asyncio.sleep(max(0.0, rest, (due - clock()) if interval else 0.0))

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
    if snapshot is not None:
        await snapshot
    res.wall_s = clock() - t0
    if not load.open_loop:
        if requests is not None or not math.isfinite(duration_s):
            res.duration_s = max(1e-9, res.wall_s - warmup_s)
        else:
            res.duration_s = max(duration_s, last_answer[0] - (t0 + warmup_s))
    res.windows = [(wall_t0 + warmup_s, wall_t0 + (last_answer[0] - t0))]
    res.client_cpu_s = _cpu_s() - cpu0
    if progress is not None:
        progress(1.0)
    return res


def run(target: str | Sender, payloads: Sequence[Any], load: Load, duration_s: float, warmup_s: float = 1.0,
        timeout_s: float = 30.0, headers: dict[str, str] | None = None, seed: int = 0,
        requests: int | None = None, progress: Callable[[float], None] | None = None,
        late_tolerance_ms: float = LATE_TOLERANCE_MS, **options: Any) -> LevelResult:
    """:func:`run_level` from synchronous code, on the sender for ``target`` (:func:`sender_for`: a URL, a
    ``grpc://`` Triton, or a :class:`Sender`) entered for the level; ``options``: :func:`run_level`'s keywords."""
    async def main() -> LevelResult:
        async with sender_for(target, timeout_s, headers) as sender:
            return await run_level(sender, payloads, load, duration_s, warmup_s, seed, requests, progress,
                                   late_tolerance_ms, **options)

    return asyncio.run(main())


def merge(results: Sequence[LevelResult], load: Load) -> LevelResult:
    """One level's results from several processes as one: requests, latencies and errors together, sends in time
    order, the measured window the longest of theirs (they measured together), client CPU summed."""
    out = LevelResult(load=load, duration_s=max(r.duration_s for r in results), processes=len(results),
                      late_tolerance_ms=results[0].late_tolerance_ms, rate_tolerance=results[0].rate_tolerance)
    for r in results:
        out.add(r)
        out.aborted = out.aborted or r.aborted
    order = np.argsort([t for r in results for t in r.send_times], kind="stable")
    for name in ("send_times", "scheduled_times"):
        values = [t for r in results for t in getattr(r, name)]
        setattr(out, name, [values[k] for k in order] if len(values) == len(order) else sorted(values))
    out.error_samples = out.error_samples[:MAX_ERROR_SAMPLES]
    out.wall_s = max(r.wall_s for r in results)
    return out


def _share(load: Load, k: int, processes: int) -> Load:
    """Process ``k``'s part of ``load``: its slots of the concurrency (and of a pacing rate), or its part of the
    rate."""
    if load.open_loop:
        return replace(load, rate=load.rate / processes)
    assert load.concurrency is not None
    slots = load.concurrency // processes + (1 if k < load.concurrency % processes else 0)
    return replace(load, concurrency=slots, rate=load.rate * slots / load.concurrency if load.rate else None)


def run_processes(target: str, payloads: Sequence[Any], load: Load, duration_s: float, warmup_s: float = 1.0,
                  processes: int = 2, timeout_s: float = 30.0, headers: dict[str, str] | None = None, seed: int = 0,
                  on_measure_start: Callable[[], object] | None = None) -> LevelResult:
    """The level sent by ``processes`` client processes at once (``python -m unroll.benchmarks.loadgen``, each this
    engine on its share: :func:`_share`, its own seed, the payloads rotated so they do not send in step), all starting
    :data:`PROCESS_START_S` from now on the wall clock; ``on_measure_start`` runs here when their measured window
    opens; their results :func:`merge`\\ d. ``target`` is a URL: each process opens its own sender."""
    if load.arrivals == "trace":
        raise BenchError("a trace is replayed by one process")
    processes = max(1, min(processes, load.concurrency or processes))
    start_at = time.time() + PROCESS_START_S
    procs = []
    for k in range(processes):
        r = k % len(payloads)
        spec = (target, [*payloads[r:], *payloads[:r]], _share(load, k, processes), duration_s, warmup_s, timeout_s,
                headers, seed + k, start_at)
        p = subprocess.Popen([sys.executable, "-m", "unroll.benchmarks.loadgen"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        procs.append(p)
        p.stdin.write(pickle.dumps(spec))  # each reads its whole spec as it starts
        p.stdin.close()
    if on_measure_start is not None:
        time.sleep(max(0.0, start_at + warmup_s - time.time()))
        on_measure_start()
    results = []
    try:
        for p in procs:  # a process that ended first waits for its turn to hand over its result
            out = p.stdout.read()
            err = p.stderr.read().decode(errors="replace")
            if p.wait(timeout=timeout_s + duration_s + warmup_s + 60) != 0:
                raise BenchError(f"a load process exited {p.returncode}: {err.strip()[-400:]}")
            results.append(pickle.loads(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return merge(results, load)


def _process_main() -> int:
    """One process of :func:`run_processes`: its spec pickled on stdin, its :class:`LevelResult` pickled on stdout
    (by this module imported under its own name, so the parent reads the same classes)."""
    from unroll.benchmarks import loadgen

    target, payloads, load, duration_s, warmup_s, timeout_s, headers, seed, start_at = \
        pickle.loads(sys.stdin.buffer.read())
    result = loadgen.run(target, payloads, load, duration_s, warmup_s, timeout_s, headers, seed, start_at=start_at)
    sys.stdout.buffer.write(pickle.dumps(result))
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_process_main())
