"""Batching at the HTTP tier (serving/gateway/batching.py) against a real tritonserver and real gateway processes.

Two gateways on one Triton: the default one batches, the other runs with ``UNROLL_BATCHING=false``. Concurrent
requests with different digits and different λ must each get exactly the answer the unbatched gateway gives the
same request alone, while the batching gateway's own metrics show that it sent fewer, larger Triton calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from unroll.serving.gateway.process import gateway_process, wait_ready
from unroll.serving.gateway.settings import Settings

pytestmark = pytest.mark.triton

MODEL = "sdnet-mnist"
N = 24


@pytest.fixture(scope="module")
def triton_grpc(demo_triton) -> str:
    """The session's tritonserver (the demo models)."""
    return demo_triton.grpc_url


@contextlib.contextmanager
def _gateway(triton_grpc: str, tmp: Path, **settings: object) -> Iterator[tuple[str, httpx.Client]]:
    with gateway_process(Settings(triton_url=triton_grpc, request_timeout_s=30, max_concurrency=16, **settings),
                         tmp / "gateway.log", ready_path="/healthz", timeout_s=60) as base, \
            httpx.Client(base_url=base, timeout=60) as client:
        wait_ready(base + "/readyz", timeout_s=60)
        yield base, client


def png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.rint(np.clip(arr, 0, 1) * 255).astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def requests() -> list[tuple[bytes, str]]:
    from unroll.data import mnist_split

    _, _, x, _ = mnist_split()
    lams = ["0.05", "0.1", "0.2", "0.3"]
    return [(png(x[i, 0]), lams[i % len(lams)]) for i in range(N)]


async def _fire(base: str, reqs: list[tuple[bytes, str]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        return await asyncio.gather(*(client.post(f"/v1/classify?top_k=3&lam={lam}", content=data,
                                                  headers={"Content-Type": "image/png"}) for data, lam in reqs))


def _triton_calls(metrics: str) -> float:
    """Triton inference calls the gateway made for the model (its round-trip histogram's count)."""
    m = re.search(rf'^unroll_gateway_triton_request_duration_seconds_count'
                  rf'{{model="{MODEL}",outcome="ok",version="\d*"}} (\S+)$', metrics, re.M)
    return float(m.group(1)) if m else 0.0


def test_concurrent_requests_share_triton_calls_and_keep_their_own_answers(
        triton_grpc: str, requests: list[tuple[bytes, str]], tmp_path_factory: pytest.TempPathFactory) -> None:
    with _gateway(triton_grpc, tmp_path_factory.mktemp("batched")) as (batched_base, batched), \
            _gateway(triton_grpc, tmp_path_factory.mktemp("single"), batching=False) as (_, single):
        alone = [single.post(f"/v1/classify?top_k=3&lam={lam}", content=data,
                                    headers={"Content-Type": "image/png"}) for data, lam in requests]
        before = _triton_calls(batched.get("/metrics").text)
        together: list[httpx.Response] = []
        for _ in range(3):  # a few waves: at least one of them must coalesce on a 2-core machine
            together = asyncio.run(_fire(batched_base, requests))
        calls = _triton_calls(batched.get("/metrics").text) - before
        for a, b in zip(alone, together, strict=True):
            assert a.status_code == b.status_code == 200, (a.text, b.text)
            ja, jb = a.json(), b.json()
            assert ja["lam"] == jb["lam"]
            assert [p["index"] for p in ja["predictions"]] == [p["index"] for p in jb["predictions"]]
            np.testing.assert_allclose([p["score"] for p in ja["predictions"]],
                                       [p["score"] for p in jb["predictions"]], atol=2e-6)
        assert calls < 3 * N, f"{calls:g} Triton calls for {3 * N} requests: nothing was batched"
        assert re.search(rf'^unroll_gateway_batch_items_sum{{model="{MODEL}"}} {float(3 * N)}$',
                         batched.get("/metrics").text, re.M)
        assert _triton_calls(single.get("/metrics").text) == N  # off: one Triton call per request
