"""``iters=K``: a request's solver iteration count, served by the graph exported for that count.

A card with ``iters`` lists the counts served (:class:`unroll.card.IterCard`); the trained count is the model's
own graph, every other count a sibling graph (``IterCard.graph``) the catalog knows as the model's companion. A
count the card does not list is refused (422) with the allowed ones; a model without ``iters`` refuses any.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Query

from unroll.serving.gateway.catalog import Entry
from unroll.serving.gateway.errors import ApiError
from unroll.serving.gateway.query import ascii_digits
from unroll.serving.gateway.state import Gateway

#: The ``iters`` query parameter of the inference routes.
ItersQuery = Annotated[str | None, Query(
    description="Solver iterations to run, for models whose card lists the counts it serves (`iters` in GET "
                "/v1/models): one of those counts; omit for the trained count. More iterations cost latency and "
                "may help or hurt accuracy (docs/models.md: the robustness results)", examples=["4"])]


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


async def iteration_graph(gw: Gateway, entry: Entry, raw: str | None) -> tuple[Entry, int | None]:
    """The served graph that runs ``entry``'s model with the requested iteration count, and that count (the
    trained one when the request gives none; ``None`` for a model without ``iters``)."""
    card = entry.card
    assert card is not None  # served entries have a card (catalog)
    k = parse_iters(raw)
    spec = card.iters
    if spec is None:
        if k is not None:
            raise ApiError(422, "invalid_parameter", f"iters: {entry.name} serves one iteration count only (its card "
                                                     "lists no iters)")
        return entry, None
    if k is None or k == spec.default:
        return entry, spec.default
    if k not in spec.counts:
        raise ApiError(422, "invalid_parameter", f"iters: {entry.name} serves {', '.join(map(str, spec.counts))} "
                                                 f"iterations (trained: {spec.default}; got {k})")
    return await gw.catalog.companion(spec.graph(entry.name, k), entry.name, card.task), k
