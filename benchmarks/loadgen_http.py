"""The load engine's HTTP/1.1 client: keep-alive connections on asyncio streams, each request framed by ``h11``.

A profile measures the server, so the client's own cost per request must stay small beside it: every
millisecond of client CPU is latency a profile would blame on the server. Weighed: ``httpx`` and ``aiohttp`` each
spend several times this client's CPU per request on this machine's CPUs (not kept as a benchmark; the engine's own
CPU per request is in every profile and in ``python -m unroll.benchmarks.profile_agreement``'s results).
``h11`` (the HTTP/1.1 state machine ``httpx`` itself is built on) does the framing; this module only
keeps the connections: one per request in flight, opened when none is idle, never a cap (an open loop must not
wait on the client side for a free connection).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11

from unroll.errors import HttpError

#: Bytes read from a socket at a time.
READ_SIZE = 1 << 18


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    headers: dict[str, str]  #: names lower-case (the last of a repeated header)


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.h11 = h11.Connection(h11.CLIENT)

    async def exchange(self, request: bytes) -> Answer:
        self.writer.write(request)
        status, headers, chunks = 0, {}, []
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                data = await self.reader.read(READ_SIZE)
                if not data:
                    raise HttpError("disconnected", "the server closed the connection")
                self.h11.receive_data(data)
            elif isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode().lower(): v.decode(errors="replace") for k, v in event.headers}
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                self.h11.start_next_cycle()
                return Answer(status, b"".join(chunks), headers)
            elif isinstance(event, h11.ConnectionClosed):
                raise HttpError("disconnected", "the server closed the connection")

    @property
    def reusable(self) -> bool:
        return self.h11.our_state is h11.IDLE and self.h11.their_state is h11.IDLE

    def close(self) -> None:
        self.writer.close()


class HttpClient:
    """Requests to one ``http://host:port`` base URL, each on an idle keep-alive connection or a new one."""

    def __init__(self, base_url: str, timeout_s: float, headers: dict[str, str] | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"{base_url!r}: an http://HOST:PORT URL is needed (https is not supported)")
        self.host, self.port = parts.hostname, parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.timeout_s = timeout_s
        self._host_header = parts.netloc
        self._headers = list((headers or {}).items())
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()

    async def _connect(self) -> _Connection:
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        except OSError as e:
            raise HttpError("connect", f"cannot connect to {self.host}:{self.port}: {e.strerror or e}") from None
        conn = _Connection(reader, writer)
        self._open.add(conn)
        return conn

    def _frame(self, conn: _Connection, method: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        head = [("Host", self._host_header), ("Content-Length", str(len(body))), *self._headers, *headers.items()]
        return (conn.h11.send(h11.Request(method=method, target=self.prefix + path, headers=head))
                + conn.h11.send(h11.Data(data=body)) + conn.h11.send(h11.EndOfMessage()))

    async def request(self, method: str, path: str, body: bytes = b"",
                      headers: dict[str, str] | None = None) -> Answer:
        """Send one request and read its whole answer within the timeout; :class:`HttpError` when none came."""
        conn = self._idle.pop() if self._idle else None
        try:
            async with asyncio.timeout(self.timeout_s):
                if conn is None:
                    conn = await self._connect()
                answer = await conn.exchange(self._frame(conn, method, path, body, headers or {}))
        except TimeoutError:
            self._drop(conn)
            raise HttpError("timeout", f"no answer within {self.timeout_s:g} s") from None
        except HttpError:
            self._drop(conn)
            raise
        except (OSError, h11.ProtocolError) as e:
            self._drop(conn)
            raise HttpError("disconnected", f"{type(e).__name__}: {e}") from None
        except BaseException:  # cancelled mid-exchange: the connection's state is unknown
            self._drop(conn)
            raise
        if conn.reusable:
            self._idle.append(conn)
        else:
            self._drop(conn)
        return answer

    def _drop(self, conn: _Connection | None) -> None:
        if conn is not None:
            self._open.discard(conn)
            conn.close()

    async def aclose(self) -> None:
        for conn in list(self._open):
            self._drop(conn)
        self._idle.clear()

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
