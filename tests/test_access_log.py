"""The gateway's HTTP path: uvicorn's httptools protocol on uvloop, and no access-log line per request unless asked.

Real gateway processes (``python -m unroll.serving.gateway``, no Triton: ``/healthz`` and refusals need none). By
default nothing is written per request, not even at ``--log-level info`` (where uvicorn's own access log used to
write one line each); ``--access-log`` or ``UNROLL_ACCESS_LOG=1`` writes exactly one JSON line per request
(method, path, status, ms, client, bytes), for answers of the app and refusals of the HTTP layer alike, in one
worker or several.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
from pathlib import Path

import httpx
import pytest
from uvicorn.importer import import_from_string
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from unroll.serving.gateway.http_settings import ACCESS_LOG_ENV, HttpSettings
from unroll.serving.gateway.process import gateway_popen
from unroll.serving.gateway.server import GatewayProtocol, uvicorn_options
from unroll.serving.gateway.settings import Settings
from unroll.serving.gateway.workers import HTTP_PROTOCOL
from unroll.serving.triton import free_ports

KEYS = {"method", "path", "status", "ms", "client", "bytes", "request_id"}


def gateway(log: Path, *args: str) -> contextlib.AbstractContextManager[tuple[str, subprocess.Popen]]:
    """``python -m unroll.serving.gateway`` with ``args`` (no Triton behind it); its output in ``log``."""
    return gateway_popen(Settings(triton_url=f"127.0.0.1:{free_ports(1)[0]}"), log, ready_path="/healthz",
                         timeout_s=60, args=args)


def requests(base: str) -> None:
    """Five answers on one kept-alive connection, one on a fresh connection, a 404 and a refused request head."""
    with httpx.Client(base_url=base, timeout=10) as c:
        for i in range(5):
            assert c.get(f"/healthz?n={i}").status_code == 200
    assert httpx.post(base + "/v1/no-such-route?n=5", content=b"x", timeout=10).status_code == 404
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /healthz?n=6 HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 400")


def access_lines(log: Path) -> list[dict]:
    """The JSON access records of the requests :func:`requests` made (``n=`` in the path)."""
    out = []
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            assert set(rec) == KEYS, rec
            if "n=" in (rec["path"] or ""):
                out.append(rec)
    return out


def check_records(records: list[dict]) -> None:
    by_n = {int(r["path"].rsplit("n=", 1)[1]): r for r in records}
    assert len(records) == len(by_n) == 7, records  # one line per request, no more
    for i in range(5):
        r = by_n[i]
        assert (r["method"], r["path"], r["status"], r["bytes"]) == ("GET", f"/healthz?n={i}", 200, 15), r
        assert isinstance(r["ms"], float) and 0 <= r["ms"] < 10_000, r
        assert r["client"].startswith("127.0.0.1:"), r
        assert re.fullmatch("[0-9a-f]{32}", r["request_id"]), r  # the X-Request-Id the gateway generated
    assert (by_n[5]["method"], by_n[5]["status"]) == ("POST", 404), by_n[5]
    assert (by_n[6]["method"], by_n[6]["status"], by_n[6]["ms"], by_n[6]["request_id"]) == (None, 400, None, None), \
        by_n[6]  # refused before the app
    assert by_n[6]["bytes"] > 0


# --- In process: what uvicorn is told ----------------------------------------------------------------------------


def test_uvicorn_runs_the_httptools_protocol_on_uvloop_without_its_access_log() -> None:
    opts = uvicorn_options(HttpSettings())
    assert issubclass(opts["http"], GatewayProtocol) and issubclass(opts["http"], HttpToolsProtocol)
    assert opts["loop"] == "uvloop" and opts["access_log"] is False
    workers_protocol = import_from_string(HTTP_PROTOCOL)  # what --workers processes import
    assert issubclass(workers_protocol, GatewayProtocol)


def test_access_log_setting_is_off_by_default_and_read_from_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ACCESS_LOG_ENV, raising=False)
    assert HttpSettings().access_log is False
    monkeypatch.setenv(ACCESS_LOG_ENV, "1")
    assert HttpSettings().access_log is True


# --- Real gateway processes ----------------------------------------------------------------------------------------


def test_no_line_per_request_by_default_even_at_info(tmp_path: Path) -> None:
    log = tmp_path / "gw.log"
    with gateway(log, "--log-level", "info") as (base, proc):
        requests(base)
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
    text = log.read_text()
    assert "Uvicorn running" in text, text  # the log level really is info
    assert "healthz" not in text and "no-such-route" not in text, text  # neither uvicorn's line nor the gateway's
    assert "httptools/parser" in maps and "uvloop/loop" in maps  # the C parser and the uvloop event loop are loaded


def test_access_log_flag_writes_one_json_line_per_request(tmp_path: Path) -> None:
    log = tmp_path / "gw.log"
    with gateway(log, "--log-level", "warning", "--access-log") as (base, _):
        requests(base)
    check_records(access_lines(log))


def test_access_log_variable_turns_it_on_in_every_worker(tmp_path: Path) -> None:
    log = tmp_path / "gw.log"
    with gateway_popen(Settings(triton_url=f"127.0.0.1:{free_ports(1)[0]}"), log, ready_path="/healthz",
                       timeout_s=90, http=HttpSettings(access_log=True), workers=2) as (base, _):
        requests(base)
    check_records(access_lines(log))
