"""A model nobody in the package knows goes through the whole pipeline with no edit anywhere else.

The test writes an *architecture file* of its own (a small digit classifier with a learned shrinkage
layer whose threshold λ is a per-sample input, registered with ``@register_model`` and a card), trains it
for a few seconds on the MNIST training digits, and then runs every stage on it exactly as on the shipped
models: export → quantize (FP16, behind the gate) → repo → a real tritonserver → the real gateway over
HTTP. Labels, λ default/bounds and the input layout reach the gateway only through the card.
"""

from __future__ import annotations

import importlib.util
import io
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from PIL import Image
from served import gateway_over_triton

ARCH_FILE = '''
import torch
from torch import nn

from unroll.card import InputCard, LamCard
from unroll.registry import register_model

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


class ShrinkDigits(nn.Module):
    """conv → relu(v − λ) (one non-negative ISTA-style shrinkage, λ per sample) → conv → linear."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(1, 16, 5, stride=2, padding=2)
        self.mid = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.head = nn.Linear(32 * 7 * 7, 10)
        self.lmbd = 0.05

    def forward(self, x, lam=None):
        v = self.enc(x)
        lam = torch.full((x.shape[0],), self.lmbd) if lam is None else lam
        z = torch.relu(v - lam.view(-1, 1, 1, 1))
        return self.head(torch.relu(self.mid(z)).flatten(1))


@register_model(
    "tiny-shrink-digits", input_shape=(1, 28, 28), weights_dir=WEIGHTS_DIR,
    card=dict(task="classification", description="test-only digit classifier with a λ shrinkage layer",
              input=InputCard(name="image", shape=(1, 28, 28), colour="gray", resize="pad-square"),
              output="logits", labels=WORDS, lam=LamCard(default=0.05, max=1.0),
              data=dict(train="mnist-train", test="mnist-test"), precisions=("fp32", "fp16")))
def tiny_shrink_digits(**kw):
    return ShrinkDigits(**kw)
'''
NAME = "tiny-shrink-digits"


@pytest.fixture(scope="module")
def arch(tmp_path_factory: pytest.TempPathFactory):
    """Import the architecture file from outside the package, as a user's own file would be, and train it."""
    from unroll.data import mnist_split

    root = tmp_path_factory.mktemp("user_model")
    weights = root / "weights"
    weights.mkdir()
    path = root / "my_arch.py"
    path.write_text(f"WEIGHTS_DIR = {str(weights)!r}\n" + textwrap.dedent(ARCH_FILE))
    spec = importlib.util.spec_from_file_location("my_arch", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["my_arch"] = mod
    spec.loader.exec_module(mod)
    import unroll

    model = unroll.load(NAME, pretrained=False).train()
    x, y, _, _ = mnist_split()
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        for idx in torch.randperm(len(x), generator=gen).split(64):
            loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x[idx.numpy()])),
                                                     torch.from_numpy(y[idx.numpy()]))
            opt.zero_grad()
            loss.backward()
            opt.step()
    torch.save(model.state_dict(), weights / f"{NAME}.pt")
    yield mod
    from unroll.registry import REGISTRY

    REGISTRY.pop(NAME, None)
    sys.modules.pop("my_arch", None)


@pytest.mark.triton
@pytest.mark.slow
def test_new_architecture_goes_through_every_stage(arch, tmp_path: Path) -> None:
    from unroll.card import CARD_KEY, from_onnx
    from unroll.data import mnist_split
    from unroll.export.onnx_export import export_model
    from unroll.export.quantize import quantize
    from unroll.serving.repository import write_repository

    onnx_dir, repo = tmp_path / "onnx", tmp_path / "repo"
    res = export_model(NAME, onnx_dir, naive=False)
    card = from_onnx(res.onnx_path)
    assert card.labels[3] == "three" and card.lam.default == 0.05
    assert [i.name for i in onnx.load(res.onnx_path).graph.input] == ["image", "lam"]

    q = quantize(NAME, "fp16", onnx_dir)
    assert q["passed"] and from_onnx(onnx_dir / f"{NAME}.fp16.onnx") == card  # the card survives quantization
    assert q["metrics"]["accuracy_fp32"] > 0.8  # a few seconds of training: a real, if small, classifier

    write_repository("cpu", [NAME], repo, precision="fp16", onnx_dir=onnx_dir)
    config = (repo / NAME / "config.pbtxt").read_text()
    assert CARD_KEY in config and (repo / NAME / "labels.txt").read_text().split() == list(card.labels)

    _, _, xte, _ = mnist_split()
    digits = xte[:20]
    served_graph = ort.InferenceSession(str(repo / NAME / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    expected = served_graph.run(None, {"image": digits, "lam": np.full(20, card.lam.default, np.float32)})[0]
    with gateway_over_triton(repo, tmp_path, timeout_s=120, client_timeout_s=30) as client:
        served = {m["name"]: m for m in client.get("/v1/models").json()["models"]}
        assert served[NAME]["task"] == "classification"
        for i, digit in enumerate(digits):
            buf = io.BytesIO()
            Image.fromarray(np.rint(digit[0] * 255).astype(np.uint8)).save(buf, "PNG")
            r = client.post("/v1/classify", params={"model": NAME, "top_k": 3},
                            files={"image": ("d.png", buf.getvalue(), "image/png")})
            assert r.status_code == 200, r.text
            body = r.json()
            top = body["predictions"][0]
            assert top["label"] == card.labels[top["index"]]  # labels from the card, through Triton
            # the served model is the exported FP16 graph, run with the card's λ default
            assert top["index"] == int(expected[i].argmax()) and body["lam"] == pytest.approx(card.lam.default)
            p = np.exp(expected[i] - expected[i].max())
            assert top["score"] == pytest.approx(float(p.max() / p.sum()), abs=1e-4)
        r = client.post("/v1/classify", params={"model": NAME, "lam": 5},
                        files={"image": ("d.png", buf.getvalue(), "image/png")})
        assert r.status_code == 422 and "lam" in r.json()["error"]["message"]  # bound from the card (max 1.0)
