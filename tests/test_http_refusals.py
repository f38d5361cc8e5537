"""The HTTP layer's refusals are counted, and the connection cap answers JSON: a real gateway process (no Triton
behind it) with ``UNROLL_MAX_CONNECTIONS=2`` refuses a third open connection with a JSON 503 at once, and
``/metrics`` counts that and a head too large (431) by status and code."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import httpx

from unroll.benchmarks.common import metric_sum
from unroll.serving.gateway.http_settings import HttpSettings
from unroll.serving.gateway.process import gateway_popen
from unroll.serving.gateway.settings import Settings
from unroll.serving.triton import free_ports


def _answer(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_connection_cap_and_refusals_in_metrics(tmp_path: Path) -> None:
    settings = Settings(triton_url=f"127.0.0.1:{free_ports(1)[0]}")
    with gateway_popen(settings, tmp_path / "gw.log", ready_path="/healthz",
                       http=HttpSettings(max_connections=2)) as (base, _):
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as a, socket.create_connection(("127.0.0.1", port)) as b:
            a.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # two open connections, one of them kept alive
            assert a.recv(4096).startswith(b"HTTP/1.1 200")
            with socket.create_connection(("127.0.0.1", port)) as c:
                answer = _answer(c)  # refused before sending a byte
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503") and b"connection: close" in head
            assert json.loads(body)["error"]["code"] == "too_many_connections"
            del b
        with socket.create_connection(("127.0.0.1", port)) as d:  # a head over the size limit: 431
            d.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n")
            assert _answer(d).startswith(b"HTTP/1.1 431")
        text = httpx.get(base + "/metrics", timeout=10).text
    assert metric_sum(text, "unroll_gateway_http_refused_total", status="503", code="too_many_connections") == 1
    assert metric_sum(text, "unroll_gateway_http_refused_total", status="431", code="headers_too_large") == 1
