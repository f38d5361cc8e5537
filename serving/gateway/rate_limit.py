"""Per-client rate limit: a token bucket per API key (or per client address without one), ``UNROLL_RATE_LIMIT``.

``R`` requests per second with bursts of ``B`` (``"R/s,B"``, ``"R,B"`` or ``"R"`` for ``B = ceil(R)``): each ``/v1``
request takes a token; a client with none left gets a JSON 429 with ``Retry-After`` (whole seconds until a token)
and every ``/v1`` answer carries the IETF draft's ``RateLimit-Limit`` / ``RateLimit-Remaining`` /
``RateLimit-Reset`` (seconds until the bucket is full again) and ``RateLimit-Policy`` (``B;w=B/R``). The client is
its API key when the request carries the configured one (checked first by the route), else its address. At most
:data:`MAX_CLIENTS` buckets are kept (least recently seen dropped first: a dropped client starts full), so a
scan from many addresses cannot grow memory without bound. Off (no bucket, no header) when unset.
"""

from __future__ import annotations

import math
import re
import time
from collections import OrderedDict
from dataclasses import dataclass

from unroll.serving.gateway.errors import ApiError

MAX_CLIENTS = 10_000
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

    def __init__(self, limit: RateLimit, max_clients: int = MAX_CLIENTS, clock=time.monotonic) -> None:
        self.limit, self.max_clients, self.clock = limit, max_clients, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key → (tokens, at)

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: str) -> tuple[bool, float]:
        """Take one token for ``key``: (allowed, tokens left after)."""
        now = self.clock()
        tokens, at = self._buckets.pop(key, (float(self.limit.burst), now))
        tokens = min(float(self.limit.burst), tokens + (now - at) * self.limit.rate)
        allowed = tokens >= 1.0
        if allowed:
            tokens -= 1.0
        self._buckets[key] = (tokens, now)
        if len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)
        return allowed, tokens

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
