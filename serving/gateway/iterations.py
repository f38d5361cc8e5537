"""``iters=K``: a request's solver iteration count, served by the graph exported for that count.

A card with ``iters`` lists the counts served (:class:`unroll.card.IterCard`); the trained count is the model's
own graph, every other count a sibling graph (``IterCard.graph``) the catalog knows as the model's companion. A
count the card does not list is refused (422) with the allowed ones; a model without ``iters`` refuses any.
Under an objective (``UNROLL_SLO``, or the request's ``deadline_ms``) a request that pins no count gets the one
:mod:`.anytime`'s controller picks; every answer says which count served it and who set it (``X-Iters``,
``X-Iters-Set-By``).
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import Query

from unroll.serving.gateway.anytime import Family
from unroll.serving.gateway.catalog import Entry
from unroll.serving.gateway.errors import ApiError
from unroll.serving.gateway.query import ascii_digits
from unroll.serving.gateway.state import Gateway

#: The ``iters`` query parameter of the inference routes.
ItersQuery = Annotated[str | None, Query(
    description="Solver iterations to run, for models whose card lists the counts it serves (`iters` in GET "
                "/v1/models): one of those counts; omit for the trained count. More iterations cost latency and "
                "may help or hurt accuracy (docs/models.md: the robustness results)", examples=["4"])]

#: The ``deadline_ms`` query parameter of the inference routes.
DeadlineQuery = Annotated[str | None, Query(
    description="This request's deadline in ms from its arrival, for models whose card serves several iteration "
                "counts: unless `iters` pins one, the largest count predicted to answer in time serves it (as the "
                "deployment's objective, `slo` in GET /v1/models, does for requests without a deadline)",
                examples=["50"])]

SetBy = Literal["pinned", "controller", "default"]


def parse_iters(raw: str | None) -> int | None:
    """``iters`` query value: ``None`` (the trained count) or a positive integer."""
    if raw is None:
        return None
    try:
        k = int(ascii_digits(raw))
    except ValueError:
        raise ApiError(422, "invalid_parameter", f"iters: expected a whole number of iterations written with the "
                                                 f"digits 0-9 only (got {raw!r})") from None
    if k < 1:
        raise ApiError(422, "invalid_parameter", f"iters: at least 1 (got {k})")
    return k


def parse_deadline(raw: str | None) -> float | None:
    """``deadline_ms`` query value: ``None`` or a positive, finite number of milliseconds."""
    if raw is None:
        return None
    try:
        v = float(raw.strip())
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v <= 0:
        raise ApiError(422, "invalid_parameter", f"deadline_ms: expected a positive number of milliseconds "
                                                 f"(got {raw!r})")
    return v


@dataclass
class Iteration:
    """A request's iteration count as far as it is settled before its input is read: the model, the count it pins
    (``None``: none), the deadline it is held to (``None``: none) and when it arrived."""

    entry: Entry
    pinned: int | None
    deadline_ms: float | None
    arrived: float
    family: Family | None  #: the controller's view of the model (``None``: the card serves one count)


def iteration(gw: Gateway, entry: Entry, raw: str | None, deadline: str | None = None,
              arrived: float | None = None) -> Iteration:
    """``iters`` and ``deadline_ms`` checked (422 naming the problem) before any work: a count the card does not
    serve, a deadline for a model with one count only."""
    card = entry.card
    assert card is not None  # served entries have a card (catalog)
    k, d = parse_iters(raw), parse_deadline(deadline)
    spec = card.iters
    if spec is None:
        if k is not None:
            raise ApiError(422, "invalid_parameter", f"iters: {entry.name} serves one iteration count only (its card "
                                                     "lists no iters)")
        if d is not None:
            raise ApiError(422, "invalid_parameter", f"deadline_ms: {entry.name} serves one iteration count only (its "
                                                     "card lists no iters): there is no cheaper answer to trade for "
                                                     "time")
        return Iteration(entry, None, None, arrived or time.perf_counter(), None)
    if k is not None and k not in spec.counts:
        raise ApiError(422, "invalid_parameter", f"iters: {entry.name} serves {', '.join(map(str, spec.counts))} "
                                                 f"iterations (trained: {spec.default}; got {k})")
    assert spec.default is not None  # export fills it in
    fam = gw.anytime.family(entry.name, spec.counts, spec.default)
    return Iteration(entry, k, d if d is not None else gw.settings.deadline_ms, arrived or time.perf_counter(), fam)


@dataclass(frozen=True)
class Count:
    """The graph that answers and its count (``None``: a model without ``iters``), and who set it."""

    entry: Entry
    k: int | None
    set_by: SetBy

    def headers(self) -> dict[str, str]:
        return {} if self.k is None else {"X-Iters": str(self.k), "X-Iters-Set-By": self.set_by}


@asynccontextmanager
async def serving_count(gw: Gateway, it: Iteration, work: float = 1.0, unit: str = "request"
                        ) -> AsyncIterator[Count]:
    """The count that serves ``it`` (pinned, else the controller's pick under a deadline, else the trained one) with
    its graph, counted as in flight while the block runs; the answer counted per count, and as a miss when it is
    later than the deadline. ``work``: the request's size in ``unit`` (a request; an image's megapixels), so that a
    count's learned service time scales to it."""
    fam, card = it.family, it.entry.card
    assert card is not None
    if fam is None:
        yield Count(it.entry, None, "default")
        return
    fam.unit = unit
    served = gw.anytime.decide(fam, it.pinned, it.deadline_ms, it.arrived, work)
    set_by: SetBy = "pinned" if it.pinned is not None else "controller" if served.chosen else "default"
    assert card.iters is not None
    entry = it.entry if served.k == fam.default else await gw.catalog.companion(
        card.iters.graph(it.entry.name, served.k), it.entry.name, card.task)
    with gw.anytime.flight(fam, served.k, work):
        yield Count(entry, served.k, set_by)
    gw.metrics.iters_served.labels(it.entry.name, str(served.k), set_by).inc()
    if it.deadline_ms is not None and 1000.0 * (time.perf_counter() - it.arrived) > it.deadline_ms:
        gw.metrics.objective_misses.labels(it.entry.name).inc()
