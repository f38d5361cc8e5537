"""Per-client rate limit: a token bucket per API key (or per client address without one), ``UNROLL_RATE_LIMIT``.

``R`` requests per second with bursts of ``B`` (``"R/s,B"``, ``"R,B"`` or ``"R"`` for ``B = ceil(R)``): each ``/v1``
request takes a token; a client with none left gets a JSON 429 with ``Retry-After`` (whole seconds until a token)
and every ``/v1`` answer carries the IETF draft's ``RateLimit-Limit`` / ``RateLimit-Remaining`` /
``RateLimit-Reset`` (seconds until the bucket is full again) and ``RateLimit-Policy`` (``B;w=B/R``). The client is
its API key when the request carries the configured one (checked first by the route), else its address: the peer's,
or the one ``X-Forwarded-For`` names when the peer is a proxy the operator listed (``UNROLL_TRUSTED_PROXIES``,
:mod:`.http_settings`; none by default, so a forged header changes nothing). At most :data:`MAX_CLIENTS` buckets are
kept (least recently seen dropped first: a dropped client starts full), so a scan from many addresses cannot grow
memory without bound. Off (no bucket, no header) when unset.

The limit is the client's whatever worker answers it. With ``--workers N`` the kernel spreads a client's
connections over the worker processes, so per-process buckets would give it ``N`` times the stated rate; per-worker
shares (``R/N``, ``B/N``) would instead under-serve it whenever its requests land unevenly. So the workers share one
table (:class:`SharedBuckets`): fixed-size slots in a file every worker maps (``mmap``), each take done under an
exclusive ``flock`` (a few microseconds; the kernel releases it if a worker dies holding it). The supervisor creates
the file before it starts the workers and names it in :data:`SHARED_FILE_ENV` (:mod:`.workers`); one process keeps
its buckets in memory (:class:`Buckets`).
"""

from __future__ import annotations

import fcntl
import hashlib
import math
import mmap
import os
import re
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from unroll.serving.gateway.errors import ApiError

MAX_CLIENTS = 10_000
#: The bucket file the workers of one gateway share (set by :func:`.workers.run_workers` for its workers only).
SHARED_FILE_ENV = "UNROLL_RATE_LIMIT_SHARED_FILE"
_SPEC = re.compile(r"\s*(?P<rate>[0-9]*\.?[0-9]+)\s*(?:/\s*s)?\s*(?:,\s*(?P<burst>[0-9]+)\s*)?")


@dataclass(frozen=True)
class RateLimit:
    rate: float
    burst: int

    @classmethod
    def parse(cls, text: str) -> RateLimit:
        """``"R/s,B"`` / ``"R,B"`` / ``"R"`` → the limit; a ValueError says the accepted forms."""
        m = _SPEC.fullmatch(text)
        rate = float(m["rate"]) if m else 0.0
        if m is None or not math.isfinite(rate) or rate <= 0:
            raise ValueError(f"expected R/s,BURST (e.g. 10/s,20), R,BURST or R with R > 0, got {text!r}")
        burst = int(m["burst"]) if m["burst"] else max(1, math.ceil(rate))
        if burst < 1:
            raise ValueError(f"the burst is at least 1, got {text!r}")
        return cls(rate, burst)

    @property
    def window_s(self) -> float:
        """Seconds an empty bucket takes to fill."""
        return self.burst / self.rate


class Buckets:
    """Token buckets by client key, at most :data:`MAX_CLIENTS` (least recently seen evicted)."""

    def __init__(self, limit: RateLimit, max_clients: int = MAX_CLIENTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.max_clients, self.clock = limit, max_clients, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key → (tokens, at)

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: str) -> tuple[bool, float]:
        """Take one token for ``key``: (allowed, tokens left after)."""
        now = self.clock()
        tokens, at = self._buckets.pop(key, (float(self.limit.burst), now))
        allowed, tokens = self._spend(tokens, at, now)
        self._buckets[key] = (tokens, now)
        if len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)
        return allowed, tokens

    def _spend(self, tokens: float, at: float, now: float) -> tuple[bool, float]:
        """A bucket that held ``tokens`` at ``at``, refilled until ``now`` and a token taken if it has one: (allowed,
        tokens left)."""
        lim = self.limit
        tokens = min(float(lim.burst), max(0.0, tokens) + max(0.0, now - at) * lim.rate)
        allowed = tokens >= 1.0
        return allowed, tokens - 1.0 if allowed else tokens

    def admit(self, key: str) -> dict[str, str]:
        """Take a token for ``key``: the ``RateLimit-*`` headers of its answer, or a 429 :class:`ApiError` (with
        them and ``Retry-After``) when it has none left."""
        allowed, tokens = self.take(key)
        headers = self.headers(tokens)
        if not allowed:
            lim = self.limit
            wait = math.ceil((1.0 - tokens) / lim.rate)
            raise ApiError(429, "rate_limited", f"rate limit: {lim.rate:g} requests/s with bursts of {lim.burst} per "
                                                f"client (API key, else address); retry in {wait} s",
                           {**headers, "Retry-After": str(wait)})
        return headers

    def headers(self, tokens: float) -> dict[str, str]:
        """The ``RateLimit-*`` headers of an answer after which ``tokens`` are left."""
        lim = self.limit
        return {"RateLimit-Limit": str(lim.burst), "RateLimit-Remaining": str(int(tokens)),
                "RateLimit-Reset": str(math.ceil((lim.burst - tokens) / lim.rate)),
                "RateLimit-Policy": f"{lim.burst};w={lim.window_s:g}"}


