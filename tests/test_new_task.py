"""A task nobody in the package knows goes through the whole pipeline with no edit anywhere else.

The test defines a task of its own, per-pixel regression (an image in, an image of the same size out), as one
:class:`unroll.tasks.Task` object registered by name, and a tiny PyTorch module of that task registered with a card
that names it. Then every stage runs on it as on the shipped models: export → quantize (FP16, behind the task's
gate) → repo → a real tritonserver → the real gateway (uvicorn on a free port) on the route the task declares,
which answers a PNG equal to what ONNX Runtime computes from the served graph.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import torch
from PIL import Image
from torch import nn

from unroll import tasks
from unroll.card import InputCard
from unroll.registry import REGISTRY, register_model

TASK = "pixel-regression"
NAME = "toy-pixel-regressor"
#: The task: gated on the relative error of its output, served as a PNG on /v1/regress, nothing else special.
PIXEL_REGRESSION = tasks.Task(
    name=TASK, description="image → per-pixel values (an image of the same size)",
    gates={"fp32": {"rel_err": 1e-4}, "fp16": {"rel_err": 1e-2}, "int8": {"rel_err": 5e-2}},
    data="plain", same_shape_output=True,
    route=tasks.Route("/regress", "image", "regressor", "Per-pixel regression (PNG of the same size)"))


class Regressor(nn.Module):
    """conv → relu → conv → sigmoid: one value in [0, 1] per pixel, any H×W."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 1, 3, padding=1),
                                  nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The task and a model of it, registered from this file (random weights, saved as its committed ones)."""
    weights = tmp_path_factory.mktemp("toy_weights")
    tasks.register(PIXEL_REGRESSION)
    register_model(NAME, input_shape=(1, 32, 32), weights_dir=weights, card=dict(
        task=TASK, description="test-only per-pixel regressor", output="y",
        input=InputCard(name="x", shape=(1, -1, -1), colour="gray", min_size=16),
        data=dict(train="mnist-train", test="mnist-test"), precisions=("fp32", "fp16")))(Regressor)
    torch.manual_seed(0)
    torch.save(Regressor().state_dict(), weights / f"{NAME}.pt")
    try:
        yield
    finally:
        REGISTRY.pop(NAME, None)
        tasks.unregister(TASK)


class _Gateway:
    """The real gateway app in uvicorn on a free port, in this process (where the test's task is registered)."""

    def __init__(self, triton_grpc: int) -> None:
        import uvicorn

        from unroll.serving.gateway import Settings, create_app
        from unroll.serving.triton import free_ports

        self.port = free_ports(1)[0]
        app = create_app(Settings(triton_url=f"127.0.0.1:{triton_grpc}"))
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the gateway did not start")
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.mark.triton
@pytest.mark.slow
def test_new_task_goes_through_every_stage(toy: None, tmp_path: Path) -> None:
    from unroll.card import from_onnx
    from unroll.export.onnx_export import export_model
    from unroll.export.quantize import quantize
    from unroll.serving.repository import write_repository
    from unroll.serving.triton import free_ports, start

    onnx_dir, repo = tmp_path / "onnx", tmp_path / "repo"
    res = export_model(NAME, onnx_dir, naive=False)
    card = from_onnx(res.onnx_path)
    assert card.task == TASK and card.input.shape == (1, -1, -1)

    q = quantize(NAME, "fp16", onnx_dir)  # the task's gate: rel_err ≤ its fp16 tolerance
    assert q["passed"] and set(q["gate"]) == {"rel_err"}, q
    write_repository("cpu", [NAME], repo, precision="fp16", onnx_dir=onnx_dir)

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (40, 52), dtype=np.uint8)  # any H×W: the graph keeps the input's size
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    served = ort.InferenceSession(str(repo / NAME / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    y = served.run(None, {"x": (pixels / np.float32(255))[None, None].astype(np.float32)})[0][0, 0]
    expected = np.rint(np.clip(y, 0, 1) * 255).astype(np.int16)

    http, grpc, metrics = free_ports(3)
    with start(repo, http, grpc, metrics, log_file=tmp_path / "triton.log", timeout_s=120,
               extra_args=["--exit-timeout-secs=2"]), _Gateway(grpc) as base, \
            httpx.Client(base_url=base, timeout=30) as client:
        listing = client.get("/v1/models").json()
        entry = {m["name"]: m for m in listing["models"]}[NAME]
        assert entry["task"] == TASK and entry["default"], listing
        r = client.post("/v1/regress", content=buf.getvalue(), headers={"Content-Type": "image/png"})
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "image/png" and r.headers["X-Model"] == NAME
        got = np.asarray(Image.open(io.BytesIO(r.content)))
        assert got.shape == pixels.shape  # same size and mode as the upload
        assert np.abs(got.astype(np.int16) - expected).max() <= 1  # the served graph's answer, through Triton
        r = client.post("/v1/regress", params={"model": "nope"}, content=buf.getvalue(),
                        headers={"Content-Type": "image/png"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_model"
