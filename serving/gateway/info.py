"""``GET /v1/models``: what this gateway serves (with each model's card and Triton's tensors), and what it does
not serve, with the reason (no card, a λ rule, a solver block, not loaded, not configured)."""

from __future__ import annotations

import asyncio
from typing import Any

from unroll import tasks
from unroll.serving.gateway.catalog import Entry, routed_tasks
from unroll.serving.gateway.openapi import API_VERSION, errors
from unroll.serving.gateway.state import GatewayDep, v1_router

router = v1_router()


@router.get("/models", tags=["info"], summary="What this gateway serves (cards, Triton's tensors) and what it does "
                                              "not, with the reason", responses=errors(503, 504))
async def models(gw: GatewayDep) -> dict[str, Any]:
    snap = await gw.catalog.snapshot()
    t = gw.settings.ready_timeout_s
    served = [(task, i, snap.entries[name]) for task in routed_tasks() for i, name in enumerate(snap.served(task))]
    ready = await asyncio.gather(*(gw.backend.model_ready(e.name, t) for _, _, e in served))
    out = [_served(e, task, default=i == 0, ready=ok) for (task, i, e), ok in zip(served, ready, strict=True)]
    others = [{"name": e.name, "task": e.task, "state": e.state, "reason": e.reason}
              for e in snap.entries.values() if not e.served]
    return {"api_version": API_VERSION, "triton": {"protocol": gw.settings.triton_protocol, "ready": True},
            "models": out, "not_served": others}


def _served(e: Entry, task: str, default: bool, ready: bool) -> dict[str, Any]:
    card, info = e.card, e.info
    assert card is not None and info is not None
    entry: dict[str, Any] = {"name": e.name, "task": task, "ready": ready, "default": default,
                             "description": card.description}
    entry.update(tasks.get(task).listing(card, tuple(info.outputs[card.output].shape)))  # params, per task
    if card.iters is not None:  # any route: the counts served (serving/gateway/iterations.py)
        entry["params"]["iters"] = " | ".join(map(str, card.iters.counts)) + f" (trained: {card.iters.default})"
    entry["versions"] = [v.public() for v in e.versions]  # loaded versions and their traffic split (a canary)
    entry.update(info.public())
    entry["card"] = card.model_dump(mode="json")
    return entry
