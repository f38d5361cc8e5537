"""The gateway's HTTP layer against hostile and careless clients: real gateway processes, raw sockets.

Without Triton (the head is parsed and refused before the app, so no model is needed): slow-loris on the
headers, oversized URL and headers, conflicting body framing, malformed HTTP, all answered with the JSON
error shape and the server serving on; process metrics on ``/metrics``. With Triton (the body is read by
the inference routes): uploads that stall do not hold inference slots and are cut off in seconds; how many
bodies are read at once is bounded; clients that disconnect mid-upload or mid-inference are counted as
499, not 500, and leave no traceback in the log.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from served import recv_until_closed

from unroll.serving.gateway.http_settings import HttpSettings
from unroll.serving.gateway.process import gateway_process, wait_ready
from unroll.serving.gateway.settings import Settings
from unroll.serving.triton import free_ports

HEADER_TIMEOUT_S = 2.0
IDLE_S = 3.0
LIMITS = HttpSettings(header_timeout_s=HEADER_TIMEOUT_S, max_header_bytes=8192, max_url_bytes=2048,
                      body_idle_timeout_s=IDLE_S, body_timeout_s=30, max_uploads=64, keep_alive_s=2)


@contextlib.contextmanager
def gateway(tmp: Path, settings: Settings, http: HttpSettings = LIMITS) -> Iterator[tuple[str, int, Path]]:
    """A gateway process; yields (base URL, port, log file)."""
    log = tmp / "gateway.log"
    with gateway_process(settings, log, ready_path="/healthz", timeout_s=60, http=http) as base:
        yield base, int(base.rsplit(":", 1)[1]), log


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, Path]]:
    """A gateway whose Triton is not running (nothing listens on its port)."""
    with gateway(tmp_path_factory.mktemp("gw-bare"), Settings(triton_url=f"127.0.0.1:{free_ports(1)[0]}")) as g:
        yield g


def connect(port: int, timeout: float = 30.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    return s


def read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read one response until the server closes (every refusal here closes): status, headers, body."""
    data = recv_until_closed(s)
    assert data, "the server closed the connection without answering"
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    return status, headers, body


def assert_json_error(resp: tuple[int, dict[str, str], bytes], status: int, code: str) -> dict:
    got_status, headers, body = resp
    assert got_status == status, (got_status, body)
    assert headers["content-type"].startswith("application/json"), headers
    err = json.loads(body)["error"]
    assert err["code"] == code and err["message"], err
    return err


