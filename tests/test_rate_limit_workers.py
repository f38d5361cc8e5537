"""The rate limit means what it says: not dodged by a forged ``X-Forwarded-For``, not multiplied by ``--workers``.

Unit level: ``UNROLL_TRUSTED_PROXIES`` is checked and canonical, uvicorn is told to ignore proxy headers unless it
is set (whatever ``FORWARDED_ALLOW_IPS`` says), and :class:`SharedBuckets` opened twice on one file (two workers)
are one set of buckets. Then real 2-worker gateways (``python -m unroll.serving.gateway --workers 2``) and raw
sockets from chosen loopback addresses (127.0.0.x, one client each): a client that rotates ``X-Forwarded-For``
gets no more than its burst plus what the rate refilled; one client whose connections the kernel spreads over both
workers gets the same; a listed proxy's header names the client (a bucket per forwarded address), an unlisted
peer's does not. No Triton: the limit is taken before the route runs, so an admitted ``/v1/models`` is any answer
but 429 (here a 503, Triton being absent).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import uvicorn
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from unroll.errors import SettingsError
from unroll.serving.gateway.http_settings import HttpSettings
from unroll.serving.gateway.process import gateway_popen
from unroll.serving.gateway.rate_limit import RateLimit, SharedBuckets
from unroll.serving.gateway.server import uvicorn_options
from unroll.serving.gateway.settings import Settings
from unroll.serving.triton import free_ports, proc_stats

#: Slow refill, so what a test may get is its burst plus the little the rate adds while it runs.
SPEC = "0.05/s,3"
LIMIT = RateLimit.parse(SPEC)
WORKERS = 2
PROXY_NET = "127.0.0.0/30"  # 127.0.0.1 (the tests' proxy) to 127.0.0.3
UNLISTED = "127.0.0.5"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


# --- Settings and the shared table ------------------------------------------------------------------------------


def test_trusted_proxies_are_checked_and_canonical() -> None:
    assert HttpSettings().trusted_proxies == ""
    assert HttpSettings(trusted_proxies=" 127.0.0.1, 10.1.2.3/8 ,::1").trusted_proxies == \
        "127.0.0.1/32,10.0.0.0/8,::1/128"
    with pytest.raises(SettingsError, match="UNROLL_TRUSTED_PROXIES"):
        HttpSettings(trusted_proxies="127.0.0.1,localhost")


async def _app(scope: Any, receive: Any, send: Any) -> None:  # pragma: no cover - never called
    """An ASGI app for uvicorn's Config to wrap (or not) in its proxy-headers middleware."""


def test_uvicorn_trusts_proxy_headers_only_from_the_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "*")  # uvicorn's own variable changes nothing
    off = uvicorn.Config(_app, **uvicorn_options(HttpSettings()))
    off.load()
    assert off.proxy_headers is False and not isinstance(off.loaded_app, ProxyHeadersMiddleware)
    on = uvicorn.Config(_app, **uvicorn_options(HttpSettings(trusted_proxies="10.0.0.0/8")))
    on.load()
    assert isinstance(on.loaded_app, ProxyHeadersMiddleware)
    assert "10.1.2.3" in on.loaded_app.trusted_hosts and "127.0.0.1" not in on.loaded_app.trusted_hosts


def test_shared_buckets_are_one_table(tmp_path: Path) -> None:
    clock = Clock()
    path = SharedBuckets.create(tmp_path / "buckets", max_clients=64)
    a, b = SharedBuckets(RateLimit(2.0, 3), path, clock=clock), SharedBuckets(RateLimit(2.0, 3), path, clock=clock)
    try:
        assert [a.take("x")[0], b.take("x")[0], a.take("x")[0], b.take("x")[0]] == [True, True, True, False]
        assert b.take("y") == (True, 2.0)  # another client has its own bucket
        clock.t += 0.5  # one token back (2/s), whichever process takes it
        assert b.take("x") == (True, 0.0) and a.take("x")[0] is False
        clock.t += 10  # never more than the burst
        assert a.take("x") == (True, 2.0)
        for i in range(500):  # a scan of addresses: the table stays its size, the oldest go first
            a.take(f"scan-{i}")
        assert len(a) == len(b) <= 64
    finally:
        a.close()
        b.close()


# --- Real gateways with two workers -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def open_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """2 workers, rate limit :data:`SPEC`, proxy headers left at their default (ignored)."""
    yield from _gateway(tmp_path_factory.mktemp("rl-open"), HttpSettings())


@pytest.fixture(scope="module")
def proxied_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """2 workers, rate limit :data:`SPEC`, proxy headers trusted from :data:`PROXY_NET`."""
    yield from _gateway(tmp_path_factory.mktemp("rl-proxied"), HttpSettings(trusted_proxies=PROXY_NET))


class Gateway(NamedTuple):
    port: int
    pid: int  # the parent of the workers


def _gateway(tmp: Path, http: HttpSettings) -> Iterator[Gateway]:
    settings = Settings(triton_url=f"127.0.0.1:{free_ports(1)[0]}", rate_limit=SPEC)
    with gateway_popen(settings, tmp / "gateway.log", ready_path="/healthz", timeout_s=60, http=http,
                       workers=WORKERS) as (base, proc):
        yield Gateway(int(base.rsplit(":", 1)[1]), proc.pid)


