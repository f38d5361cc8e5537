"""``GET /v1/models``: what this gateway serves (with each model's card and Triton's tensors), and what it does
not serve, with the reason (no card, a λ rule, a solver block, not loaded, not configured). While Triton cannot be
read, the last catalog read, marked stale: a client listing models always gets an answer."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from unroll import tasks
from unroll.errors import TritonError
from unroll.serving.gateway.catalog import Entry, routed_tasks
from unroll.serving.gateway.openapi import API_VERSION, errors
from unroll.serving.gateway.state import Gateway, GatewayDep, keyed_router

router = keyed_router()


@router.get("/models", tags=["info"], summary="What this gateway serves (cards, Triton's tensors) and what it does "
                                              "not, with the reason", responses=errors(503, 504))
async def models(gw: GatewayDep) -> dict[str, Any]:
    """The catalog read from Triton now; while Triton cannot be read, the last one read, marked so (``triton.ready``
    false, its ``error`` and the catalog's age), with every model not ready; 503 when Triton was never read."""
    t = gw.settings.ready_timeout_s
    triton: dict[str, Any] = {"protocol": gw.settings.triton_protocol, "ready": True}
    last = gw.catalog.last_known
    try:  # with a catalog to fall back on, a slow Triton is waited for ready_timeout_s (the read goes on meanwhile)
        fresh = asyncio.ensure_future(gw.catalog.snapshot())
        fresh.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failure nobody waits for is not logged
        snap = await (asyncio.wait_for(asyncio.shield(fresh), t) if last is not None else fresh)
    except (TritonError, TimeoutError) as e:
        if last is None:
            raise
        snap = last
        triton.update(ready=False, error=str(e) or f"Triton did not list its models within {t:g} s",
                      catalog_age_s=round(time.monotonic() - last.taken_at, 1))
    served = [(task, i, snap.entries[name]) for task in routed_tasks() for i, name in enumerate(snap.served(task))]
    ready = [False] * len(served)
    if triton["ready"]:
        up, *ready = await asyncio.gather(gw.triton.server_ready(t), *(gw.triton.model_ready(e.name, t)
                                                                         for _, _, e in served))
        triton["ready"] = up
    out = [_served(gw, e, task, default=i == 0, ready=ok) for (task, i, e), ok in zip(served, ready, strict=True)]
    others = [{"name": e.name, "task": e.task, "state": e.state, "reason": e.reason}
              for e in snap.entries.values() if not e.served]
    return {"api_version": API_VERSION, "triton": triton, "models": out, "not_served": others}


def _served(gw: Gateway, e: Entry, task: str, default: bool, ready: bool) -> dict[str, Any]:
    card, info = e.card, e.info
    assert card is not None and info is not None
    entry: dict[str, Any] = {"name": e.name, "task": task, "ready": ready, "default": default,
                             "description": card.description}
    entry.update(tasks.get(task).listing(card, tuple(info.outputs[card.output].shape)))  # params, per task
    if card.iters is not None:  # any route: the counts served (serving/gateway/iterations.py)
        entry["params"]["iters"] = " | ".join(map(str, card.iters.counts)) + f" (trained: {card.iters.default})"
        entry["anytime"] = _anytime(gw, e)
    entry["versions"] = [v.public() for v in e.versions]  # loaded versions and their traffic split (a canary)
    entry.update(info.public())
    entry["card"] = card.model_dump(mode="json")
    return entry


def _anytime(gw: Gateway, e: Entry) -> dict[str, Any]:
    """The objective in force and, per count, the service time this gateway process has learned for it (ms per
    unit of work: a request, or a megapixel for image-to-image models; ``null``: not learned here yet)
    (:mod:`.anytime`)."""
    card = e.card
    assert card is not None and card.iters is not None
    fam = gw.anytime.families.get(e.name)
    rows = [{"iters": k, "trained": k == card.iters.default,
             "service_ms": round(fam.cost_ms[k], 3) if fam is not None and k in fam.cost_ms else None}
            for k in card.iters.counts]
    return {"objective": gw.settings.slo, "deadline_ms": gw.settings.deadline_ms,
            "service_ms_per": fam.unit if fam is not None else None, "counts": rows,
            "parallelism": round(fam.parallel, 2) if fam is not None else None}
