"""The per-process state the routes share, handed to them as FastAPI dependencies.

One :class:`Gateway` is built in the app's lifespan (settings, Triton client, model catalog, metrics,
upload and admission control). Routes declare what they need (``gw: GatewayDep``, ``settings: SettingsDep``) instead
of reaching into ``request.app.state``, so the wiring is visible in each signature and tests can override
a dependency (``app.dependency_overrides[get_gateway]``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Depends, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from unroll import tasks
from unroll.errors import TritonUnavailable
from unroll.serving.gateway.anytime import Controller
from unroll.serving.gateway.batching import Batcher
from unroll.serving.gateway.body import check_declared_length, read_body, read_image_bytes
from unroll.serving.gateway.catalog import Catalog, Entry
from unroll.serving.gateway.errors import ApiError
from unroll.serving.gateway.http_settings import HttpSettings
from unroll.serving.gateway.metrics import Metrics
from unroll.serving.gateway.openapi import COMMON_ERRORS
from unroll.serving.gateway.rate_limit import Buckets, buckets_for
from unroll.serving.gateway.settings import Settings
from unroll.serving.gateway.stall import TritonWatch
from unroll.serving.gateway.triton_client import TritonBackend

log = logging.getLogger("unroll.gateway")


class Admission:
    """At most ``limit`` requests working and ``queue`` waiting; beyond that, 429 at once (bounded memory)."""

    def __init__(self, limit: int, queue: int, retry_after_s: int, metrics: Metrics) -> None:
        self.limit, self.queue, self.retry_after_s = limit, queue, retry_after_s
        self._sem = asyncio.Semaphore(limit)
        self._admitted = 0
        self._metrics = metrics

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self._admitted >= self.limit + self.queue:
            raise ApiError(429, "too_many_requests",
                           f"server busy: {self.limit} requests running and {self.queue} queued; retry later",
                           {"Retry-After": str(self.retry_after_s)})
        self._admitted += 1
        self._metrics.queued.inc()
        queued = True
        try:
            async with self._sem:
                self._metrics.queued.dec()
                queued = False
                yield
        finally:
            if queued:
                self._metrics.queued.dec()
            self._admitted -= 1


class Uploads:
    """At most ``limit`` request bodies being read at once; beyond that, 429 at once.

    Separate from :class:`Admission` on purpose: a body is read *before* the request asks for an inference
    slot, so clients that upload slowly (or not at all, until ``body_idle_timeout_s`` cuts them off) hold
    an upload permit, never a slot, and inference goes on. This bounds body memory: ``limit`` × the body limit.
    """

    def __init__(self, limit: int, retry_after_s: int, metrics: Metrics) -> None:
        self.limit, self.retry_after_s = limit, retry_after_s
        self._active = 0
        self._metrics = metrics

    @asynccontextmanager
    async def permit(self) -> AsyncIterator[None]:
        if self._active >= self.limit:
            raise ApiError(429, "too_many_requests", f"server busy: {self.limit} uploads in progress; retry later",
                           {"Retry-After": str(self.retry_after_s)})
        self._active += 1
        self._metrics.uploads.inc()
        try:
            yield
        finally:
            self._active -= 1
            self._metrics.uploads.dec()


@dataclass
class Gateway:
    """Per-process state shared by the routes."""

    settings: Settings
    #: Triton: health, metadata, the repository index (inference goes through :attr:`batcher`).
    triton: TritonBackend
    #: Triton's inference, coalesced at the HTTP tier unless ``settings.batching`` is off (:mod:`.batching`).
    batcher: Batcher
    catalog: Catalog
    metrics: Metrics
    admission: Admission
    http: HttpSettings
    uploads: Uploads
    #: The per-client token buckets (``UNROLL_RATE_LIMIT``; shared by the workers of one gateway), or ``None``: no
    #: rate limit.
    rate_limit: Buckets | None = None
    #: Whether Triton answers; requests waiting for a stalled one get 503 (:mod:`.stall`; its probe runs in the
    #: app's lifespan). Built by :meth:`create`.
    watch: TritonWatch | None = None
    #: Which iteration count answers a request that pins none, under an objective (:mod:`.anytime`).
    anytime: Controller = field(default_factory=Controller)

    @classmethod
    def create(cls, settings: Settings, metrics: Metrics, http: HttpSettings | None = None) -> Gateway:
        """``http`` defaults to :class:`HttpSettings` from the ``UNROLL_*`` variables."""
        http = http or HttpSettings()
        triton = TritonBackend(settings.triton_url, settings.triton_protocol, settings.request_timeout_s,
                               observe=metrics.observe_triton)
        catalog = Catalog(triton, settings)
        watch = TritonWatch(triton, settings.triton_stall_s)
        batcher = Batcher(triton, catalog.batch_limit, settings.batch_max_in_flight, settings.batch_delay_ms / 1000.0,
                          observe=metrics.observe_batch, enabled=settings.batching, waiting=watch.waiting)
        return cls(settings, triton, batcher, catalog, metrics,
                   Admission(settings.max_concurrency, settings.max_queue, settings.busy_retry_after_s, metrics),
                   http, Uploads(http.max_uploads, settings.busy_retry_after_s, metrics),
                   buckets_for(settings.rate_limit), watch)

    async def infer(self, entry: Entry, inputs: dict[str, np.ndarray], outputs: list[str],
                    class_count: int | None = None, version: str | None = None) -> dict[str, np.ndarray]:
        """One inference on ``entry``'s model, on ``version`` when the request names one, else on the version its
        traffic split draws (:meth:`Entry.pick_version`).

        A version Triton has unloaded since the catalog was read (``unroll deploy`` moved traffic off it and waited
        ``catalog_refresh_s``; a gateway that lagged behind) is answered once more by another ready version, and the
        catalog is re-read, so a rollout loses no request."""
        named, version = version is not None, version if version is not None else entry.pick_version()
        if self.watch is not None:
            await self.watch.admit()  # a stalled Triton: 503 now, not at the deadline (.stall)
        with self.watch.waiting() if self.watch is not None else nullcontext():
            try:
                return await self.batcher.infer(entry.name, inputs, outputs, class_count, version)
            except TritonUnavailable as e:
                other = entry.pick_version(exclude=version) \
                    if version and not named and f"version {version}" in str(e) else ""
                if not other:
                    raise
                log.info("gateway: %s version %s is gone; answered by version %s", entry.name, version, other)
                self.catalog.invalidate()
            return await self.batcher.infer(entry.name, inputs, outputs, class_count, other)

    async def read_image(self, request: Request) -> bytes:
        """The request's image bytes (see :mod:`.body`), read under an upload permit and *outside* any inference
        slot: call it before ``admission.slot()``. 413 (declared or streamed size), 415, 400, 408, 429."""
        return await self._read(request, read_image_bytes)

    async def read_body(self, request: Request) -> bytes:
        """The request's whole body whatever its type (the ``/v2`` front's tensors), as :meth:`read_image` reads."""
        return await self._read(request, read_body)

    async def _read(self, request: Request, reader: Callable[[Request, int, float, float | None], Awaitable[bytes]]
                    ) -> bytes:
        limit = self.settings.max_body_bytes
        check_declared_length(request, limit)  # before taking a permit: refusing costs nothing
        async with self.uploads.permit():
            return await reader(request, limit, self.http.body_timeout_s, self.http.body_idle_timeout_s)


async def get_gateway(request: Request) -> Gateway:
    """The app's :class:`Gateway` (set by the lifespan): the one place that knows where it is kept.

    ``async`` (as every dependency here) on purpose: FastAPI runs a plain ``def`` dependency in the threadpool,
    two thread hops per request for a lookup (measured: benchmarks/gateway_profile.py)."""
    return request.app.state.gateway


async def get_settings(gw: Annotated[Gateway, Depends(get_gateway)]) -> Settings:
    return gw.settings


GatewayDep = Annotated[Gateway, Depends(get_gateway)]
SettingsDep = Annotated[Settings, Depends(get_settings)]

_api_key_header = APIKeyHeader(name="X-API-Key", auto_error=False,
                               description="API key, when the server was started with one")
_bearer = HTTPBearer(auto_error=False, description="Alternative to X-API-Key: `Authorization: Bearer KEY`")


async def require_api_key(
    request: Request,
    settings: SettingsDep,
    key: Annotated[str | None, Security(_api_key_header)] = None,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)] = None,
) -> None:
    """401 unless the request carries the configured key (constant-time compare); open when none is set. A
    request that carries it is marked (``request.state.api_key``) for the rate limit's bucket."""
    expected = settings.api_key
    if expected is None:
        return
    given = key if key is not None else (bearer.credentials if bearer is not None else None)
    if given is None or not hmac.compare_digest(given.encode(), expected.encode()):
        what = "missing" if given is None else "wrong"
        raise ApiError(401, "unauthorized", f"{what} API key: send X-API-Key: KEY or Authorization: Bearer KEY",
                       {"WWW-Authenticate": "Bearer"})
    request.state.api_key = True


