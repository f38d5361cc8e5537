"""Answer fast while Triton does not answer: a health probe in the background, and 503 for everyone waiting.

A Triton that stops answering (``kill -STOP``, a hung process, a server being replaced) would hold every request
until its deadline (``request_timeout_s``, a minute) although ``/readyz`` already says not ready. :class:`TritonWatch`
asks Triton whether it is live every quarter of ``triton_stall_s`` (live, not ready: a Triton loading a model
version is not ready, yet answers); once Triton has answered nothing for ``triton_stall_s`` (neither a probe nor any
other call: a gateway whose own event loop was busy for a while sees its probe time out although Triton answered
the inferences meanwhile) and a confirming probe goes unanswered too, the
requests waiting for Triton are cancelled and answered 503 ``triton_unavailable`` with ``Retry-After``, and new ones
are refused the same way unless a fresh probe (one at a time, shared by the requests that arrive meanwhile) finds it
back. With a warm standby (several Tritons in ``triton_url``) the stall moves calls to the next one instead, and
the first probe that finds it answering ends the stall. The supervisor of ``unroll serve`` decides separately
whether to replace the stalled server (after 20 s unready with no model loading).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from unroll.errors import TritonUnavailable
from unroll.serving.gateway.triton_client import TritonBackend

log = logging.getLogger("unroll.gateway")


class TritonWatch:
    """Whether Triton answers (:meth:`run` probes it), and the requests waiting for it (:meth:`waiting`)."""

    def __init__(self, backend: TritonBackend, stall_s: float) -> None:
        self.backend, self.stall_s = backend, stall_s
        self.last_answer = time.monotonic()
        self.stalled = False
        self._waiting: set[asyncio.Task] = set()
        self._cancelled: set[asyncio.Task] = set()
        self._probe: asyncio.Future[bool] | None = None

    async def run(self) -> None:
        """Probe until cancelled (the app's lifespan runs it)."""
        period = self.stall_s / 4
        while True:
            t0 = time.monotonic()
            ok = await self.backend.server_live(self.stall_s / 2)
            if not ok and not self.stalled and self.silent_s() >= self.stall_s:
                # Confirm first: a probe that timed out while this process was busy (a long decode holding the
                # event loop) is answered at once now; a stopped Triton stays silent.
                ok = await self.backend.server_live(self.stall_s / 4)
            self.observe(ok)
            await asyncio.sleep(max(0.0, period - (time.monotonic() - t0)))

    def silent_s(self) -> float:
        """Seconds since Triton last answered anything: a probe, or any call through the backend."""
        return time.monotonic() - max(self.last_answer, self.backend.last_answer)

    def observe(self, answered: bool) -> None:
        """One probe's outcome: a stall begins (waiting requests are answered 503) or ends."""
        now = time.monotonic()
        if answered:
            self.last_answer = now
            if self.stalled:
                log.warning("gateway: Triton answers again; requests go to it")
                self.stalled = False
            return
        if not self.stalled and self.silent_s() >= self.stall_s:
            self.stalled = True
            log.warning("gateway: Triton has not answered for %.1f s; answering 503 until it does (%d requests "
                        "were waiting for it)", self.silent_s(), len(self._waiting))
            for task in self._waiting:
                self._cancelled.add(task)
                task.cancel()
            self.backend.fail_over()  # a standby, if there is one, is asked from the next probe on

    async def admit(self) -> None:
        """Before a request waits for Triton: during a stall, Triton is asked again first (one probe shared by every
        request that arrives meanwhile, at most half of ``triton_stall_s``), so a Triton that came back is used at
        once; 503 while it still does not answer."""
        if not self.stalled:
            return
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self.backend.server_live(self.stall_s / 2))
        answered = await asyncio.shield(self._probe)
        self.observe(answered)
        if self.stalled:
            raise self.refusal()

    def refusal(self) -> TritonUnavailable:
        return TritonUnavailable(f"Triton has not answered for {self.silent_s():.1f} s (stopped, "
                                 "hung or restarting); retry later")

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Around one wait for Triton (after :meth:`admit`): answered 503 if a stall begins meanwhile."""
        task = asyncio.current_task()
        assert task is not None
        self._waiting.add(task)
        try:
            yield
        except asyncio.CancelledError:
            if task not in self._cancelled:  # not ours (the client left, the server stops): not ours to swallow
                raise
            self._cancelled.discard(task)
            task.uncancel()
            raise self.refusal() from None
        finally:
            self._waiting.discard(task)
            self._cancelled.discard(task)
