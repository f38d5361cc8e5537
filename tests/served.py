"""Helpers for tests that classify through a real tritonserver and the real gateway (tests/ is on sys.path).

:func:`gateway_over_triton` starts both on a repository and always stops them; :func:`check_topk` compares the
gateway's answer with PyTorch's probabilities.
"""

from __future__ import annotations

import io
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image


@contextmanager
def gateway_over_triton(repo: Path, log_dir: Path, timeout_s: float = 180,
                        client_timeout_s: float = 60) -> Iterator[httpx.Client]:
    """tritonserver on ``repo`` (free ports, logs in ``log_dir``) and the gateway in front of it; yields a client
    of the gateway."""
    from unroll.serving.gateway.process import gateway_process
    from unroll.serving.gateway.settings import Settings
    from unroll.serving.triton import free_ports, start

    http, grpc, metrics = free_ports(3)
    with start(repo, http, grpc, metrics, log_file=log_dir / "triton.log", timeout_s=timeout_s,
               extra_args=["--exit-timeout-secs=2"]), \
            gateway_process(Settings(triton_url=f"127.0.0.1:{grpc}"), log_dir / "gateway.log") as base, \
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