def send_and_read(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    with connect(port) as s:
        s.sendall(raw)
        return read_response(s)


def still_serving(base: str) -> None:
    assert httpx.get(base + "/healthz", timeout=10).status_code == 200


# --- The head: time, size, framing, syntax (no Triton needed) ------------------------------------------------


def test_slow_headers_are_cut_off(bare: tuple[str, int, Path]) -> None:
    """Slow-loris: a byte every 0.5 s would take minutes; the head deadline ends it with a JSON 408."""
    base, port, _ = bare
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 400
    with connect(port) as s:
        t0 = time.monotonic()
        sent = 0
        with contextlib.suppress(OSError):  # the server may close while we are still trickling
            for b in head:
                s.sendall(bytes([b]))
                sent += 1
                s.settimeout(0.5)
                try:
                    if s.recv(1, socket.MSG_PEEK):
                        break  # it answered
                except TimeoutError:
                    continue
        s.settimeout(30)
        resp = read_response(s)
    assert sent < len(head), "the whole trickled head was accepted"
    assert time.monotonic() - t0 < 60
    assert_json_error(resp, 408, "request_timeout")
    still_serving(base)


def test_silent_connection_is_closed(bare: tuple[str, int, Path]) -> None:
    _, port, _ = bare
    with connect(port) as s:
        assert s.recv(1) == b""  # closed after the head deadline, without an answer to a request never made


def test_kept_alive_connection_times_the_next_head(bare: tuple[str, int, Path]) -> None:
    """The head deadline covers every request on a connection, not only the first."""
    _, port, _ = bare
    with connect(port) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first
        s.sendall(b"GET /heal")  # then nothing more
        resp = read_response(s)
    assert_json_error(resp, 408, "request_timeout")


def test_unread_body_cannot_hold_the_connection(bare: tuple[str, int, Path]) -> None:
    """A body the app does not read (the route answered without it) may not be trickled forever."""
    _, port, _ = bare
    with connect(port) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        with contextlib.suppress(OSError):
            while time.monotonic() - t0 < 60:
                s.sendall(b"x")
                time.sleep(0.3)
        assert time.monotonic() - t0 < 60, "the connection stayed open while the unread body trickled"


def test_long_url_414(bare: tuple[str, int, Path]) -> None:
    base, port, _ = bare
    q = "x=" + "a" * 100_000
    err = assert_json_error(send_and_read(port, f"GET /healthz?{q} HTTP/1.1\r\nHost: x\r\n\r\n".encode()),
                            414, "uri_too_long")
    assert "2048" in err["message"]
    still_serving(base)


def test_big_headers_431_complete_or_not(bare: tuple[str, int, Path]) -> None:
    base, port, _ = bare
    many = "".join(f"X-H{i}: {'v' * 90}\r\n" for i in range(200))  # ~20 KB in one read, complete
    assert_json_error(send_and_read(port, f"GET /healthz HTTP/1.1\r\nHost: x\r\n{many}\r\n".encode()),
                      431, "headers_too_large")
    # an incomplete head over the limit (counted as it arrives) is refused the same way
    assert_json_error(send_and_read(port, f"GET /healthz HTTP/1.1\r\nHost: x\r\n{many}".encode()),
                      431, "headers_too_large")
    still_serving(base)


def trickle_and_read(port: int, pieces: list[bytes]) -> tuple[tuple[int, dict[str, str], bytes], int]:
    """Send ``pieces`` 0.1 s apart (stopping where the server has answered); the response and the pieces sent."""
    with connect(port) as s:
        sent = 0
        with contextlib.suppress(OSError):  # the server may close while we are still sending
            for piece in pieces:
                s.sendall(piece)
                sent += 1
                s.settimeout(0.1)
                try:
                    if s.recv(1, socket.MSG_PEEK):
                        break  # it answered
                except TimeoutError:
                    continue
        s.settimeout(30)
        return read_response(s), sent


def test_long_url_in_pieces_is_refused_before_it_ends(bare: tuple[str, int, Path]) -> None:
    """The target is counted as its pieces arrive: 414 once over the limit, not when (if ever) the line ends."""
    base, port, _ = bare
    pieces = [b"GET /healthz?x="] + [b"a" * 1000] * 10
    resp, sent = trickle_and_read(port, pieces)
    err = assert_json_error(resp, 414, "uri_too_long")
    assert "2048" in err["message"] and sent < len(pieces)
    still_serving(base)


def test_big_head_over_several_reads_is_refused_before_it_ends(bare: tuple[str, int, Path]) -> None:
    """Header bytes are counted as they arrive: an unfinished head is refused once over the limit (431)."""
    base, port, _ = bare
    pieces = [b"GET /healthz HTTP/1.1\r\nHost: x\r\n"] + [f"X-H{i}: {'v' * 1000}\r\n".encode() for i in range(30)]
    resp, sent = trickle_and_read(port, pieces)
    err = assert_json_error(resp, 431, "headers_too_large")
    assert "8192" in err["message"] and sent < len(pieces)
    still_serving(base)


def test_pipelined_requests_are_answered_in_order(bare: tuple[str, int, Path]) -> None:
    _, port, _ = bare
    raw = (b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /no-such-route HTTP/1.1\r\nHost: x\r\n\r\n"
           b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    with connect(port) as s:
        s.sendall(raw)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert re.findall(rb"HTTP/1.1 (\d+)", data) == [b"200", b"404", b"200"], data


def test_content_length_with_chunked_is_refused(bare: tuple[str, int, Path]) -> None:
    base, port, _ = bare
    raw = (b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\nContent-Length: 4\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n4\r\nabcd\r\n0\r\n\r\n")
    err = assert_json_error(send_and_read(port, raw), 400, "bad_request")
    assert "Content-Length" in err["message"] and "Transfer-Encoding" in err["message"]
    still_serving(base)


@pytest.mark.parametrize("raw", [b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nno colon here\r\n\r\n",
                                 b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
                                 b"GET /\x01 HTTP/1.1\r\n\r\n"])
def test_malformed_http_is_a_json_400(bare: tuple[str, int, Path], raw: bytes) -> None:
    base, port, _ = bare
    err = assert_json_error(send_and_read(port, raw), 400, "bad_request")
    assert "malformed" in err["message"]
    still_serving(base)


def test_unsupported_transfer_encoding_501(bare: tuple[str, int, Path]) -> None:
    raw = b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n"
    assert_json_error(send_and_read(bare[1], raw), 501, "not_implemented")


def test_transfer_codings_other_than_chunked_alone_are_501(bare: tuple[str, int, Path]) -> None:
    raw = b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n"
    assert_json_error(send_and_read(bare[1], raw), 501, "not_implemented")
    still_serving(bare[0])


def test_process_metrics(bare: tuple[str, int, Path]) -> None:
    text = httpx.get(bare[0] + "/metrics", timeout=10).text
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds",
                 "python_info", "python_gc_collections_total", "unroll_gateway_uploads_in_progress"):
        assert re.search(rf"^{name}(\{{.*\}})? ", text, re.M), name


def test_bad_http_settings_name_the_variable(tmp_path: Path) -> None:
    from unroll.errors import GatewayStartError

    with pytest.raises(GatewayStartError, match="UNROLL_BODY_IDLE_TIMEOUT_S"), \
            gateway_process(Settings(), tmp_path / "gw.log", ready_path="/healthz", timeout_s=30,
                            http=HttpSettings.model_construct(**{**LIMITS.model_dump(), "body_idle_timeout_s": -1})):
        pass


# --- Bodies: stalled uploads, upload bound, disconnects (Triton serves the models) ---------------------------


def png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def triton_grpc(demo_triton) -> str:
    """The session's tritonserver (the demo models)."""
    return demo_triton.grpc_url


@pytest.fixture(scope="module")
def digit() -> bytes:
    from unroll.data import mnist_split

    _, _, x, _ = mnist_split()
    return png(np.rint(np.clip(x[0, 0], 0, 1) * 255).astype(np.uint8))


def post_head(path: str, length: int, ctype: str = "image/png") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\nContent-Length: {length}\r\n\r\n".encode()


def metric(base: str, route: str, status: int) -> float:
    text = httpx.get(base + "/metrics", timeout=10).text
    m = re.search(rf'^unroll_gateway_requests_total\{{method="POST",route="{re.escape(route)}",status="{status}"\}} '
                  r"(\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.triton
def test_stalled_uploads_hold_no_slot_and_are_cut_off(triton_grpc: str, digit: bytes, tmp_path: Path) -> None:
    """40 clients declare a body and send none: with 2 slots and 2 queue places, others are still served
    (the stalled ones hold upload permits, not slots) and every stalled one gets a JSON 408 in seconds."""
    settings = Settings(triton_url=triton_grpc, max_concurrency=2, max_queue=2, request_timeout_s=20)
    with gateway(tmp_path, settings) as (base, port, log):
        wait_ready(base + "/readyz", 60)
        stalled = [connect(port) for _ in range(40)]
        try:
            for s in stalled:
                s.sendall(post_head("/v1/classify", 1000) + b"\x89PNG")  # 4 of 1000 bytes, then silence
            time.sleep(0.5)  # let them all reach the body read
            t0 = time.monotonic()
            with httpx.Client(base_url=base, timeout=60) as c:
                for _ in range(5):
                    r = c.post("/v1/classify", content=digit, headers={"Content-Type": "image/png"})
                    assert r.status_code == 200, r.text
            for s in stalled:
                err = assert_json_error(read_response(s), 408, "request_timeout")
                assert "stalled" in err["message"]
            assert time.monotonic() - t0 < 30  # cut off after IDLE_S, far from request_timeout_s × 40 / 2
        finally:
            for s in stalled:
                s.close()
        assert metric(base, "/v1/classify", 408) == 40
        assert metric(base, "/v1/classify", 429) == 0
        assert "Traceback" not in log.read_text()


@pytest.mark.triton
def test_uploads_at_once_are_bounded(triton_grpc: str, digit: bytes, tmp_path: Path) -> None:
    settings = Settings(triton_url=triton_grpc)
    limits = HttpSettings(**{**LIMITS.model_dump(), "max_uploads": 2, "body_idle_timeout_s": 20})
    with gateway(tmp_path, settings, limits) as (base, port, _):
        wait_ready(base + "/readyz", 60)
        held = [connect(port) for _ in range(2)]
        try:
            for s in held:
                s.sendall(post_head("/v1/classify", 1000))
            time.sleep(0.5)
            r = httpx.post(base + "/v1/classify", content=digit, headers={"Content-Type": "image/png"}, timeout=30)
            assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_requests", r.text
            assert "uploads" in r.json()["error"]["message"] and "Retry-After" in r.headers
            text = httpx.get(base + "/metrics", timeout=10).text
            assert "unroll_gateway_uploads_in_progress 2.0" in text
        finally:
            for s in held:
                s.close()
        deadline = time.monotonic() + 30
        while "unroll_gateway_uploads_in_progress 0.0" not in httpx.get(base + "/metrics", timeout=10).text:
            assert time.monotonic() < deadline, "upload permits were not given back after the clients left"
            time.sleep(0.2)
        r = httpx.post(base + "/v1/classify", content=digit, headers={"Content-Type": "image/png"}, timeout=30)
        assert r.status_code == 200, r.text


@pytest.mark.triton
def test_client_disconnects_are_499_not_500(triton_grpc: str, tmp_path: Path) -> None:
    """A client that leaves mid-upload, or while its (slow) denoising runs, is counted as 499, without a traceback."""
    settings = Settings(triton_url=triton_grpc, request_timeout_s=60)
    with gateway(tmp_path, settings) as (base, port, log):
        wait_ready(base + "/readyz", 60)
        with connect(port) as s:  # mid-upload: half of a 400 KB body, then gone
            s.sendall(post_head("/v1/denoise?sigma=25", 400_000) + b"\0" * 200_000)
        big = png(np.random.default_rng(0).integers(0, 256, (1024, 1024), dtype=np.uint8))
        with connect(port) as s:  # the whole body, then gone while Triton denoises it
            s.sendall(post_head("/v1/denoise?sigma=25", len(big)) + big)
            time.sleep(0.3)
        deadline = time.monotonic() + 60
        while metric(base, "/v1/denoise", 499) < 2:
            assert time.monotonic() < deadline, httpx.get(base + "/metrics", timeout=10).text
            time.sleep(0.2)
        assert metric(base, "/v1/denoise", 500) == 0
        text = log.read_text()
        assert "Traceback" not in text and "unhandled" not in text.lower(), text[-3000:]
