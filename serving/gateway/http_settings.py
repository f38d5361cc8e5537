"""Limits of the HTTP layer (how long and how much a client may take to send a request), from ``UNROLL_*`` variables.

Kept apart from :class:`~unroll.serving.gateway.settings.Settings` (the gateway's model and inference limits)
because they are read by two layers: the uvicorn protocol (:mod:`.server`: header time, header and URL
size, access log) and the body reader (:mod:`.body`: idle gap, upload deadline, uploads at once). Same prefix, same
rule: a bad value is an error naming the variable, never ignored.

Memory bound of request bodies: at most ``max_uploads`` bodies are being read at once, each at most
``max_body_bytes`` (``Settings``); a body that has been read waits for an inference slot among at most
``max_concurrency + max_queue`` admitted requests. So bodies in memory ≤ ``(max_uploads + max_concurrency +
max_queue) × max_body_bytes`` (defaults: (64 + 8 + 32) × 20 MiB ≈ 2.0 GiB worst case, reached only by
clients that really send full-size bodies; an idle connection costs no body memory). Connections that
have not been admitted hold at most uvicorn's 64 KiB read buffer each (it stops reading beyond that).
"""

from __future__ import annotations

import ipaddress
from typing import Any

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from unroll.errors import SettingsError
from unroll.serving.gateway.settings import ENV_PREFIX

#: The variable that turns the access log on (also ``--access-log``; :attr:`HttpSettings.access_log`).
ACCESS_LOG_ENV = ENV_PREFIX + "ACCESS_LOG"


class HttpSettings(BaseSettings):
    """Time and size a client may spend on one request's head and body; past them: a JSON 408/413/414/431."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="ignore",
                                      use_attribute_docstrings=True)

    header_timeout_s: float = Field(10.0, gt=0, allow_inf_nan=False)
    """Time to send a request's line and headers, counted from the connection (or, on a kept-alive connection,
    from the next request's first byte); past it: 408 and the connection is closed (slow-loris)."""
    max_header_bytes: int = Field(16 * 1024, ge=1024)
    """Request line plus headers; over it: 431."""
    max_url_bytes: int = Field(8 * 1024, ge=256)
    """Request target (path and query string); over it: 414."""
    body_idle_timeout_s: float = Field(5.0, gt=0, allow_inf_nan=False)
    """Longest pause between two pieces of an upload; past it: 408 (a client that declares a body and sends
    nothing is cut off after this long, without ever holding an inference slot)."""
    body_timeout_s: float = Field(60.0, gt=0, allow_inf_nan=False)
    """Deadline of a whole upload, however steadily it trickles; past it: 408."""
    max_uploads: int = Field(64, ge=1)
    """Request bodies being read at once (memory: this × ``max_body_bytes``); beyond that: 429 at once. Above
    the 40 stalled connections that once locked every route, so such a wave no longer refuses anyone else."""
    max_connections: int = Field(1024, ge=1)
    """Client connections open at once, per gateway process; one more is answered 503 ``too_many_connections``
    (JSON) and closed at once, before it sends anything."""
    keep_alive_s: float = Field(75.0, gt=0, allow_inf_nan=False)
    """How long an idle kept-alive connection stays open between requests. Longer than the idle expiry of the
    clients and proxies in front (httpx 5 s, aiohttp 15 s, load balancers 60 s): the side that closes an idle
    connection first must be the client, else a request sent as the server closes is lost on the wire (RFC 9112
    §9.3.1). An idle connection holds no body and no slot; ``max_connections`` bounds them."""
    access_log: bool = False
    """One JSON line per request on stdout (``method``, ``path``, ``status``, ``ms``, ``client``, ``bytes``,
    ``request_id``); off by
    default, when it costs nothing (``UNROLL_ACCESS_LOG=1`` or ``--access-log`` turns it on)."""

    trusted_proxies: str = ""
    """The proxies whose ``X-Forwarded-For`` / ``X-Forwarded-Proto`` name the client: comma-separated addresses or
    networks (``10.0.0.5,192.168.0.0/24``; ``0.0.0.0/0`` trusts everyone). Empty (the default): the headers are
    ignored, so a client cannot pick its own address, and with it its rate-limit bucket (:mod:`.rate_limit`).
    uvicorn's own default (trust loopback, or ``FORWARDED_ALLOW_IPS``) is not used."""

    @field_validator("trusted_proxies")
    @classmethod
    def _proxies(cls, v: str) -> str:
        """Each entry an address or network (host bits allowed), written canonically: uvicorn would take a typo for
        a name that matches no peer, and silently trust nobody."""
        nets = []
        for item in (x.strip() for x in v.split(",")):
            if not item:
                continue
            try:
                nets.append(str(ipaddress.ip_network(item, strict=False)))
            except ValueError:
                raise ValueError(f"expected comma-separated IP addresses or networks (e.g. 127.0.0.1,10.0.0.0/8), "
                                 f"not {item!r}") from None
        return ",".join(nets)

    def __init__(self, **values: Any) -> None:
        """Keyword values win over ``UNROLL_*`` variables; a bad value raises :class:`SettingsError`."""
        try:
            super().__init__(**values)
        except ValidationError as e:
            lines = [f"{ENV_PREFIX}{str(err['loc'][0]).upper() if err.get('loc') else 'settings'}: "
                     f"{err.get('msg', 'invalid')} (got {err.get('input')!r})" for err in e.errors()]
            raise SettingsError("invalid HTTP settings: " + "; ".join(lines)) from None

    def env(self) -> dict[str, str]:
        """The ``UNROLL_*`` variables that reproduce these settings (to start a gateway subprocess)."""
        return {ENV_PREFIX + name.upper(): str(getattr(self, name)) for name in type(self).model_fields}