async def rate_limited(request: Request, gw: GatewayDep) -> None:
    """A token of the client's bucket (:mod:`.rate_limit`; nothing without ``UNROLL_RATE_LIMIT``): the API key's
    when the request carries the configured one, else its address's; 429 when it has none. The address is the
    peer's, or the ``X-Forwarded-For`` client's when the peer is a listed proxy (``UNROLL_TRUSTED_PROXIES``: uvicorn
    rewrites ``request.client`` then, and only then). The headers of an admitted request are left in
    ``request.state`` for :class:`.rate_limit.RateLimitHeaders`."""
    if gw.rate_limit is None:
        return
    key = "api-key" if getattr(request.state, "api_key", False) else \
        "addr:" + (request.client.host if request.client is not None else "unknown")
    try:
        request.state.rate_limit_headers = gw.rate_limit.admit(key)
    except ApiError:
        gw.metrics.rate_limited.inc()
        raise


def route_task(request: Request) -> str:
    """The task whose ``/v1`` route the request matched: the inference routes are made from the task registry
    (``Task.route``), one per task, so a route's path names its task."""
    path = getattr(request.scope.get("route"), "path", None)
    for task in tasks.routed():
        if path == f"/v1{task.route.path}":
            return task.name
    raise ApiError(404, "not_found", f"no task serves {path or request.url.path}")


def keyed_router(prefix: str = "/v1") -> APIRouter:
    """A router for one API concern: under ``prefix`` (``/v1``; ``/v2`` for the Triton-protocol front) and behind
    the API key and the rate limit when they are configured.

    Each concern's router carries the prefix itself (rather than being nested in a ``/v1`` router) so the
    route a request matched keeps its full template (``/v1/classify``), which the metrics label by.
    """
    return APIRouter(prefix=prefix, dependencies=[Depends(require_api_key), Depends(rate_limited)],
                     responses={401: COMMON_ERRORS[401], 429: COMMON_ERRORS[429]})
