"""The HTTP server layer: uvicorn's h11 protocol with a header deadline, size limits and JSON refusals.

A protocol subclass rather than middleware, because an ASGI app is called only once a request's head is complete:
it can neither time a client that trickles its headers (slow-loris) nor refuse a head too large to parse, and
uvicorn bounds neither. :class:`GatewayH11Protocol` answers those (408, 414, 431, and 400 for a request framed by
both ``Content-Length`` and ``Transfer-Encoding``) with the gateway's JSON error shape before the app runs.
``uvicorn_options`` gives the ``uvicorn.run`` arguments that install it (the pure-Python h11 parser: the hooks exist
only there).
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from unroll.errors import UnrollError
from unroll.serving.gateway.http_settings import HttpSettings

log = logging.getLogger("unroll.gateway")

#: h11's default: ``RemoteProtocolError`` hints 400 unless it knows better (431, 501).
_CODES = {400: "bad_request", 408: "request_timeout", 414: "uri_too_long", 431: "headers_too_large",
          501: "not_implemented"}


class Refusal(UnrollError):
    """A request refused by the HTTP layer, before the app: status, stable code, message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.http_status = status


def error_bytes(status: int, code: str, message: str) -> bytes:
    """A complete ``Connection: close`` HTTP/1.1 response with the gateway's JSON error body."""
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


def check_head(event: h11.Request, limits: HttpSettings) -> None:
    """Refuse a parsed request head that is too big or frames its body two ways (see the module docstring)."""
    if len(event.target) > limits.max_url_bytes:
        raise Refusal(414, "uri_too_long", f"request target is {len(event.target)} bytes; the limit is "
                                           f"{limits.max_url_bytes}")
    size = len(event.method) + len(event.target) + 12 + sum(len(k) + len(v) + 4 for k, v in event.headers)
    if size > limits.max_header_bytes:
        raise Refusal(431, "headers_too_large", f"request line and headers are {size} bytes; the limit is "
                                                f"{limits.max_header_bytes}")
    names = {k for k, _ in event.headers}  # h11 lower-cases names
    if b"content-length" in names and b"transfer-encoding" in names:
        raise Refusal(400, "bad_request", "both Content-Length and Transfer-Encoding are set; send one")


class _Connection(h11.Connection):
    """h11's server connection, reporting each parsed head to the protocol (deadline, checks)."""

    def __init__(self, protocol: GatewayH11Protocol, max_incomplete_event_size: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_incomplete_event_size)
        self._protocol = protocol

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as e:
            status = e.error_status_hint if e.error_status_hint in _CODES else 400
            self._protocol.refusal = Refusal(status, _CODES[status], f"malformed HTTP request: {e}")
            raise
        if isinstance(event, h11.Request):
            self._protocol.head_complete()
            try:
                check_head(event, self._protocol.limits)
            except Refusal as r:
                self._protocol.refusal = r
                raise h11.RemoteProtocolError(r.message, error_status_hint=r.status) from None
        return event


class GatewayH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a head deadline, head size checks and JSON refusals (module docstring)."""

    limits: ClassVar[HttpSettings]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _Connection(self, self.limits.max_header_bytes)
        self.refusal: Refusal | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._drain_timer: asyncio.TimerHandle | None = None
        self._head_bytes = False  # whether any byte of the pending head has arrived

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._stop_drain()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self._head_bytes = True
            if self._head_timer is None:
                self._arm()  # the next request on a kept-alive connection: its head is timed from its first byte
        super().data_received(data)
        if self.conn.their_state is h11.SEND_BODY and self.conn.our_state in (h11.DONE, h11.MUST_CLOSE):
            if self._drain_timer is None:  # answered; the rest of an unread body gets keep_alive_s, not forever
                self._drain_timer = self.loop.call_later(self.limits.keep_alive_s, self.transport.close)
        else:
            self._stop_drain()

    def _stop_drain(self) -> None:
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None

    def head_complete(self) -> None:
        self._disarm()
        self._head_bytes = False

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self._head_bytes:  # a client that sent nothing (an idle pre-connection) is closed without a word
            log.warning("closing %s: request headers not complete within %g s", _peer(self.client),
                        self.limits.header_timeout_s)
            self.transport.write(error_bytes(408, "request_timeout", "request headers not complete within "
                                                                     f"{self.limits.header_timeout_s:g} s"))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """Every request uvicorn refuses before the app (malformed, too big, conflicting framing): JSON, then close."""
        self._disarm()
        r = self.refusal or Refusal(400, "bad_request", f"malformed HTTP request: {msg}")
        self.refusal = None
        log.warning("refused a request from %s: %d %s", _peer(self.client), r.status, r.message)
        if not self.transport.is_closing():
            self.transport.write(error_bytes(r.status, r.code, r.message))
            self.transport.close()


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


class EnvGatewayH11Protocol(GatewayH11Protocol):
    """:class:`GatewayH11Protocol` with its limits from the ``UNROLL_*`` variables, read once per process: importable
    by name, which is how uvicorn's spawned workers get it (``--workers``, :mod:`.workers`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        cls = type(self)
        if "limits" not in cls.__dict__:
            cls.limits = HttpSettings()
        super().__init__(*args, **kwargs)


def protocol_class(limits: HttpSettings) -> type[GatewayH11Protocol]:
    """:class:`GatewayH11Protocol` bound to ``limits`` (uvicorn instantiates the class it is given)."""
    return type("GatewayH11Protocol", (GatewayH11Protocol,), {"limits": limits})


def uvicorn_options(limits: HttpSettings | None = None) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.run`` / ``uvicorn.Config`` that bound what one client can hold."""
    limits = limits or HttpSettings()
    return {"http": protocol_class(limits), "h11_max_incomplete_event_size": limits.max_header_bytes,
            "timeout_keep_alive": limits.keep_alive_s}
