"""Operations routes, never behind the API key: ``/healthz`` (process alive), ``/readyz`` (Triton and every
served model ready), ``/metrics`` (Prometheus)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from unroll.errors import TritonError
from unroll.serving.gateway.catalog import Snapshot, routed_tasks
from unroll.serving.gateway.errors import error_response
from unroll.serving.gateway.openapi import error_doc
from unroll.serving.gateway.state import GatewayDep

router = APIRouter(tags=["ops"])


@router.get("/healthz", summary="The gateway process is alive (does not call Triton)")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="Triton is ready and every served model (and the λ rules they use) is loaded",
            responses={503: error_doc("not_ready", "model(s) not ready: my-denoiser", "Not ready (see Retry-After)")})
async def readyz(gw: GatewayDep) -> JSONResponse:
    t = gw.settings.ready_timeout_s
    retry = {"Retry-After": str(gw.settings.retry_after_s)}
    if not await gw.triton.server_ready(t):
        return error_response(503, "not_ready", "Triton is not reachable or not ready", retry, triton=False, models={})
    try:
        async with asyncio.timeout(t):
            snap = await gw.catalog.snapshot()
    except (TritonError, TimeoutError) as e:
        return error_response(503, "not_ready", f"cannot list Triton's models: {e or 'timed out'}", retry,
                              triton=True, models={})
    names = _required(snap, tuple(m for task in routed_tasks() for m in gw.settings.configured(task)))
    states = await asyncio.gather(*(gw.triton.model_ready(m, t) for m in names))
    ready = dict(zip(names, states, strict=True))
    if not names:
        return error_response(503, "not_ready", "Triton serves no model whose card says " + " or ".join(routed_tasks())
                              + " (see GET /v1/models)", retry, triton=True, models={})
    if all(states):
        return JSONResponse({"status": "ready", "triton": True, "models": ready})
    return error_response(503, "not_ready", "model(s) not ready: " + ", ".join(m for m, ok in ready.items() if not ok),
                          retry, triton=True, models=ready)


def _required(snap: Snapshot, configured: tuple[str, ...]) -> list[str]:
    """Served models, the λ rules their cards name, and every model the operator configured by name."""
    names: list[str] = []
    for task in routed_tasks():
        for name in snap.served(task):
            card = snap.entries[name].card
            names.append(name)
            if card is not None and card.lam is not None and card.lam.auto is not None:
                names.append(card.lam.auto)
    return list(dict.fromkeys([*names, *configured]))


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def prometheus(gw: GatewayDep) -> Response:
    return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)
