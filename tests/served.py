"""Helpers for tests that classify through a real tritonserver and the real gateway (tests/ is on sys.path).

:func:`shared_triton` is the one tritonserver of a test session for tests that only send it requests (the
``demo_triton`` fixture of ``conftest.py``, with ``demo_gateway`` in front of it: the one gateway of default settings
for tests that only send it requests); :func:`gateway_over_triton` starts a server and a gateway of a test's own on a
repository and always stops them; :func:`check_topk` compares the gateway's answer with PyTorch's
probabilities.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from unroll.serving.triton import TritonHandle

#: What the shared server serves: `unroll serve`'s default models with every graph their cards name (λ rule, other
#: iteration counts), as `unroll serve` serves them.
DEMO_MODELS = ["sdnet-mnist", "csc-denoiser"]


@contextmanager
def shared_triton(onnx_dir: Path, root: Path) -> Iterator[TritonHandle]:
    """tritonserver on the demo models (free ports, repository and log under ``root``), stopped at the end.

    Shared by every test of a session that only sends it requests, through the session's gateway (``demo_gateway``)
    or one of its own settings: a test that stops, kills, loads or unloads a server starts its own
    (``gateway_over_triton`` or ``unroll serve``).
    Counts read from it (Triton's statistics, the metrics) are compared before and after, never from zero."""
    from unroll.pipeline import graphs_of
    from unroll.serving.repository import write_repository
    from unroll.serving.triton import free_ports, start

    write_repository("cpu", graphs_of(DEMO_MODELS, onnx_dir), root / "repo", onnx_dir=onnx_dir)
    with start(root / "repo", *free_ports(3), log_file=root / "triton.log", timeout_s=180,
               extra_args=["--exit-timeout-secs=2"]) as handle:
        yield handle


@contextmanager
def gateway_over_triton(repo: Path, log_dir: Path, timeout_s: float = 180,
                        client_timeout_s: float = 60) -> Iterator[httpx.Client]:
    """tritonserver on ``repo`` (free ports, logs in ``log_dir``) and the gateway in front of it; yields a client
    of the gateway."""
    from unroll.serving.triton import free_ports, start

    http, grpc, metrics = free_ports(3)
    with start(repo, http, grpc, metrics, log_file=log_dir / "triton.log", timeout_s=timeout_s,
               extra_args=["--exit-timeout-secs=2"]) as triton, \
            gateway_over(triton, log_dir, client_timeout_s) as client:
        yield client


@contextmanager
def gateway_over(triton: TritonHandle, log_dir: Path, client_timeout_s: float = 60) -> Iterator[httpx.Client]:
    """A gateway (default settings, log in ``log_dir``) in front of a running tritonserver; yields its client."""
    from unroll.serving.gateway.process import gateway_process
    from unroll.serving.gateway.settings import Settings

    with gateway_process(Settings(triton_url=triton.grpc_url), log_dir / "gateway.log") as base, \
            httpx.Client(base_url=base, timeout=client_timeout_s) as client:
        yield client


def png(arr: np.ndarray | Image.Image, fmt: str = "PNG", **kw) -> bytes:
    img = arr if isinstance(arr, Image.Image) else Image.fromarray(arr)
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def softmax(logits: np.ndarray) -> np.ndarray:
    p = np.exp(logits - logits.max())
    return p / p.sum()


def check_topk(body: dict, probs: np.ndarray, top_k: int, labels: tuple[str, ...] | None) -> None:
    """The gateway's top-k are PyTorch's: scores within 1e-4, order swapped only by near-ties, labels from the card."""
    preds = body["predictions"]
    assert len(preds) == top_k
    order = np.argsort(-probs, kind="stable")
    for rank, p in enumerate(preds):
        assert p["score"] == pytest.approx(float(probs[p["index"]]), abs=1e-4)
        if p["index"] != order[rank]:  # only a near-tie may swap places
            assert abs(probs[p["index"]] - probs[order[rank]]) < 1e-5, (rank, p, order[:top_k])
        assert p["label"] == (labels[p["index"]] if labels else str(p["index"]))


def recv_until_closed(s: socket.socket) -> bytes:
    """Every byte a server sends on ``s`` until it closes the connection (a reset ends it too)."""
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data


def paused_burst(pid: int, clients: list, model: str, requests: list[list], output: str) -> list[np.ndarray]:
    """``requests`` (gRPC inputs) sent with ``async_infer``, round-robin over ``clients``, while tritonserver ``pid``
    is stopped (SIGSTOP … SIGCONT, a real stall): on SIGCONT every request is queued at once and the dynamic batcher
    forms batches of them (a server that keeps up would run each alone). Each request's ``output``, in order."""
    results: dict[int, np.ndarray] = {}
    errors: list = []
    done = threading.Semaphore(0)

    def callback(i: int):
        def cb(result, error) -> None:
            if error is not None:
                errors.append(error)
            else:
                results[i] = result.as_numpy(output)
            done.release()
        return cb

    os.kill(pid, signal.SIGSTOP)
    try:
        for i, inputs in enumerate(requests):
            clients[i % len(clients)].async_infer(model, inputs, callback(i))
        time.sleep(1.0)  # every request is sent (in the socket's buffers) while the server cannot read it
    finally:
        os.kill(pid, signal.SIGCONT)
    for _ in requests:
        assert done.acquire(timeout=60)
    assert not errors, [e.message() for e in errors[:3]]
    return [results[i] for i in range(len(requests))]
