"""Prometheus metrics for the gateway, on a registry of its own (one per app, so tests can run several).

Route labels are the route *templates* (``/v1/classify``), never raw paths, so a scan of random URLs
cannot blow up the number of time series; unmatched paths are counted as ``unmatched``.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """The gateway's collectors."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("unroll_gateway_requests", "HTTP requests by route, method and status",
                                ["route", "method", "status"], registry=self.registry)
        self.latency = Histogram("unroll_gateway_request_duration_seconds", "HTTP request latency by route",
                                 ["route", "method"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.in_flight = Gauge("unroll_gateway_requests_in_flight", "HTTP requests being handled now",
                               registry=self.registry)
        self.queued = Gauge("unroll_gateway_queue_depth", "Inference requests waiting for a concurrency slot",
                            registry=self.registry)
        self.triton = Histogram("unroll_gateway_triton_request_duration_seconds",
                                "Round trip of one Triton inference call, by model and outcome",
                                ["model", "outcome"], buckets=LATENCY_BUCKETS, registry=self.registry)

    def observe_triton(self, model: str, outcome: str, seconds: float) -> None:
        self.triton.labels(model, outcome).observe(seconds)


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

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        m = self.metrics
        m.in_flight.inc()
        t0 = time.perf_counter()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            m.in_flight.dec()
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            method = scope.get("method", "")
            m.requests.labels(route, method, str(status)).inc()
            m.latency.labels(route, method).observe(time.perf_counter() - t0)
