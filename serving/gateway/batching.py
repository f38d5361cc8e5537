"""Batching at the HTTP tier: concurrent Triton calls for the same model and tensor layout go as one call.

A gateway that makes one Triton call per HTTP request pays the client's per-call cost (protobuf, HTTP/2 frames, a
future, a Python-backend request) once per request; under load it would rather pay it once per batch, as Ray Serve's
``@serve.batch`` and BentoML's adaptive batching do. :class:`Batcher` wraps :class:`~.triton_client.TritonBackend`
with the same ``infer`` signature: the gateway's one path to Triton's inference (its other calls go to the backend):

- calls are grouped by model, requested outputs, ``class_count`` and every input's per-item shape and dtype (so each
  item's own λ/σ rides along as its own row of the batched tensor);
- a group sends at once while it has fewer than ``max_in_flight`` calls at Triton (no wait at low load: concurrency 1
  pays nothing); otherwise its calls wait until one returns, at most ``delay_s`` more when set, and go together, up
  to the model's batch limit (``max_batch_size`` and its TensorRT profile's max batch);
- every request keeps its own answer (its rows of each output) and its own errors: when Triton rejects a batch, each
  of its requests is retried alone so that only the faulty one fails; a call whose client left is dropped from its
  batch before it is sent;
- a batch at Triton waits inside ``waiting`` (the stall watch's, :meth:`.stall.TritonWatch.waiting`) as requests do:
  when Triton stalls, its calls are answered 503 and its place is free at once, so the next batches go to a standby
  (or to the same Triton once it answers) instead of queueing behind a call that hangs.

``UNROLL_BATCHING=false`` turns it off (``enabled=False``: one Triton call per request, straight through).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from unroll.errors import TritonRejected, TritonUnavailable
from unroll.serving import batch_rows
from unroll.serving.gateway import tracing
from unroll.serving.gateway.triton_client import TritonBackend

log = logging.getLogger("unroll.gateway")

Key = tuple[Any, ...]


@dataclass
class _Call:
    inputs: dict[str, np.ndarray]
    items: int
    future: asyncio.Future
    trace: Any = None  # the span context of its wait, while tracing is on (tracing.batch_wait)


@dataclass
class _Group:
    """The waiting calls of one key, and how many of its batches are at Triton."""

    model: str
    outputs: list[str]
    class_count: int | None
    limit: int
    version: str = ""
    waiting: list[_Call] = field(default_factory=list)
    in_flight: int = 0
    timer: asyncio.Handle | None = None


class Batcher:
    """The inference calls to a :class:`TritonBackend`, coalesced while concurrent (module docstring)."""

    def __init__(self, backend: TritonBackend, limit_of: Callable[[str], int], max_in_flight: int = 2,
                 delay_s: float = 0.0, observe: Callable[[str, int], None] | None = None,
                 enabled: bool = True, waiting: Callable[[], AbstractContextManager[None]] = nullcontext) -> None:
        self._backend, self._limit_of, self._waiting = backend, limit_of, waiting
        self.max_in_flight, self.delay_s, self.enabled = max_in_flight, delay_s, enabled
        self._observe = observe or (lambda model, items: None)
        self._groups: dict[Key, _Group] = {}
        self._tasks: set[asyncio.Task] = set()

    async def infer(self, model: str, inputs: dict[str, np.ndarray], outputs: list[str],
                    class_count: int | None = None, version: str = "") -> dict[str, np.ndarray]:
        """As :meth:`TritonBackend.infer`; the call may travel to Triton inside a larger batch."""
        if not self.enabled:
            return await self._backend.infer(model, inputs, outputs, class_count, version)
        limit = self._limit_of(model)
        items = len(next(iter(inputs.values())))
        if limit <= 1 or items >= limit:
            self._observe(model, items)
            return await self._backend.infer(model, inputs, outputs, class_count, version)
        key = (model, version, tuple(outputs), class_count,
               tuple((name, a.shape[1:], a.dtype.str) for name, a in sorted(inputs.items())))
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(model, list(outputs), class_count, limit, version)
        call = _Call(inputs, items, asyncio.get_running_loop().create_future())
        group.waiting.append(call)
        if sum(c.items for c in group.waiting) >= limit:
            self._send(key, group)
        elif group.in_flight < self.max_in_flight and group.timer is None:
            loop = asyncio.get_running_loop()  # calls arriving in this loop iteration (or within delay_s) join it
            group.timer = (loop.call_later(self.delay_s, self._due, key) if self.delay_s > 0
                           else loop.call_soon(self._due, key))
        return await tracing.batch_wait(call)  # call.future (a span over the wait when tracing is on)

    def _due(self, key: Key) -> None:
        group = self._groups.get(key)
        if group is not None:
            group.timer = None
            if group.waiting and group.in_flight < self.max_in_flight:
                self._send(key, group)

    def _send(self, key: Key, group: _Group) -> None:
        """Take waiting calls (up to the batch limit, skipping those whose client left) and send them as one."""
        if group.timer is not None:
            group.timer.cancel()
            group.timer = None
        batch: list[_Call] = []
        size = 0
        while group.waiting and size + group.waiting[0].items <= group.limit:
            call = group.waiting.pop(0)
            if not call.future.done():
                batch.append(call)
                size += call.items
        if not batch:
            if group.in_flight == 0:
                self._groups.pop(key, None)
            return
        group.in_flight += 1
        task = asyncio.ensure_future(self._run(key, group, batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, key: Key, group: _Group, batch: list[_Call]) -> None:
        try:
            with self._waiting():
                await self._answer(group, batch)
        except TritonUnavailable as e:  # the stall watch gave up on this batch's Triton: the same 503 for each call
            for c in batch:
                _settle(c.future, error=e)
        finally:
            group.in_flight -= 1
            if group.waiting:
                if sum(c.items for c in group.waiting) >= group.limit or self.delay_s <= 0:
                    self._send(key, group)
                elif group.timer is None:
                    group.timer = asyncio.get_running_loop().call_later(self.delay_s, self._due, key)
            elif group.in_flight == 0:
                self._groups.pop(key, None)

    async def _answer(self, group: _Group, batch: list[_Call]) -> None:
        self._observe(group.model, sum(c.items for c in batch))
        if len(batch) == 1:
            await self._alone(group, batch[0])
            return
        joined, sizes = batch_rows.join([c.inputs for c in batch])
        try:
            with tracing.batch(batch):  # the batch's span: child of its first request's wait, linked to the others'
                res = await self._backend.infer(group.model, joined, group.outputs, group.class_count, group.version)
        except TritonRejected:  # some item is at fault: each request alone, so only the faulty one fails
            await asyncio.gather(*(self._alone(group, c) for c in batch))
            return
        except Exception as e:  # Triton down or slow: the same answer for every request of the batch
            for c in batch:
                _settle(c.future, error=e)
            return
        for c, rows in zip(batch, batch_rows.split(res, sizes), strict=True):
            _settle(c.future, rows)

    async def _alone(self, group: _Group, call: _Call) -> None:
        try:
            with tracing.batch([call]):
                res = await self._backend.infer(group.model, call.inputs, group.outputs, group.class_count,
                                                group.version)
        except Exception as e:
            _settle(call.future, error=e)
        else:
            _settle(call.future, res)


def _settle(future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Answer a waiting call unless its client has gone (its future was cancelled)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