def get(port: int, path: str, source: str, forwarded: str | None = None) -> tuple[int, bytes]:
    """``GET path`` on a new connection from the loopback address ``source``: (status, whole response)."""
    extra = f"X-Forwarded-For: {forwarded}\r\n" if forwarded else ""
    with socket.socket() as s:
        s.settimeout(30)
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{extra}Connection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split(None, 2)[1]), data


def most_allowed(started: float) -> int:
    """The most one client may have been admitted since ``started``: its burst, plus what the rate refilled."""
    return LIMIT.burst + int((time.monotonic() - started) * LIMIT.rate)


def test_a_forged_forwarded_for_is_no_new_client(open_gateway: Gateway) -> None:
    """A client that names a new address in each request's ``X-Forwarded-For`` is still one client (its peer), from
    loopback too (which uvicorn trusts by default)."""
    started = time.monotonic()
    codes = [get(open_gateway.port, "/v1/models", "127.0.0.1", f"203.0.113.{i}")[0] for i in range(20)]
    admitted = sum(c != 429 for c in codes)
    assert LIMIT.burst <= admitted <= most_allowed(started), codes
    assert codes[-1] == 429


def test_one_client_gets_the_stated_limit_across_workers(open_gateway: Gateway) -> None:
    """Kept-alive connections of one client on both workers (which worker holds each is read from /proc): a request
    on each draws on one bucket, not one per worker."""
    by_worker = spread_connections(open_gateway, "127.0.0.4", LIMIT.burst + 1)
    try:
        started = time.monotonic()
        codes = [request(conn, "/v1/models")[0] for conns in by_worker.values() for conn in conns]
    finally:
        for conns in by_worker.values():
            for conn in conns:
                conn.close()
    admitted = sum(c != 429 for c in codes)
    assert LIMIT.burst <= admitted <= most_allowed(started), codes


def spread_connections(gw: Gateway, source: str, each: int, timeout_s: float = 60.0) -> dict[int, list[socket.socket]]:
    """Connections from ``source``, opened until each of the gateway's workers holds at least ``each`` (the kernel
    hands a connection to whichever worker accepts first, and a worker still starting accepts none): {pid: conns}."""
    deadline = time.monotonic() + timeout_s
    by_worker: dict[int, list[socket.socket]] = {}
    while len(by_worker) < WORKERS or min(len(c) for c in by_worker.values()) < each:
        if time.monotonic() > deadline:
            raise AssertionError(f"connections did not reach {WORKERS} workers in {timeout_s:g} s: "
                                 f"{ {pid: len(c) for pid, c in by_worker.items()} }")
        conn = socket.socket()
        conn.settimeout(30)
        conn.bind((source, 0))
        conn.connect(("127.0.0.1", gw.port))
        by_worker.setdefault(holder(gw, conn, deadline), []).append(conn)
    return by_worker


def holder(gw: Gateway, conn: socket.socket, deadline: float) -> int:
    """The pid of the gateway worker that accepted ``conn`` (the process with the server side's socket inode)."""
    client_port = conn.getsockname()[1]
    while time.monotonic() < deadline:
        inodes = {f"socket:[{f[9]}]" for f in (ln.split() for ln in Path("/proc/net/tcp").read_text().splitlines()[1:])
                  if int(f[1].split(":")[1], 16) == gw.port and int(f[2].split(":")[1], 16) == client_port}
        for ps in proc_stats():
            if ps.ppid != gw.pid:
                continue
            with contextlib.suppress(OSError):  # a process that exits meanwhile
                fd_dir = Path(f"/proc/{ps.pid}/fd")
                if any(os.readlink(fd_dir / fd) in inodes for fd in os.listdir(fd_dir)):
                    return ps.pid
        time.sleep(0.02)  # not accepted yet
    raise AssertionError(f"no worker of {gw.pid} accepted the connection from port {client_port}")


def request(conn: socket.socket, path: str) -> tuple[int, bytes]:
    """``GET path`` on a kept-alive connection: (status, the response's head and body)."""
    conn.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?im)^content-length:\s*(\d+)", head)[1])
    while len(body) < length:
        body += conn.recv(65536)
    return int(head.split(None, 2)[1]), data


def test_a_listed_proxy_names_the_client(proxied_gateway: Gateway) -> None:
    port = proxied_gateway.port
    started = time.monotonic()
    # each forwarded address is a client of its own: more than a burst in all, every one admitted
    distinct = [get(port, "/v1/models", "127.0.0.1", f"198.51.100.{i}")[0] for i in range(2 * LIMIT.burst)]
    assert 429 not in distinct, distinct
    # one forwarded address, over two proxies of the listed network: its burst, then 429
    same = [get(port, "/v1/models", f"127.0.0.{1 + i % 2}", "192.0.2.7")[0] for i in range(10)]
    assert LIMIT.burst <= sum(c != 429 for c in same) <= most_allowed(started) and same[-1] == 429, same
    # a peer outside the list forges in vain: its own address is the client
    forged = [get(port, "/v1/models", UNLISTED, f"203.0.113.{i}")[0] for i in range(10)]
    assert LIMIT.burst <= sum(c != 429 for c in forged) <= most_allowed(started) and forged[-1] == 429, forged
