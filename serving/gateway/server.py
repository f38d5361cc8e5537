"""The HTTP server layer: uvicorn's httptools protocol with a header deadline, size limits and JSON refusals.

A protocol subclass rather than middleware, because an ASGI app is called only once a request's head is complete:
it can neither time a client that trickles its headers (slow-loris) nor refuse a head too large to parse, and
uvicorn bounds neither. :class:`GatewayProtocol` answers those before the app runs, with the gateway's JSON error
shape, then closes the connection:

- **408** ``request_timeout``: the request line and headers are not complete ``header_timeout_s`` after the
  connection opened or, on a kept-alive connection, after the next request's first byte (a connection that never
  sent a byte is closed without a word);
- **414** ``uri_too_long``: the request target over ``max_url_bytes``, counted as its pieces arrive (``on_url``);
- **431** ``headers_too_large``: the request line and headers over ``max_header_bytes``, counted as the bytes arrive
  (a head still incomplete is refused as soon as it is over, not when it ends) and exactly once it is complete;
- **400** ``bad_request``: both ``Content-Length`` and ``Transfer-Encoding`` (request smuggling), or anything
  llhttp (httptools' parser) cannot parse; **501** ``not_implemented``: a transfer coding other than ``chunked``;
- **503** ``too_many_connections``: a connection over ``max_connections`` (answered as soon as it opens).

Each refusal is counted in ``unroll_gateway_http_refused_total{status, code}`` (the app's ``/metrics``).

Pipelined requests are answered in order whatever follows them: a refusal of a later request (its bytes in the same
read as earlier ones, as a pipelining client sends them) waits until every earlier request of the connection has its
answer, then goes out and the connection closes (:meth:`GatewayProtocol.on_response_complete`); nothing more is read
meanwhile. uvicorn would write the refusal at once and close, so the earlier answers, still being made, were lost.

An HTTP/1.0 client that asks for keep-alive gets it (uvicorn would close), so HTTP/1.0 load generators such as
``ab -k`` measure the server, not a TCP handshake per request.

A request body the app answered without reading may then be sent for ``body_idle_timeout_s`` at most (the drain
timer), not forever. A kept-alive connection whose idle time ends in the same event-loop turn as its next request
arrives is not closed under that request (:meth:`GatewayProtocol.timeout_keep_alive_handler`). The body's own
limits (idle gap, upload deadline, uploads at once) hold at the ASGI level
(:mod:`.body`, :class:`~.state.Uploads`). With ``access_log`` on, one JSON line per request goes to stdout
(:class:`AccessLog`, installed only then: nothing is spent on it when off). :func:`uvicorn_options` gives the
``uvicorn.run`` / ``uvicorn.Config`` arguments: this protocol, the uvloop event loop, uvicorn's own access log off.
"""

from __future__ import annotations

import asyncio
import fcntl
import http
import logging
import sys
import termios
import time
from typing import Any, ClassVar

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from unroll.errors import Refusal
from unroll.serving.gateway.http_settings import HttpSettings
from unroll.serving.gateway.metrics import HTTP_REFUSED
from unroll.serving.gateway.request_id import HEADER, log_config

log = logging.getLogger("unroll.gateway")
#: Where the one-line-per-request JSON records go when ``access_log`` is on (stdout, the message alone).
access_log = logging.getLogger("unroll.gateway.access")
REQUEST_ID_KEY = HEADER.lower().encode()


def error_bytes(status: int, code: str, message: str) -> bytes:
    """A complete ``Connection: close`` HTTP/1.1 response with the gateway's JSON error body."""
    body = error_body(code, message)
    head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


def error_body(code: str, message: str) -> bytes:
    """The gateway's JSON error shape, ``{"error": {"code", "message"}}``."""
    return orjson.dumps({"error": {"code": code, "message": message}})


# --- The limits: one check each ---------------------------------------------------------------------------------

def url_refusal(size: int, limits: HttpSettings) -> Refusal | None:
    """414 when the request target (``size`` bytes received so far) is over ``max_url_bytes``."""
    if size > limits.max_url_bytes:
        return Refusal(414, "uri_too_long", f"request target is {size} bytes; the limit is {limits.max_url_bytes}")
    return None