class SharedBuckets(Buckets):
    """:class:`Buckets` that several processes share: slots in a file each maps, one ``flock`` around each take.

    A slot is (64-bit hash of the key, tokens, time of the last take on the system-wide monotonic clock); 0 marks an
    empty slot. A key lives in the first slots from its hash on (:data:`PROBE` of them); when they are all taken, the
    least recently seen of them is dropped (it starts full, as in :class:`Buckets`). Slots are never emptied, so a
    lookup stops at the first empty one. ``max_clients`` is the file's slot count (:meth:`create`)."""

    SLOT = struct.Struct("<Qdd")
    PROBE = 16

    def __init__(self, limit: RateLimit, path: str | Path, clock: Callable[[], float] = time.monotonic) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < self.SLOT.size:
                raise ValueError(f"{path}: not a rate-limit bucket file ({size} bytes)")
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        super().__init__(limit, size // self.SLOT.size, clock)

    @classmethod
    def create(cls, path: str | Path, max_clients: int = MAX_CLIENTS) -> Path:
        """A new, empty bucket file of ``max_clients`` slots at ``path`` (made before any process maps it)."""
        path = Path(path)
        with open(path, "wb") as f:
            f.truncate(max_clients * cls.SLOT.size)
        return path

    def __len__(self) -> int:
        return sum(1 for i in range(self.max_clients) if self.SLOT.unpack_from(self._map, i * self.SLOT.size)[0])

    def take(self, key: str) -> tuple[bool, float]:
        """Take one token for ``key``, whichever process asks: (allowed, tokens left after)."""
        h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") or 1
        slot, n, m = self.SLOT, self.max_clients, self._map
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            now = self.clock()  # read under the lock: the last take's time is never after it
            start, place, oldest = h % n, -1, math.inf
            tokens, at = float(self.limit.burst), now  # a client not in the table starts full
            for i in range(min(self.PROBE, n)):
                j = (start + i) % n
                kh, t, a = slot.unpack_from(m, j * slot.size)
                if kh == h:
                    place, tokens, at = j, t, a
                    break
                if kh == 0:  # the key is nowhere further: slots are never emptied
                    place = j
                    break
                if a < oldest:
                    place, oldest = j, a
            allowed, tokens = self._spend(tokens, at, now)
            slot.pack_into(m, place * slot.size, h, tokens, now)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        return allowed, tokens

    def close(self) -> None:
        """Unmap and close the file (the table stays for the other processes)."""
        self._map.close()
        os.close(self._fd)


def buckets_for(spec: str | None) -> Buckets | None:
    """The buckets of ``UNROLL_RATE_LIMIT`` ``spec`` (``None``: no limit): shared with the other workers when the
    supervisor named a bucket file (:data:`SHARED_FILE_ENV`), else this process's own."""
    if not spec:
        return None
    limit = RateLimit.parse(spec)
    shared = os.environ.get(SHARED_FILE_ENV)
    return SharedBuckets(limit, shared) if shared else Buckets(limit)


class RateLimitHeaders:
    """Pure ASGI middleware: adds the ``RateLimit-*`` headers the route's rate-limit dependency left in the request's
    state (``rate_limit_headers``) for an admitted request."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start":
                extra = (scope.get("state") or {}).get("rate_limit_headers")
                if extra:
                    message = {**message, "headers": [*message.get("headers", ()),
                                                      *((k.lower().encode(), v.encode()) for k, v in extra.items())]}
            await send(message)

        await self.app(scope, receive, send_with_headers)
