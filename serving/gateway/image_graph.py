"""Run an image-to-image graph on Triton with bounded memory: whole, or in the windows its card's ``tiling`` gives.

An image whose sides fit in one window goes whole, one Triton call per ``max_batch_size`` items. A larger one
(``card.tiling``, :mod:`unroll.tiling`) goes as windows of one fixed shape, ``max_batch_size`` windows per call,
stitched back into the output as they return: every graph execution is bounded by ``max_batch_size`` windows
whatever the image's size, and the runtime sees one shape, so its memory stays flat. A request keeps at most
:data:`IN_FLIGHT` calls at Triton at once, so that its tensors waiting in Triton's queue stay bounded too (the
others run as soon as one returns; the dynamic batcher still mixes requests).

On a GPU model the window is also capped at its TensorRT profile's largest H×W, so an image larger than the
profile is cut to fit instead of being refused.

A model that takes encoded images (:mod:`unroll.serving.imaging.wire`) gets the upload's bytes instead
(:func:`~unroll.serving.imaging.wire.image_row`) and does all of this itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator

import numpy as np
from starlette.concurrency import run_in_threadpool

from unroll.errors import TritonRejected
from unroll.serving.gateway.catalog import Entry
from unroll.tiling import Job, Tiler

#: Triton calls one request keeps in flight: one computing, one queued behind it.
IN_FLIGHT = 2

Infer = Callable[[np.ndarray, np.ndarray], Awaitable[np.ndarray]]
"""``(items [n, C, h, w], per-item extra input [n]) → outputs [n, C, h, w]``: one Triton call."""


def tiler_for(entry: Entry, height: int, width: int) -> Tiler | None:
    """The windows of an ``height×width`` image for ``entry``'s graph, or ``None`` when it goes whole."""
    card, info = entry.card, entry.info
    assert card is not None and info is not None
    if card.tiling is None:
        return None
    hw = info.profile.hw(card.input.name) if info.profile is not None else None
    max_side = min(hw[1]) if hw is not None else None
    tiler = Tiler(height, width, card.tiling, max_side)
    return tiler if tiler.needed else None


async def run_image_graph(entry: Entry, batch: np.ndarray, extra: np.ndarray, infer: Infer) -> np.ndarray:
    """``batch`` ``[N, C, H, W]`` through ``entry``'s graph (``extra``: its per-item second input, e.g. σ)."""
    info = entry.info
    assert info is not None
    step = info.batch_limit  # max_batch_size, and never past the TensorRT profile's max batch
    if info.max_batch_size == 0 and len(batch) > 1:
        raise TritonRejected(f"{entry.name} does not batch, so it cannot take {len(batch)} items at once")
    tiler = tiler_for(entry, batch.shape[2], batch.shape[3])
    out = np.empty_like(batch)
    if tiler is None:
        chunks: Iterator = ((list(range(i, min(i + step, len(batch)))), None) for i in range(0, len(batch), step))

        def cut(idx: list[int], _: object) -> np.ndarray:
            return batch[idx[0]:idx[-1] + 1]

        def paste(idx: list[int], _: object, y: np.ndarray) -> None:
            out[idx[0]:idx[-1] + 1] = y
    else:
        means = tiler.means(batch)
        jobs = tiler.jobs(len(batch))
        chunks = ((jobs[i:i + step], tiler) for i in range(0, len(jobs), step))

        def cut(part: list[Job], t: Tiler) -> np.ndarray:
            return t.cut_batch(batch, part, means)

        def paste(part: list[Job], t: Tiler, y: np.ndarray) -> None:
            t.paste_batch(out, part, y)

    async def one(part, t) -> None:
        x = await run_in_threadpool(cut, part, t) if t is not None else cut(part, t)
        idx = [p[0] if isinstance(p, tuple) else p for p in part]
        y = await infer(x, extra[idx])
        if y.shape != x.shape:
            raise TritonRejected(f"{entry.name} returned shape {y.shape} for input {x.shape}")
        await run_in_threadpool(paste, part, t, y) if t is not None else paste(part, t, y)

    pending: set[asyncio.Task] = set()
    try:
        for part, t in chunks:
            if len(pending) >= IN_FLIGHT:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                _raise_first(done)
            pending.add(asyncio.ensure_future(one(part, t)))
        if pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            _raise_first(done)
    finally:
        for p in pending:  # after a failure: the request's other calls are abandoned
            p.cancel()
    return out


def _raise_first(done: set[asyncio.Task]) -> None:
    """Re-raise the first failure among finished calls (every exception is retrieved, so none is logged twice)."""
    errors = [e for e in (d.exception() for d in done) if e is not None]
    if errors:
        raise errors[0]
