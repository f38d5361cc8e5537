"""Prometheus metrics for the gateway, on a registry of its own (one per app, so tests can run several).

Route labels are the route *templates* (``/v1/classify``), never raw paths, so a scan of random URLs
cannot blow up the number of time series; a mounted app (the docs' static files) is counted under its mount
path (``/docs/static``) and unmatched paths as ``unmatched``. A request whose
client went away before the answer (mid-upload, or while its inference ran) is counted with status
``499`` (nginx's "client closed request"), not as a server error, and is not logged as one; once its body is read,
its work is cancelled at once (``unroll_gateway_cancelled_total``) rather than finished for nobody. The registry
also carries the standard ``process_*`` (CPU, memory, file descriptors), ``python_info`` and
``python_gc_*`` collectors.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("unroll.gateway")

#: Status recorded for a request whose client disconnected before its response was sent.
CLIENT_CLOSED = 499

#: prometheus_client's multiprocess directory: set when the gateway runs as several workers.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


#: Requests (and connections) the HTTP layer refused before any app saw them (:mod:`.server`): one counter per
#: process, registered on every app's registry, since the protocol that refuses knows no app.
HTTP_REFUSED = Counter("unroll_gateway_http_refused", "Requests and connections refused by the HTTP layer before "
                       "the app (slow or oversized heads, malformed requests, over the connection cap), by status "
                       "and code", ["status", "code"], registry=None)


class Metrics:
    """The gateway's collectors.

    With ``PROMETHEUS_MULTIPROC_DIR`` set (the gateway runs as several worker processes, see :mod:`.workers`),
    every value is written to that directory and :attr:`registry` aggregates all workers' files, so counters
    and histograms add up across workers and the gauges are summed over the live ones (``livesum``); the
    per-process collectors (``process_*``, ``python_gc_*``) are left out there (they would describe whichever
    worker answered), and ``unroll_gateway_worker_requests{pid}`` counts the requests of each live worker.
    """

    def __init__(self) -> None:
        self.multiprocess = bool(os.environ.get(MULTIPROC_ENV))
        self.registry = CollectorRegistry(auto_describe=True)
        # In multiprocess mode the metric objects write to files and are read back by the collector below;
        # registering them too would show this process's values twice.
        reg = None if self.multiprocess else self.registry
        self.requests = Counter("unroll_gateway_requests", "HTTP requests by route, method and status",
                                ["route", "method", "status"], registry=reg)
        self.latency = Histogram("unroll_gateway_request_duration_seconds", "HTTP request latency by route",
                                 ["route", "method"], buckets=LATENCY_BUCKETS, registry=reg)
        self.in_flight = Gauge("unroll_gateway_requests_in_flight", "HTTP requests being handled now",
                               registry=reg, multiprocess_mode="livesum")
        self.queued = Gauge("unroll_gateway_queue_depth", "Inference requests waiting for a concurrency slot",
                            registry=reg, multiprocess_mode="livesum")
        self.uploads = Gauge("unroll_gateway_uploads_in_progress", "Request bodies being read now",
                             registry=reg, multiprocess_mode="livesum")
        self.rate_limited = Counter("unroll_gateway_rate_limited", "Requests refused by the per-client rate limit "
                                    "(UNROLL_RATE_LIMIT)", registry=reg)
        self.cancelled = Counter("unroll_gateway_cancelled", "Requests whose work stopped because their client "
                                 "disconnected before the answer (queued for a slot or waiting for Triton)",
                                 registry=reg)
        self.iters_served = Counter("unroll_gateway_iters_served", "Answers of models serving several solver "
                                    "iteration counts, by model, count and who set it (pinned: the request's iters; "
                                    "controller: picked to meet the objective; default: the trained count)",
                                    ["model", "iters", "set_by"], registry=reg)
        self.objective_misses = Counter("unroll_gateway_objective_misses", "Answers later than the deadline they "
                                        "were held to (UNROLL_SLO or the request's deadline_ms), by model",
                                        ["model"], registry=reg)
        self.worker: Gauge | None = None
        if self.multiprocess:
            from prometheus_client import multiprocess

            multiprocess.MultiProcessCollector(self.registry)
            self.worker = Gauge("unroll_gateway_worker_requests", "HTTP requests handled by each live gateway worker "
                                "process (multi-worker mode only)", registry=None, multiprocess_mode="liveall")
        else:
            self.registry.register(HTTP_REFUSED)
            # Process and runtime metrics, on this registry (the default one is not served).
            ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
            GCCollector(registry=self.registry)
        self.triton = Histogram("unroll_gateway_triton_request_duration_seconds",
                                "Round trip of one Triton inference call, by model, model version (empty: "
                                "Triton's choice) and outcome", ["model", "version", "outcome"],
                                buckets=LATENCY_BUCKETS, registry=reg)
        self.batch = Histogram("unroll_gateway_batch_items", "Items per Triton inference call the gateway made "
                               "(requests coalesced by the HTTP-tier batcher), by model", ["model"],
                               buckets=BATCH_BUCKETS, registry=reg)

    def observe_triton(self, model: str, version: str, outcome: str, seconds: float) -> None:
        self.triton.labels(model, version, outcome).observe(seconds)

    def observe_batch(self, model: str, items: int) -> None:
        self.batch.labels(model).observe(items)


class MetricsMiddleware:
    """Pure ASGI middleware: counts and times every HTTP request, errors included."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # if the app raises before answering, Starlette's error middleware sends a 500
        gone = False
        # Once the body has been read, the server's next receive message is http.disconnect, sent when the
        # client leaves (or when the response is complete): a task waits for it, as Starlette's streaming
        # responses do. Waiting also keeps the socket read, so a close is noticed at once.
        listener: asyncio.Future[Message] | None = None

        handler = asyncio.current_task()
        started = cancelled = False

        def left(future: asyncio.Future[Message]) -> None:
            """The client went away before its answer began: stop working for it (queued for a slot, or waiting
            for Triton: the gRPC call is cancelled, and a batch it joined goes on without it)."""
            nonlocal cancelled
            if future.cancelled() or future.exception() is not None or started or handler is None:
                return
            if future.result().get("type") == "http.disconnect" and not handler.done():
                cancelled = True
                handler.cancel()

        async def receive_wrapper() -> Message:
            nonlocal listener
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False) and listener is None:
                listener = asyncio.ensure_future(receive())
                listener.add_done_callback(left)
            return message

        async def send_wrapper(message: Message) -> None:
            nonlocal status, gone, started
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                gone = listener is not None and listener.done() and not listener.cancelled() \
                    and listener.result().get("type") == "http.disconnect"
            if not gone:
                await send(message)

        m = self.metrics
        entry_root = scope.get("root_path", "")
        m.in_flight.inc()
        t0 = time.perf_counter()
        try:
            await self.app(scope, receive_wrapper, send_wrapper)
        except ClientDisconnect:  # the client left mid-upload: nobody to answer, nothing to log as an error
            gone = True
        except asyncio.CancelledError:
            if not cancelled:  # the server is stopping: not ours to swallow
                raise
            handler.uncancel()  # our own cancellation (the client left, see left()): the request ends here
            gone = True
            m.cancelled.inc()
        finally:
            if listener is not None and not listener.done():
                listener.cancel()
            if gone:
                status = CLIENT_CLOSED
                log.info("client %s closed the connection before the response to %s %s", _client(scope),
                         scope.get("method", ""), scope.get("path", ""))
            m.in_flight.dec()
            route = route_label(scope, entry_root)
            method = scope.get("method", "")
            m.requests.labels(route, method, str(status)).inc()
            m.latency.labels(route, method).observe(time.perf_counter() - t0)
            if m.worker is not None:
                m.worker.inc()


def route_label(scope: Scope, entry_root: str) -> str:
    """The route template that answered; for a mounted app, its mount path; else ``unmatched``.

    FastAPI records no ``route`` for a mount (``app.mount``), but the ASGI spec has the router extend
    ``root_path`` by the mount point before calling the mounted app: the growth since ``entry_root`` (the
    ``root_path`` this middleware saw, e.g. a proxy prefix) is the mount path, never the raw request path.
    """
    path = getattr(scope.get("route"), "path", None)
    if path:
        return path
    root = scope.get("root_path", "")
    if root != entry_root and root.startswith(entry_root):
        return root[len(entry_root):]
    return "unmatched"


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "?"
