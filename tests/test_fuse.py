"""``unroll fuse`` on graphs unroll did not write, and ``--card`` for third-party graphs.

The graphs are built the way other people's code builds them: a plain-PyTorch ISTA (K=3 steps, a
convolutional dictionary, no unroll layers) whose shrinkage is written in the textbook forms, with the
step size multiplied into the dictionary at run time, exported with plain ``torch.onnx.export``
(TorchScript exporter, no constant folding, as a training script does). ``unroll fuse`` runs as a
subprocess; every result is checked against PyTorch with ONNX Runtime here, independently of the report.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from unroll.card import CARD_KEY, from_onnx

UNROLL = [sys.executable, "-m", "unroll.app.cli"]
#: the legacy TorchScript exporter is what third-party scripts use; its deprecation notice is not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def shrink(style: str, v: torch.Tensor, t) -> torch.Tensor:
    """Soft thresholds as papers write them (signed unless the name says nonneg)."""
    if style == "sign_relu":
        return torch.sign(v) * torch.relu(torch.abs(v) - t)
    if style == "sign_clamp":
        return torch.sign(v) * torch.clamp(torch.abs(v) - t, min=0)
    if style == "sign_maximum":
        return torch.sign(v) * torch.maximum(torch.abs(v) - t, torch.zeros_like(v))
    if style == "where":
        return torch.where(torch.abs(v) > t, v - torch.sign(v) * t, torch.zeros_like(v))
    if style == "where_scalar":
        return torch.where(torch.abs(v) > t, v - torch.sign(v) * t, 0.0)
    if style == "relu_relu":
        return torch.relu(v - t) - torch.relu(-v - t)
    if style == "clip_scalar":
        return v - torch.clamp(v, -0.05, 0.05)
    if style == "nonneg_relu":
        return torch.relu(v - t)
    if style == "nonneg_clamp":
        return torch.clamp(v - t, min=0)
    if style == "nonneg_maximum":
        return torch.maximum(v - t, torch.zeros_like(v))
    if style == "nonneg_textbook":
        return torch.relu(torch.sign(v) * torch.relu(torch.abs(v) - t))
    if style == "hard":  # hard threshold: no rule knows it, it must be left alone
        return torch.where(torch.abs(v) > t, v, torch.zeros_like(v))
    if style == "sign_relu_squared":  # not a soft threshold either
        return torch.sign(v) * torch.relu(torch.abs(v) - t) ** 2
    raise ValueError(style)


class ISTA(nn.Module):
    """z ← S_θ(z − η·Dᵀ(Dz − x)), K steps, D a convolutional dictionary; η·W multiplied at run time."""

    def __init__(self, styles: tuple[str, ...], channels: int = 1, atoms: int = 8, classes: int = 0,
                 theta: str = "channel") -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.W = nn.Parameter(torch.randn(atoms, channels, 3, 3, generator=g) * 0.2)
        self.eta = nn.Parameter(torch.tensor(0.5))
        self.theta = nn.Parameter(torch.full((1, atoms, 1, 1), 0.05) if theta == "channel" else torch.tensor(0.05))
        self.styles = styles
        self.head = nn.Linear(atoms * 7 * 7, classes) if classes else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = shrink(self.styles[0], F.conv2d(x, self.eta * self.W, padding=1), self.theta)
        for style in self.styles[1:]:
            r = F.conv_transpose2d(z, self.W, padding=1) - x
            z = shrink(style, z - F.conv2d(r, self.eta * self.W, padding=1), self.theta)
        if self.head is None:
            return F.conv_transpose2d(z, self.W, padding=1)
        return self.head(F.avg_pool2d(z, 4).flatten(1))


def torch_export(model: nn.Module, path: Path, inp: str = "x", out: str = "y", hw: int = 16) -> None:
    """What a third-party training script does: TorchScript exporter, dynamic batch and size, no folding."""
    model.eval()
    dyn = {0: "batch"} if model.head is not None else {0: "batch", 2: "h", 3: "w"}
    torch.onnx.export(model, (torch.rand(1, model.W.shape[1], hw, hw),), str(path), input_names=[inp],
                      output_names=[out], opset_version=17, dynamo=False, do_constant_folding=False,
                      dynamic_axes={inp: dyn, out: {0: "batch"}})


def run_fuse(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([*UNROLL, "fuse", *map(str, args)], capture_output=True, text=True, timeout=240)
    if check:
        assert p.returncode == 0, p.stdout + p.stderr
    return p


def ort_run(path: Path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def ops(path: Path) -> list[str]:
    return [n.op_type for n in onnx.load(str(path)).graph.node]


SUSPECT = {"Sign", "Abs", "Where", "Greater", "Less"}

# styles per ISTA step → the report's rewrite counts
CASES = {
    "signed-a": (("sign_relu", "sign_clamp", "where"), {"sign_relu": 1, "sign_max": 1, "where_sign": 1}, "channel"),
    "signed-b": (("relu_relu", "sign_maximum", "where_scalar"), {"relu_minus_relu": 1, "sign_max": 1,
                                                                 "where_sign": 1}, "channel"),
    "signed-scalar": (("sign_relu", "where", "relu_relu"), {"sign_relu": 1, "where_sign": 1, "relu_minus_relu": 1},
                      "scalar"),
    "nonneg": (("nonneg_relu", "nonneg_clamp", "nonneg_maximum"), {"max_nonneg": 2}, "channel"),
    "nonneg-textbook": (("nonneg_textbook", "nonneg_textbook", "clip_scalar"), {"sign_relu": 2, "relu_of_soft": 2},
                        "scalar"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_textbook_forms_are_fused(case: str, tmp_path: Path) -> None:
    styles, expected, theta = CASES[case]
    model = ISTA(styles, theta=theta).eval()
    src, out = tmp_path / "third_party.onnx", tmp_path / "fused.onnx"
    torch_export(model, src)
    before = ops(src)
    assert SUSPECT & set(before) or "Clip" in before or "Max" in before  # the textbook forms are really there
    assert "Mul" in before  # η·W at run time
    p = run_fuse(src, "-o", out, "--input-shape", "x=2,1,20,24")
    assert "nodes" in p.stdout
    report = json.loads((tmp_path / "fused.report.json").read_text())
    counts = {r["rule"]: r["count"] for r in report["rewrites"]}
    for rule, n in expected.items():
        assert counts[rule] == n, (rule, counts)
    # η·W, computed at run time in every step; the TorchScript exporter merges the identical products into one Mul
    assert counts["step_size_times_weight"] == 1
    after = ops(out)
    assert not SUSPECT & set(after), after
    assert report["left_alone"] == []
    assert report["nodes_before"] == len(before) and report["nodes_after"] == len(after) < len(before)
    assert "Mul" not in after or after.count("Mul") < before.count("Mul")
    assert report["parity"]["max_abs_err"] <= 1e-4 and all(c["ok"] for c in report["parity"]["cases"])
    assert report["parity"]["cases"][0]["shapes"] == {"x": [2, 1, 20, 24]}
    # independently of the report: the fused graph computes what the PyTorch module computes
    x = torch.rand(3, 1, 24, 20, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(x).numpy()
    np.testing.assert_allclose(ort_run(out, x.numpy()), ref, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(ort_run(out, x.numpy()), ort_run(src, x.numpy()), atol=1e-5, rtol=1e-5)
    if case == "nonneg":
        kept = {r["rule"]: r["count"] for r in report["kept"]}
        assert kept["relu_nonneg"] == 1 and after.count("Relu") == 3  # relu(v − θ) already fused: counted, kept
    if case == "nonneg-textbook":
        kept = {r["rule"]: r["count"] for r in report["kept"]}
        assert kept["clip"] == 1


def test_unknown_forms_are_left_alone_and_reported(tmp_path: Path) -> None:
    model = ISTA(("hard", "sign_relu", "sign_relu_squared")).eval()
    src, out = tmp_path / "odd.onnx", tmp_path / "odd_fused.onnx"
    torch_export(model, src)
    run_fuse(src, "-o", out)
    report = json.loads(out.with_suffix(".report.json").read_text())
    counts = {r["rule"]: r["count"] for r in report["rewrites"]}
    assert counts["sign_relu"] == 1  # the one known form is fused …
    left = {n["op"] for n in report["left_alone"]}
    assert {"Where", "Sign", "Abs"} <= left and report["left_alone_note"]  # … the others are named, not guessed at
    after = ops(out)
    assert after.count("Where") == 1 and after.count("Sign") == 1 and "Pow" in after
    x = np.random.default_rng(0).random((2, 1, 16, 16), dtype=np.float32)
    np.testing.assert_allclose(ort_run(out, x), ort_run(src, x), atol=1e-5, rtol=1e-5)


CARD = {
    "task": "classification", "description": "a plain-PyTorch ISTA digit classifier fused from torch.onnx",
    "input": {"name": "image", "shape": [1, 28, 28], "colour": "gray", "resize": "pad-square"},
    "output": "logits", "labels": [f"digit {i}" for i in range(10)],
    "data": {"train": "mnist-train", "test": "mnist-test"}, "precisions": ["fp32", "fp16"],
    # a seconds-long training run leaves near-ties between logits that FP16 may flip: the card's own gate
    "gates": {"fp16": {"top1_agreement": 0.99}},
}


def test_card_errors_are_clear_and_write_nothing(tmp_path: Path) -> None:
    model = ISTA(("sign_relu",) * 3).eval()
    src = tmp_path / "m.onnx"
    torch_export(model, src)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(CARD))  # inputs "image"/"logits", the graph's are "x"/"y"
    p = run_fuse(src, "-o", tmp_path / "out" / "m.onnx", "--card", bad, check=False)
    assert p.returncode == 1 and "image" in p.stderr and "['x']" in p.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    p = run_fuse(src, "-o", tmp_path / "out" / "m.onnx", "--input-shape", "nope=1,2", check=False)
    assert p.returncode == 1 and "--input-shape" in p.stderr
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a graph")
    p = run_fuse(broken, "-o", tmp_path / "out" / "b.onnx", check=False)
    assert p.returncode == 1 and "not a readable ONNX" in p.stderr
    # a third-party graph without a card: quantize says how to give it one
    q = subprocess.run([*UNROLL, "quantize", "m", "--precision", "fp16", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=240)
    assert q.returncode == 1 and "--card" in q.stderr and "carries no unroll model card" in q.stderr
    assert not (tmp_path / "m.fp16.onnx").exists()


def _train(model: ISTA, steps: int = 250) -> None:
    from unroll.data import mnist_split

    x, y, _, _ = mnist_split()
    opt = torch.optim.Adam(model.parameters(), 5e-3)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for _, idx in zip(range(steps), torch.randint(0, len(x), (steps, 64), generator=gen), strict=False):
        loss = F.cross_entropy(model(torch.from_numpy(x[idx.numpy()])), torch.from_numpy(y[idx.numpy()]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():  # thresholds stay non-negative (projected gradient), as ISTA's θ must
            model.theta.clamp_(min=0)
    model.eval()


@pytest.mark.triton
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fused_third_party_graph_with_card_is_served(tmp_path: Path) -> None:
    import httpx
    from PIL import Image

    from unroll.data import mnist_split
    from unroll.export.quantize import quantize
    from unroll.serving.gateway.process import gateway_process
    from unroll.serving.gateway.settings import Settings
    from unroll.serving.repository import write_repository
    from unroll.serving.triton import free_ports, start

    name = "ista-digits"
    model = ISTA(("sign_relu", "where", "relu_relu"), classes=10)
    _train(model)
    src, onnx_dir = tmp_path / "third_party.onnx", tmp_path / "onnx"
    torch_export(model, src, inp="image", out="logits", hw=28)
    fused = onnx_dir / f"{name}.onnx"
    run_fuse(src, "-o", fused)  # no card yet: the graph carries none
    assert not {"Sign", "Abs", "Where"} & set(ops(fused))
    with pytest.raises(ValueError, match="--card"):  # quantize without a card: the error names the option
        quantize(name, "fp16", onnx_dir)
    card_file = tmp_path / "card.json"
    card_file.write_text(json.dumps(CARD))  # no name: it is the graph's file stem
    q = subprocess.run([*UNROLL, "quantize", name, "--precision", "fp16", "--out", str(onnx_dir), "--card",
                        str(card_file)], capture_output=True, text=True, timeout=280)
    assert q.returncode == 0, q.stdout + q.stderr
    card = from_onnx(fused)
    assert card.name == name and card.labels[3] == "digit 3"
    assert from_onnx(onnx_dir / f"{name}.fp16.onnx") == card
    assert not {"Sign", "Abs", "Where"} & set(ops(onnx_dir / f"{name}.fp16.onnx"))

    repo = tmp_path / "repo"
    write_repository("cpu", [name], repo, precision="fp16", onnx_dir=onnx_dir)
    assert CARD_KEY in (repo / name / "config.pbtxt").read_text()
    _, _, xte, _ = mnist_split()
    digits = xte[:12]
    expected = ort_run(repo / name / "1" / "model.onnx", digits)
    np.testing.assert_allclose(ort_run(fused, digits), model(torch.from_numpy(digits)).detach().numpy(), atol=1e-4,
                               rtol=1e-4)
    http, grpc, metrics = free_ports(3)
    with start(repo, http, grpc, metrics, log_file=tmp_path / "triton.log", timeout_s=120,
               extra_args=["--exit-timeout-secs=2"]), \
            gateway_process(Settings(triton_url=f"127.0.0.1:{grpc}"), tmp_path / "gateway.log") as base, \
            httpx.Client(base_url=base, timeout=30) as client:
        served = {m["name"]: m for m in client.get("/v1/models").json()["models"]}
        assert served[name]["task"] == "classification"
        for i, digit in enumerate(digits):
            buf = io.BytesIO()
            Image.fromarray(np.rint(digit[0] * 255).astype(np.uint8)).save(buf, "PNG")
            r = client.post("/v1/classify", params={"model": name, "top_k": 3},
                            files={"image": ("d.png", buf.getvalue(), "image/png")})
            assert r.status_code == 200, r.text
            top = r.json()["predictions"][0]
            assert top["index"] == int(expected[i].argmax()) and top["label"] == f"digit {top['index']}"
            p = np.exp(expected[i] - expected[i].max())
            assert top["score"] == pytest.approx(float(p.max() / p.sum()), abs=1e-4)


def test_negative_constant_threshold_is_not_rewritten(tmp_path: Path) -> None:
    """clip(v, −θ, θ) equals the textbook form only for θ ≥ 0: a negative θ is left alone, not guessed at."""
    model = ISTA(("sign_relu",) * 3).eval()
    with torch.no_grad():
        model.theta[0, 0] = -0.05
    src, out = tmp_path / "neg.onnx", tmp_path / "neg_fused.onnx"
    torch_export(model, src)
    run_fuse(src, "-o", out)
    report = json.loads(out.with_suffix(".report.json").read_text())
    assert {r["rule"]: r["count"] for r in report["rewrites"]}["sign_relu"] == 0
    assert ops(out).count("Sign") == 3 and {"Sign", "Abs"} <= {n["op"] for n in report["left_alone"]}
