"""A client that leaves stops its work: through the real gateway and a real tritonserver, a classify request queued
behind a denoise (one inference slot) whose client disconnects is cancelled — counted in
``unroll_gateway_cancelled_total`` and as status 499, its slot never taken and nothing sent to Triton for it — and
the gateway goes on serving. tritonserver is paused (SIGSTOP) while the client leaves, so the denoise holds the slot
for certain however busy the machine is (a denoise that merely took long could end first on a loaded machine)."""

from __future__ import annotations

import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from served import png

from unroll.benchmarks.common import metric_sum
from unroll.data import mnist_split
from unroll.serving.gateway.process import gateway_popen
from unroll.serving.gateway.settings import Settings


@pytest.fixture(scope="module")
def stack(demo_triton, tmp_path_factory: pytest.TempPathFactory):
    """A gateway with one admission slot in front of the session's tritonserver (the demo models); it waits out the
    test's pause of Triton instead of calling it stalled."""
    root = tmp_path_factory.mktemp("cancel")
    settings = Settings(triton_url=demo_triton.grpc_url, max_concurrency=1, max_queue=4, batching=False,
                        triton_stall_s=600)
    with gateway_popen(settings, root / "gateway.log", args=("--log-level", "info")) as (base, _):
        yield base, demo_triton, root / "gateway.log"


def _triton_count(triton: str, model: str) -> int:
    stats = httpx.get(f"{triton}/v2/models/{model}/stats", timeout=10).json()["model_stats"]
    return sum(int(s["inference_stats"]["success"]["count"]) for s in stats)


def test_a_queued_request_whose_client_leaves_is_cancelled(stack) -> None:
    base, server, log = stack
    triton = f"http://{server.url}"
    port = int(base.rsplit(":", 1)[1])
    _, _, x, _ = mnist_split()
    digit = png((x[0, 0] * 255).round().astype(np.uint8))
    photo = png(np.random.default_rng(0).integers(0, 256, (256, 256), dtype=np.uint8))
    with httpx.Client(base_url=base, timeout=120) as c:
        assert c.post("/v1/classify", content=digit, headers={"Content-Type": "image/png"}).status_code == 200
        before = _triton_count(triton, "sdnet-mnist")
        cancelled_before = metric_sum(c.get("/metrics").text, "unroll_gateway_cancelled_total")
        with ThreadPoolExecutor(1) as pool:
            os.kill(server.pid, signal.SIGSTOP)  # the denoise takes the one slot and waits in Triton until SIGCONT
            try:
                slow = pool.submit(httpx.post, f"{base}/v1/denoise?sigma=25", content=photo,
                                   headers={"Content-Type": "image/png"}, timeout=120)
                deadline = time.monotonic() + 60
                while metric_sum(c.get("/metrics").text, "unroll_gateway_uploads_in_progress") > 0 or \
                        metric_sum(c.get("/metrics").text, "unroll_gateway_requests_in_flight") < 2:  # /metrics: 1
                    assert time.monotonic() < deadline and not slow.done()
                    time.sleep(0.02)
                _leave_while_queued(port, digit, c, deadline)
            finally:
                os.kill(server.pid, signal.SIGCONT)
            assert slow.result().status_code == 200  # the denoise it waited behind still finishes
        # the gateway goes on, and Triton never ran the cancelled classification
        assert c.post("/v1/classify", content=digit, headers={"Content-Type": "image/png"}).status_code == 200
        assert _triton_count(triton, "sdnet-mnist") == before + 1
        assert metric_sum(c.get("/metrics").text, "unroll_gateway_cancelled_total") == cancelled_before + 1
    assert "closed the connection before the response to POST /v1/classify" in log.read_text()


def _leave_while_queued(port: int, digit: bytes, c: httpx.Client, deadline: float) -> None:
    """Post ``digit`` on a raw connection, wait until it is queued for the slot, close the connection, and wait for
    the gateway to count it cancelled with its queue place freed."""
    before = metric_sum(c.get("/metrics").text, "unroll_gateway_cancelled_total")
    with socket.create_connection(("127.0.0.1", port)) as leaver:
        leaver.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                       + f"Content-Length: {len(digit)}\r\n\r\n".encode() + digit)
        while metric_sum(c.get("/metrics").text, "unroll_gateway_queue_depth") < 1:  # queued behind the denoise
            assert time.monotonic() < deadline, "the classification never waited for the slot"
            time.sleep(0.01)
    while metric_sum(c.get("/metrics").text, "unroll_gateway_cancelled_total") < before + 1:
        assert time.monotonic() < deadline, "the queued request was not cancelled"
        time.sleep(0.01)
    text = c.get("/metrics").text
    assert metric_sum(text, "unroll_gateway_queue_depth") == 0  # its place in the queue is free at once
    assert metric_sum(text, "unroll_gateway_requests_total", route="/v1/classify", status="499") == 1
