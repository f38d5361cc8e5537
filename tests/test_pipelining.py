"""Pipelined requests on one connection are answered in order, whatever follows them in the same packet.

A real gateway process (no Triton: ``/healthz``, ``/metrics`` and the refusals do not need it) and raw sockets: one
``sendall`` holds valid requests and then one the HTTP layer refuses (malformed, or a URL, head or transfer coding
over its limits). Every valid request gets its answer, in the order sent, and then the refusal (JSON,
``Connection: close``) ends the connection. Before the fix the refusal went out at once and the connection closed
under the earlier requests, whose answers were still being made: only the 400 came back.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
from served import recv_until_closed

from unroll.serving.gateway.http_settings import HttpSettings
from unroll.serving.gateway.process import gateway_process
from unroll.serving.gateway.settings import Settings
from unroll.serving.triton import free_ports

LIMITS = HttpSettings(max_header_bytes=4096, max_url_bytes=1024)
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
METRICS = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
MALFORMED = b"GARBAGE\x01 / HTTP/1.1\r\nHost: x\r\n\r\n"

Response = tuple[int, dict[str, str], bytes]


@pytest.fixture(scope="module")
def port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A gateway whose Triton is not running (nothing listens on its port); yields its port."""
    log = tmp_path_factory.mktemp("gw-pipelining") / "gateway.log"
    settings = Settings(triton_url=f"127.0.0.1:{free_ports(1)[0]}")
    with gateway_process(settings, log, ready_path="/healthz", timeout_s=60, http=LIMITS) as base:
        yield int(base.rsplit(":", 1)[1])


def exchange(port: int, raw: bytes) -> list[Response]:
    """Send ``raw`` in one ``sendall`` and read until the server closes: every response, in order."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(raw)
        data = recv_until_closed(s)
    return split_responses(data)


def split_responses(data: bytes) -> list[Response]:
    """The ``Content-Length``-framed responses in ``data`` (the gateway frames every answer here that way)."""
    out = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        assert sep, f"an incomplete response head: {data[:200]!r}"
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
        n = int(headers["content-length"])
        assert len(rest) >= n, f"a truncated body: {len(rest)} of {n} bytes"
        out.append((int(lines[0].split()[1]), headers, rest[:n]))
        data = rest[n:]
    return out


def assert_refusal(resp: Response, status: int, code: str) -> None:
    got, headers, body = resp
    assert got == status, (got, body)
    assert headers["connection"] == "close" and headers["content-type"].startswith("application/json")
    assert json.loads(body)["error"]["code"] == code


def assert_healthz(resp: Response) -> None:
    assert resp[0] == 200 and json.loads(resp[2]) == {"status": "ok"}, resp


def test_a_request_before_a_malformed_one_is_answered(port: int) -> None:
    responses = exchange(port, HEALTHZ + MALFORMED)
    assert [r[0] for r in responses] == [200, 400], responses
    assert_healthz(responses[0])
    assert_refusal(responses[1], 400, "bad_request")


def test_two_requests_before_a_malformed_one_are_answered_in_order(port: int) -> None:
    responses = exchange(port, HEALTHZ + METRICS + MALFORMED)
    assert [r[0] for r in responses] == [200, 200, 400], responses
    assert_healthz(responses[0])
    assert responses[1][1]["content-type"].startswith("text/plain") and b"unroll_gateway" in responses[1][2]
    assert_refusal(responses[2], 400, "bad_request")


@pytest.mark.parametrize(("bad", "status", "code"), [
    (b"GET /" + b"a" * 2000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "uri_too_long"),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 5000 + b"\r\n\r\n", 431, "headers_too_large"),
    (b"POST /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501, "not_implemented"),
    (b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", 400,
     "bad_request"),
    # the head is fine, the chunked body is not: the refused request was queued behind the first, never started
    (b"POST /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n", 400, "bad_request"),
], ids=["414", "431", "501", "both-framings", "bad-chunk"])
def test_every_refusal_waits_for_the_answers_before_it(port: int, bad: bytes, status: int, code: str) -> None:
    responses = exchange(port, HEALTHZ + HEALTHZ + bad)
    assert [r[0] for r in responses] == [200, 200, status], responses
    assert_healthz(responses[0])
    assert_healthz(responses[1])
    assert_refusal(responses[2], status, code)


def test_a_malformed_request_alone_is_still_refused_at_once(port: int) -> None:
    responses = exchange(port, MALFORMED + HEALTHZ)
    assert len(responses) == 1, responses
    assert_refusal(responses[0], 400, "bad_request")


def test_valid_pipelined_requests_keep_the_connection(port: int) -> None:
    """Without a refusal nothing changes: both answered, the connection stays open for the next request."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(HEALTHZ + HEALTHZ)
        data = b""
        while data.count(b'{"status":"ok"}') < 2:
            chunk = s.recv(65536)
            assert chunk, "the connection closed"
            data += chunk
        s.sendall(HEALTHZ)
        more = b""
        while b'{"status":"ok"}' not in more:
            chunk = s.recv(65536)
            assert chunk, "the connection closed"
            more += chunk
    assert [r[0] for r in split_responses(data + more)] == [200, 200, 200]
