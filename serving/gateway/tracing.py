"""OpenTelemetry spans in the gateway, with the W3C trace context propagated to Triton; off by default, free when off.

On when the standard variables say so (``OTEL_TRACES_EXPORTER=otlp`` …, :mod:`unroll.serving.tracing_env`); each
gateway process (every worker) sets its own tracer provider up in the app's lifespan (:func:`setup`) and flushes it
at shutdown. Off, nothing here imports OpenTelemetry: :class:`TracingMiddleware` is not installed, and every hook below
is one ``None`` check that hands back what it was given (or a shared no-op context manager).

One request's trace:

- ``POST /v1/classify`` — the server span (:class:`TracingMiddleware`): continues the client's ``traceparent`` when
  it sends one, else starts a trace; attributes: method, route, status and ``unroll.request_id`` (the answer's
  ``X-Request-Id``).
- ``receive`` (the body read), ``queue`` (the wait for an admission slot), ``decode`` (header checks, and the
  decode/fit where the gateway does it), ``encode`` (the answer built) — children of the server span.
- ``triton.infer <model>`` — a client span around each Triton call; its context goes to Triton as ``traceparent``
  (an HTTP header, or gRPC metadata), so Triton's ``InferRequest`` → model → ``compute`` spans sit under it in the same
  trace (Triton runs with ``--trace-config rate=0``: it traces exactly the requests that carry a context, see
  :func:`unroll.serving.tracing_env.triton_trace_args`). Only a sampled context is sent: an unsampled request costs
  Triton nothing.

The HTTP-tier batcher (:mod:`.batching`) joins calls of several requests into one Triton call, which belongs to no
single request. Each request that waits in the batcher gets a ``batch.wait`` span (from joining until its rows come
back). The joined call gets a ``batch`` span whose *parent* is the wait span of the first sampled request of the batch
(the one that opened it, as the Triton request id is) and which carries a *span link* to every other request's wait
span; the ``triton.infer`` span and Triton's spans are its children. So the opening request's trace shows the whole
path down to Triton's compute, and every other request's wait is linked from the batch that answered it, without
one request's trace claiming another's work as its own. A batch of one (no concurrency) is simply that request's.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from unroll.serving import tracing_env
from unroll.serving.gateway import request_id

log = logging.getLogger("unroll.gateway")

#: ``service.name`` of the gateway's spans unless ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` name one.
DEFAULT_SERVICE_NAME = "unroll-gateway"
#: The request id attribute on the server span.
REQUEST_ID_ATTRIBUTE = "unroll.request_id"

_tracer: Any = None  # the SDK tracer of this process while tracing is on, else None
_provider: Any = None
_NULL = contextlib.nullcontext()


def enabled() -> bool:
    """Whether this process traces (after :func:`setup`)."""
    return _tracer is not None


def setup(environ: dict[str, str] | None = None) -> bool:
    """Install this process's tracer provider when the ``OTEL_*`` variables turn tracing on (whether they did).

    The SDK reads the exporter's endpoint, headers and timeout, the sampler, the resource and the batch processor's
    settings from the same variables; a ``service.name`` left unset is :data:`DEFAULT_SERVICE_NAME`."""
    global _tracer, _provider
    env = os.environ if environ is None else environ
    names = tracing_env.exporters(env)
    if not names:
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    provider = TracerProvider(resource=resource)
    for name in names:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name, env)))
    # Not made the global provider: FastAPI's own telemetry (0.165+) follows the global one and would add a second
    # server span and its dependency/endpoint spans between ours; the gateway's spans are these, from this tracer.
    _provider, _tracer = provider, provider.get_tracer("unroll.gateway")
    request_id.trace_id = current_trace_id  # log lines written inside a span name its trace
    log.info("gateway: OpenTelemetry tracing on (%s, service %s)", ", ".join(names), resource.attributes[SERVICE_NAME])
    return True


def shutdown() -> None:
    """Export what is left and stop tracing in this process (the app's lifespan calls it at shutdown)."""
    global _tracer, _provider
    provider, _tracer, _provider = _provider, None, None
    request_id.trace_id = request_id._no_trace_id
    if provider is not None:
        provider.shutdown()


def _exporter(name: str, env: Any) -> Any:
    if name in ("otlp", "otlp_proto_http"):
        tracing_env.otlp_protocol(env)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    from importlib.metadata import entry_points

    found = entry_points(group="opentelemetry_traces_exporter", name=name)
    if not found:
        raise ValueError(f"{tracing_env.EXPORTER_ENV}={name}: no such span exporter installed "
                         "(otlp, console, or a package's opentelemetry_traces_exporter entry point)")
    return next(iter(found)).load()()


class TracingMiddleware:
    """Pure ASGI middleware (installed only when tracing is on, inside :class:`.request_id.RequestIdMiddleware`):
    the request's server span, continuing an incoming ``traceparent``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracer = _tracer
        if tracer is None or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from opentelemetry import propagate
        from opentelemetry.trace import SpanKind, Status, StatusCode

        fields = propagate.get_global_textmap().fields
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())
                   if k.decode("latin-1") in fields}
        method = scope.get("method", "")
        attrs = {"http.request.method": method, "url.path": scope.get("path", ""),
                 REQUEST_ID_ATTRIBUTE: request_id.current() or ""}
        with tracer.start_as_current_span(method, context=propagate.extract(carrier), kind=SpanKind.SERVER,
                                          attributes=attrs) as span:
            status = 0

            async def send_traced(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                    span.set_attribute("http.response.status_code", status)
                await send(message)

            try:
                await self.app(scope, receive, send_traced)
            finally:
                route = getattr(scope.get("route"), "path", None)
                if route:
                    span.update_name(f"{method} {route}")
                    span.set_attribute("http.route", route)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager:
    """A child span of the current one around a stage (``with tracing.span("decode"):``); a shared no-op when off."""
    if _tracer is None:
        return _NULL
    return _tracer.start_as_current_span(name, attributes=attributes or None)


def queued(slot: contextlib.AbstractAsyncContextManager) -> contextlib.AbstractAsyncContextManager:
    """``slot`` (an admission slot, :meth:`.state.Admission.slot`) with a ``queue`` span over the wait to get it
    (not over the work done holding it); ``slot`` itself when off."""
    if _tracer is None:
        return slot
    return _queued(slot)


@contextlib.asynccontextmanager
async def _queued(slot: contextlib.AbstractAsyncContextManager) -> AsyncIterator[None]:
    async with contextlib.AsyncExitStack() as stack:
        with _tracer.start_as_current_span("queue"):
            await stack.enter_async_context(slot)
        yield


def batch_wait(call: Any) -> Any:
    """What a request that joined the batcher awaits (``call.future``); with tracing on, inside a ``batch.wait`` span
    whose context is left on ``call.trace`` for the batch's span (module docstring)."""
    if _tracer is None:
        return call.future
    return _batch_wait(call)


async def _batch_wait(call: Any) -> Any:
    with _tracer.start_as_current_span("batch.wait", attributes={"unroll.batch.items": call.items}) as s:
        call.trace = s.get_span_context()  # read by batch() when the batch is sent (after this awaits)
        return await call.future


def batch(calls: Sequence[Any]) -> contextlib.AbstractContextManager:
    """Around the Triton call of a batch of batcher calls: the ``batch`` span, child of the first sampled request's
    ``batch.wait`` span and linked to the others' (module docstring); a no-op when off."""
    if _tracer is None:
        return _NULL
    return _batch_span(calls)


@contextlib.contextmanager
def _batch_span(calls: Sequence[Any]) -> Iterator[None]:
    from opentelemetry import trace
    from opentelemetry.context import Context
    from opentelemetry.trace import Link, NonRecordingSpan

    traced = [c.trace for c in calls if getattr(c, "trace", None) is not None]
    first = next((t for t in traced if t.trace_flags.sampled), None)
    parent = trace.set_span_in_context(NonRecordingSpan(first)) if first is not None else Context()
    links = [Link(t) for t in traced if t is not first]
    attrs = {"unroll.batch.requests": len(calls), "unroll.batch.items": sum(c.items for c in calls)}
    with _tracer.start_as_current_span("batch", context=parent, links=links, attributes=attrs):
        yield


def client_span(infer: Callable[..., Any]) -> Callable[..., Any]:
    """Decorates ``TritonBackend.infer``: a ``triton.infer <model>`` client span around the call, current while the
    request is built so that :func:`inject` sends its context. Off: the undecorated call (no extra coroutine)."""

    @functools.wraps(infer)
    def wrapper(backend: Any, model: str, *args: Any, **kwargs: Any) -> Any:
        if _tracer is None:
            return infer(backend, model, *args, **kwargs)
        return _client_call(infer, backend, model, args, kwargs)

    return wrapper


async def _client_call(infer: Callable[..., Any], backend: Any, model: str, args: tuple, kwargs: dict) -> Any:
    from opentelemetry.trace import SpanKind

    inputs = args[0] if args else kwargs.get("inputs") or {}
    version = kwargs.get("version", args[3] if len(args) > 3 else "")
    attrs = {"rpc.system": backend.protocol, "server.address": backend.url, "unroll.model": model,
             "unroll.model_version": version or "", "unroll.batch.items": len(next(iter(inputs.values()), ()))}
    with _tracer.start_as_current_span(f"triton.infer {model}", kind=SpanKind.CLIENT, attributes=attrs):
        return await infer(backend, model, *args, **kwargs)


def inject(headers: dict[str, str] | None) -> dict[str, str] | None:
    """``headers`` for a Triton call, plus the current span's ``traceparent`` (``tracestate``, …) when it is sampled;
    ``headers`` itself when off or unsampled."""
    if _tracer is None:
        return headers
    from opentelemetry import propagate, trace

    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid or not ctx.trace_flags.sampled:
        return headers
    out = dict(headers or {})
    propagate.inject(out)
    return out


def current_trace_id() -> str | None:
    """The current trace id (32 hex digits) for log lines; ``None`` when off or outside a span."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None
