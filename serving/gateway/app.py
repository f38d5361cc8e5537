"""The REST gateway (FastAPI): classification and denoising over HTTP in front of Triton.

``create_app(settings)`` assembles the routers — :mod:`.classify`, :mod:`.denoise`, :mod:`.info` under
``/v1`` and :mod:`.v2_front` (Triton's protocol, checked) under ``/v2``, both behind the API key
(:func:`.state.keyed_router`), :mod:`.ops` at the root — around one
:class:`~.state.Gateway` built in the lifespan (Triton client, model catalog, metrics, admission control)
and handed to the routes as a dependency. What is served is discovered from Triton (each model's card),
lazily, so the gateway may start before Triton.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI

from unroll import tasks
from unroll.serving import malloc, tracing_env
from unroll.serving.gateway import classify, denoise, errors, info, ops, tracing, v2_front
from unroll.serving.gateway.metrics import Metrics, MetricsMiddleware
from unroll.serving.gateway.openapi import API_VERSION, DESCRIPTION, TAGS, install_docs
from unroll.serving.gateway.rate_limit import RateLimitHeaders
from unroll.serving.gateway.request_id import RequestIdMiddleware
from unroll.serving.gateway.responses import JSONResponse
from unroll.serving.gateway.settings import Settings
from unroll.serving.gateway.state import Gateway
from unroll.serving.imaging import images
from unroll.tasks import Task

log = logging.getLogger("unroll.gateway")
#: The router of each kind of answer a task's route gives (``Route.answer``): JSON predictions or a PNG image.
ROUTES: dict[str, Callable[[Task], APIRouter]] = {"predictions": classify.routes, "image": denoise.routes}


def create_app(settings: Settings | None = None) -> FastAPI:
    """The gateway app; ``settings`` default to :meth:`Settings.from_env` (``UNROLL_*`` variables)."""
    settings = settings or Settings.from_env()
    images.set_pillow_limit(settings.max_pixels)
    malloc.apply()  # large request buffers go back to the OS when freed (serving/malloc.py)
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tracing.setup()  # per process (each worker): on only when the OTEL_* variables say so
        gateway = Gateway.create(settings, metrics)
        app.state.gateway = gateway
        log.info("gateway: Triton %s at %s; models discovered from it on first use", settings.triton_protocol,
                 settings.triton_url)
        refresher = asyncio.create_task(gateway.catalog.keep_fresh(settings.catalog_refresh_s))
        watcher = asyncio.create_task(gateway.watch.run()) if gateway.watch is not None else None
        try:
            yield
        finally:
            refresher.cancel()
            if watcher is not None:
                watcher.cancel()
            await gateway.triton.close()
            tracing.shutdown()

    # redirect_slashes=False: `/v1/classify/` is a JSON 404 naming the route meant, not a 307 with an empty body
    # (a redirected POST re-sends the upload). docs_url/redoc_url=None: install_docs serves them without a CDN.
    app = FastAPI(title="unroll gateway", version=API_VERSION, description=DESCRIPTION, lifespan=lifespan,
                  openapi_tags=TAGS, redirect_slashes=False, docs_url=None, redoc_url=None,
                  default_response_class=JSONResponse)
    errors.install(app, settings.retry_after_s)  # every UnrollError, Triton's failures included, in one handler
    app.add_middleware(RateLimitHeaders)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    if tracing_env.enabled():  # the server span, inside the request id (its attribute); absent when off
        app.add_middleware(tracing.TracingMiddleware)
    app.add_middleware(RequestIdMiddleware)  # outside the metrics: its log lines name the request too
    for task in tasks.routed():  # one /v1 route per task that has one, answered as the route says
        app.include_router(ROUTES[task.route.answer](task))
    for module in (info, v2_front, ops):  # /v1/models, /v2 (both behind the API key), then /healthz, ...
        app.include_router(module.router)
    install_docs(app)
    return app