def head_refusal(size: int, limits: HttpSettings, complete: bool = True) -> Refusal | None:
    """431 when the request line and headers (``size`` bytes, or at least that many if not ``complete``) are over
    ``max_header_bytes``."""
    if size > limits.max_header_bytes:
        so_far = "" if complete else " so far (incomplete)"
        return Refusal(431, "headers_too_large", f"request line and headers are {size} bytes{so_far}; the limit is "
                                                 f"{limits.max_header_bytes}")
    return None


#: A body framed two ways: which one a proxy in front believes decides where the next request starts (smuggling).
BOTH_FRAMINGS = "both Content-Length and Transfer-Encoding are set; send one"


def transfer_coding_refusal(codings: list[bytes]) -> Refusal | None:
    """501 for a ``Transfer-Encoding`` other than exactly ``chunked`` (``codings``: its header values)."""
    if codings and [c.strip() for c in b",".join(codings).lower().split(b",")] != [b"chunked"]:
        shown = b", ".join(codings).decode("latin-1")
        return Refusal(501, "not_implemented", f"Transfer-Encoding {shown!r} is not supported; only chunked is")
    return None


def parse_refusal(error: Exception) -> Refusal:
    """The refusal of a request llhttp could not parse: 400, the framing message where both framings are set."""
    reason = str(error.__context__ or error) or type(error).__name__
    if "Content-Length" in reason and "Transfer-Encoding" in reason:  # llhttp: "X can't be present with Y"
        return Refusal(400, "bad_request", BOTH_FRAMINGS)
    return Refusal(400, "bad_request", f"malformed HTTP request: {reason}")


# --- The protocol -------------------------------------------------------------------------------------------------

class GatewayProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a head deadline, head size checks, a drain timer and JSON refusals (module
    docstring). ``limits`` is bound by :func:`protocol_class` (uvicorn instantiates the class it is given)."""

    limits: ClassVar[HttpSettings]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.limits.access_log:
            self.app = AccessLog(self.app)
        self.refusal: Refusal | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._drain_timer: asyncio.TimerHandle | None = None
        self._head_open = True  # waiting for, or reading, a request's line and headers
        self._head_bytes = False  # whether any byte of the pending head has arrived
        self._head_seen = 0  # bytes of the pending head received so far (counted per read)
        self._heads = 0  # heads completed on this connection
        self._begun = False  # a request has begun and not yet ended
        self._in_body = False  # between a head and the end of its body
        self._url_size = self._header_size = 0
        self._codings: list[bytes] = []
        #: A refusal waiting for the answers of the requests before it: (refusal, method, target) for the access log.
        self._deferred: tuple[Refusal, str | None, str | None] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:  # this one included
            self._refuse(Refusal(503, "too_many_connections", f"the gateway has {self.limits.max_connections} "
                                                              "connections open; retry later"))
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._stop_drain()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._deferred is not None:
            return  # a refused request ends what this connection will read; only earlier answers are still owed
        self._unset_keepalive_if_required()
        open_before, heads_before = self._head_open, self._heads
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as e:
            self._refuse(self.refusal or parse_refusal(e))
            return
        if self._head_open:
            if open_before and self._heads == heads_before:  # every byte of this read belongs to the pending head
                self._head_seen += len(data)
            elif not self._begun:  # the read ended with a request: nothing of the next one yet
                return
            # else a pipelined head began inside this read: its bytes there are not counted, the next reads are
            self._head_bytes = True
            if self._head_timer is None:
                self._arm()  # the next request on a kept-alive connection: its head is timed from its first byte
            r = head_refusal(self._head_seen, self.limits, complete=False)
            if r is not None:
                self._refuse(r)
        elif self._in_body and self.cycle.response_complete and self._drain_timer is None:
            # answered; the rest of an unread body may still trickle in for one idle gap, not forever
            self._drain_timer = self.loop.call_later(self.limits.body_idle_timeout_s, self.transport.close)

    # Parser callbacks: a Refusal raised here stops the parser; data_received answers it.

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._begun = True
        self._url_size = self._header_size = 0
        self._codings = []

    def on_url(self, url: bytes) -> None:
        self._url_size += len(url)
        self._raise(url_refusal(self._url_size, self.limits))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._header_size += len(name) + len(value) + 4
        if self.headers[-1][0] == b"transfer-encoding":
            self._codings.append(value)

    def on_headers_complete(self) -> None:
        self._disarm()
        self._head_open = self._head_bytes = False
        self._heads += 1
        method = self.parser.get_method()
        self.scope["method"] = method.decode("ascii")
        size = len(method) + self._url_size + 12 + self._header_size
        self._raise(head_refusal(size, self.limits) or transfer_coding_refusal(self._codings))
        self._in_body = True
        super().on_headers_complete()
        if self.parser.get_http_version() == "1.0" and self.parser.should_keep_alive():
            self._keep_alive_1_0()

    def _keep_alive_1_0(self) -> None:
        """An HTTP/1.0 request that asks ``Connection: keep-alive`` (as ``ab -k`` does) keeps its connection, and
        its answer says so (an HTTP/1.0 client closes otherwise); uvicorn alone closes every HTTP/1.0 connection."""
        cycle = self.cycle
        cycle.keep_alive = True
        cycle.default_headers = [*cycle.default_headers, (b"connection", b"keep-alive")]

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._begun = self._in_body = False
        self._head_open, self._head_seen = True, 0
        self._stop_drain()

    def _raise(self, refusal: Refusal | None) -> None:
        if refusal is not None:
            self.refusal = refusal
            raise refusal

    # Refusals and timers

    def send_400_response(self, msg: str) -> None:
        """uvicorn's refusal of what it cannot parse: the gateway's JSON instead of plain text."""
        self._refuse(self.refusal or Refusal(400, "bad_request", f"malformed HTTP request: {msg}"))

    def _refuse(self, r: Refusal) -> None:
        """Answer a refusal before the app (JSON, ``Connection: close``) and close; after the answers of the
        connection's earlier requests, when some are still being made (pipelining, module docstring)."""
        self._disarm()
        self.refusal = None
        HTTP_REFUSED.labels(str(r.status), r.code).inc()
        log.warning("refused a request from %s: %d %s", _peer(self.client), r.status, r.message)
        if self.transport.is_closing():
            return
        method = (self.scope or {}).get("method")  # known once the head is complete
        target = getattr(self, "url", b"")[:256].decode("latin-1") or None
        if self._answers_owed():
            self._deferred = (r, method, target)
            return
        self._send_refusal(r, method, target)

    def _answers_owed(self) -> bool:
        """Whether requests before the refused one still owe their answers. The refused request is the one whose
        head is being read or, inside a body, ``self.cycle``: queued behind others, it is dropped from the pipeline
        (never started, the refusal is its answer); running, it owes nothing before the refusal."""
        if self._in_body and self.pipeline and self.pipeline[0][0] is self.cycle:
            self.pipeline.popleft()  # uvicorn queues with appendleft: the newest is first
            return True
        if self.pipeline:
            return True
        return not self._in_body and self.cycle is not None and not self.cycle.response_complete

    def _send_refusal(self, r: Refusal, method: str | None, target: str | None) -> None:
        """Write the refusal, close, and log it when the access log is on (``method``/``target``: the refused
        request's, as far as they were read)."""
        self.transport.write(error_bytes(r.status, r.code, r.message))
        self.transport.close()
        if self.limits.access_log:
            write_access(method, target, r.status, None, self.client, len(error_body(r.code, r.message)))

    def on_response_complete(self) -> None:
        """uvicorn's: the next pipelined request starts; once the last one before a deferred refusal is answered,
        the refusal goes out and the connection closes."""
        queued = bool(self.pipeline)
        super().on_response_complete()
        if self._deferred is not None and not queued and not self.transport.is_closing():
            self._unset_keepalive_if_required()  # the idle timer uvicorn just armed
            deferred, self._deferred = self._deferred, None
            self._send_refusal(*deferred)

    def timeout_keep_alive_handler(self) -> None:
        """Close an idle kept-alive connection, unless its next request is already waiting in the socket.

        uvloop runs due timers before it reads: a request that arrived while the loop was busy, in the turn the idle
        time ran out, would be cut off unanswered (the client sees the connection close, not an answer: a lost
        request). Bytes waiting are read in this turn instead, and the timer is armed again after their answer."""
        if not self.transport.is_closing() and _bytes_waiting(self.transport) > 0:
            return
        super().timeout_keep_alive_handler()

    def _stop_drain(self) -> None:
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._head_open:
            return
        if self._head_bytes:  # a client that sent nothing (an idle pre-connection) is closed without a word
            self._refuse(Refusal(408, "request_timeout", "request headers not complete within "
                                                         f"{self.limits.header_timeout_s:g} s"))
            if self._deferred is not None:
                return  # the 408 goes out, and the connection closes, after the answers before it
        self.transport.close()


