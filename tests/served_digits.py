"""Test helper: a served digit classifier answers as ONNX Runtime runs its graph (user-model deploy tests)."""

from __future__ import annotations

import io
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
from PIL import Image

from unroll.card import ModelCard
from unroll.data import mnist_split


def assert_served_like_onnx(base: str, name: str, graph: Path, card: ModelCard, count: int, top_k: int = 1) -> None:
    """The first ``count`` MNIST test digits, posted as PNGs to ``base``'s ``/v1/classify?model=name``, get the top
    class and label the graph gives with the card's default λ."""
    _, _, x, _ = mnist_split()
    expected = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"]).run(
        None, {"image": x[:count], "lam": np.full(count, card.lam.default, np.float32)})[0]
    with httpx.Client(base_url=base, timeout=30) as client:
        for i in range(count):
            buf = io.BytesIO()
            Image.fromarray(np.rint(x[i, 0] * 255).astype(np.uint8)).save(buf, "PNG")
            r = client.post(f"/v1/classify?model={name}&top_k={top_k}", content=buf.getvalue(),
                            headers={"Content-Type": "image/png"})
            assert r.status_code == 200, r.text
            top = r.json()["predictions"][0]
            assert top["index"] == int(expected[i].argmax()) and top["label"] == card.labels[top["index"]]