def _bytes_waiting(transport: asyncio.Transport) -> int:
    """Bytes received on ``transport``'s socket and not yet read (Linux ``FIONREAD``; 0 when it cannot be asked)."""
    sock = transport.get_extra_info("socket")
    try:
        buf = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except (AttributeError, OSError, ValueError):
        return 0
    return int.from_bytes(buf, sys.byteorder, signed=True)


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


# --- The access log (only when on) ----------------------------------------------------------------------------

def write_access(method: str | None, path: str | None, status: int, ms: float | None,
                 client: tuple[str, int] | None, size: int, request_id: str | None = None) -> None:
    """One access record: a JSON object on one line (``method``, ``path``, ``status``, ``ms``, ``client``,
    ``bytes``: the response body's; ``ms`` from the app's call to its last byte, ``null`` when refused before;
    ``request_id``: the response's ``X-Request-Id``, ``null`` when refused before the app)."""
    access_log.info(orjson.dumps({"method": method, "path": path, "status": status, "ms": ms,
                                  "client": _peer(client) if client else None, "bytes": size,
                                  "request_id": request_id}).decode())


def _setup_access_log() -> None:
    if not access_log.handlers:  # once per process (each --workers process sets up its own)
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        access_log.addHandler(handler)
        access_log.setLevel(logging.INFO)
        access_log.propagate = False


class AccessLog:
    """ASGI wrapper that writes one :func:`write_access` record per HTTP request once it is answered (status 499
    when the client left before an answer, 500 when the app failed before one)."""

    def __init__(self, app: Any) -> None:
        _setup_access_log()
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status, size, rid = 0, 0, None

        async def counted(message: Any) -> None:
            nonlocal status, size, rid
            if message["type"] == "http.response.start":
                status = message["status"]
                rid = next((v.decode("latin-1") for k, v in message.get("headers", ()) if k == REQUEST_ID_KEY), None)
            elif message["type"] == "http.response.body":
                size += len(message.get("body", b""))
            await send(message)

        failed = True
        try:
            await self.app(scope, receive, counted)
            failed = False
        finally:
            ms = round((time.perf_counter() - t0) * 1000.0, 3)
            path = scope.get("path", "")
            if scope.get("query_string"):
                path += "?" + scope["query_string"].decode("latin-1")
            write_access(scope.get("method"), path, status or (500 if failed else 499), ms, scope.get("client"),
                         size, rid)


# --- How uvicorn is told ------------------------------------------------------------------------------------------

class EnvGatewayProtocol(GatewayProtocol):
    """:class:`GatewayProtocol` with its limits from the ``UNROLL_*`` variables, read once per process: importable
    by name, which is how uvicorn's spawned workers get it (``--workers``, :mod:`.workers`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        cls = type(self)
        if "limits" not in cls.__dict__:
            cls.limits = HttpSettings()
        super().__init__(*args, **kwargs)


def protocol_class(limits: HttpSettings) -> type[GatewayProtocol]:
    """:class:`GatewayProtocol` bound to ``limits`` (uvicorn instantiates the class it is given)."""
    return type("GatewayProtocol", (GatewayProtocol,), {"limits": limits})


def uvicorn_options(limits: HttpSettings | None = None, http: type | str | None = None,
                    log_level: str = "info") -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.run`` / ``uvicorn.Config``: the gateway protocol bound to ``limits`` (or
    ``http``, e.g. the import string of :class:`EnvGatewayProtocol` for worker processes), the uvloop event loop,
    uvicorn's own access log off (``limits.access_log`` writes the gateway's, :class:`AccessLog`), proxy headers
    honoured only from ``limits.trusted_proxies`` (none by default: uvicorn's default trusts loopback, or
    ``FORWARDED_ALLOW_IPS``, which lets any local client pick its rate-limit bucket), and the logging of every
    gateway process (request ids, text or JSON: :func:`.request_id.log_config`) at ``log_level``."""
    limits = limits or HttpSettings()
    proxies = [p for p in limits.trusted_proxies.split(",") if p]
    return {"http": http or protocol_class(limits), "loop": "uvloop", "access_log": False,
            "proxy_headers": bool(proxies), "forwarded_allow_ips": proxies,
            "timeout_keep_alive": limits.keep_alive_s, "log_level": log_level, "log_config": log_config(log_level)}
