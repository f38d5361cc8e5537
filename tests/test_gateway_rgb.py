"""Any classifier through the gateway, and colour denoisers served natively (issue 13, item 4).

The first half checks the card-driven preprocessing in-process against Pillow done the obvious way
(``shorter-side-crop`` as torchvision's ``Resize`` + ``CenterCrop``, the three filters, BGR order, dynamic sizes)
and its memory bound. The second half is end to end with real processes: official-layout SDNet checkpoints
(seeded weights in the official key layout with DataParallel's ``module.`` prefix, perturbed away from the seeded
init) → export → repository → a real tritonserver → the real gateway, where an RGB PNG (CIFAR) and a non-square
JPEG (ImageNet, resize + centre crop) must give PyTorch's top-k and scores; and a 3-channel denoiser defined here
takes an RGB image as one ``[1, 3, H, W]`` item and answers like ONNX Runtime on the served graph.

The reference preprocessing is written here from the card's documented rule (Pillow float resize + numpy), not
taken from the gateway.
"""

from __future__ import annotations

import io
import math
import subprocess
import sys
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import pytest
import torch
from PIL import Image
from pydantic import ValidationError
from served import check_topk, gateway_over_triton, png, softmax
from torch import nn

import unroll
from unroll.card import InputCard, ModelCard, SigmaCard
from unroll.registry import get_spec
from unroll.serving.gateway.errors import ApiError
from unroll.serving.imaging import images

FILTERS = {"lanczos": Image.Resampling.LANCZOS, "bilinear": Image.Resampling.BILINEAR,
           "bicubic": Image.Resampling.BICUBIC}
CIFAR, IMAGENET, DENOISER = "sdnet18-cifar", "sdnet18-imagenet", "tiny-rgb-denoiser"


def photo(h: int, w: int, seed: int) -> np.ndarray:
    """A smooth colour image with some texture (``[H, W, 3]`` uint8), so resampling and JPEG matter."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    base = np.stack([np.sin(6 * xx + 1) * np.cos(4 * yy), np.cos(5 * xx * yy + 2), np.sin(3 * yy - 2 * xx)], -1)
    return np.clip((base * 0.4 + 0.5 + rng.normal(0, 0.08, (h, w, 3))) * 255, 0, 255).astype(np.uint8)


def reference_input(data: bytes, card: InputCard) -> np.ndarray:
    """``[1, C, H, W]`` for a classifier from the card's documented rule, done independently of the gateway:
    Pillow decode → RGB floats → per plane a Pillow float resize (``stretch``; or ``shorter-side-crop``: the
    shorter side to ``floor(side / crop_ratio)``, the longer ``int(short · longer / shorter)`` as torchvision's
    ``Resize(int)``, then torchvision's centred crop) → clip to [0, 1] → BGR if asked → ``(x − mean) / std``."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    rgb = np.asarray(img, np.float32) / 255.0
    h, w = rgb.shape[:2]
    th, tw = card.fixed_hw
    assert card.resize == "stretch" or (card.resize == "shorter-side-crop" and th == tw)
    if card.resize == "stretch":
        (nh, nw), (top, left) = (th, tw), (0, 0)
    else:
        short = math.floor(th / card.crop_ratio + 1e-9)
        nh, nw = (short, int(short * w / h)) if h <= w else (int(short * h / w), short)
        top, left = int(round((nh - th) / 2.0)), int(round((nw - tw) / 2.0))
    planes = []
    for c in range(3):
        p = Image.fromarray(np.ascontiguousarray(rgb[..., c]))
        if (nh, nw) != (h, w):
            p = p.resize((nw, nh), FILTERS[card.interpolation])
        planes.append(np.clip(np.asarray(p, np.float32)[top:top + th, left:left + tw], 0.0, 1.0))
    x = np.stack(planes[::-1] if card.channel_order == "bgr" else planes)
    x = (x - np.asarray(card.mean, np.float32).reshape(-1, 1, 1)) / np.asarray(card.std, np.float32).reshape(-1, 1, 1)
    return x[None].astype(np.float32)


# --- 1. preprocessing from the card, in-process --------------------------------------------------------------------


@pytest.mark.parametrize("interpolation", sorted(FILTERS))
@pytest.mark.parametrize("shape", [(200, 300), (300, 200), (256, 256), (256, 341), (224, 224), (37, 1000),
                                   (7, 3), (120, 121)])
def test_shorter_side_crop_is_resize_then_centre_crop(shape: tuple[int, int], interpolation: str) -> None:
    card = InputCard(name="image", shape=(3, 224, 224), colour="rgb", resize="shorter-side-crop",
                     crop_ratio=0.875, interpolation=interpolation, mean=(0.485, 0.456, 0.406),
                     std=(0.229, 0.224, 0.225))
    data = png(photo(*shape, seed=sum(shape)))
    got = images.classifier_input(images.decode(data, 10**7), card, "false").x
    want = reference_input(data, card)
    assert got.shape == want.shape == (1, 3, 224, 224)
    assert np.abs(got - want).max() < 1e-4, np.abs(got - want).max()  # /std magnifies float32 rounding ×4.5


@pytest.mark.parametrize("interpolation", sorted(FILTERS))
def test_stretch_with_each_filter_and_bgr_order(interpolation: str) -> None:
    data = png(photo(45, 61, seed=3))
    for order in ("rgb", "bgr"):
        card = InputCard(name="image", shape=(3, 32, 32), colour="rgb", resize="stretch", channel_order=order,
                         interpolation=interpolation, mean=(0.1, 0.5, 0.9), std=(0.3, 0.2, 0.1))
        got = images.classifier_input(images.decode(data, 10**7), card, "false").x
        assert np.abs(got - reference_input(data, card)).max() < 2e-4
    rgb = InputCard(name="image", shape=(3, 32, 32), colour="rgb", resize="stretch")
    bgr = rgb.model_copy(update={"channel_order": "bgr"})
    a = images.classifier_input(images.decode(data, 10**7), rgb).x
    b = images.classifier_input(images.decode(data, 10**7), bgr).x
    assert np.array_equal(a[:, ::-1], b) and not np.array_equal(a, b)


def test_dynamic_size_classifier_takes_the_image_as_it_is() -> None:
    card = InputCard(name="image", shape=(3, -1, -1), min_size=16, colour="rgb")
    arr = photo(20, 33, seed=1)
    x = images.classifier_input(Image.fromarray(arr), card).x
    assert x.shape == (1, 3, 20, 33) and np.allclose(x[0], arr.transpose(2, 0, 1) / 255.0, atol=1e-6)
    with pytest.raises(ApiError) as e:
        images.classifier_input(Image.fromarray(photo(10, 33, seed=1)), card)
    assert e.value.status == 422 and "16" in e.value.message
    tall = InputCard(name="image", shape=(1, 28, -1), colour="gray")
    assert images.classifier_input(Image.fromarray(photo(28, 50, 2)), tall).x.shape == (1, 1, 28, 50)
    with pytest.raises(ApiError) as e:
        images.classifier_input(Image.fromarray(photo(30, 50, 2)), tall)
    assert e.value.status == 422 and "height 28" in e.value.message


def test_card_fields_are_validated() -> None:
    with pytest.raises(ValidationError, match="bgr"):
        InputCard(name="image", shape=(1, 28, 28), colour="gray", channel_order="bgr")
    with pytest.raises(ValidationError, match="crop_ratio"):
        InputCard(name="image", shape=(3, 224, 224), colour="rgb", resize="shorter-side-crop", crop_ratio=1.5)
    with pytest.raises(ValidationError, match="fixed"):
        InputCard(name="image", shape=(3, -1, -1), colour="rgb", resize="stretch")
    card = get_spec(IMAGENET).card.input
    assert (card.resize, card.crop_ratio, card.interpolation) == ("shorter-side-crop", 0.875, "bilinear")
    assert get_spec(CIFAR).card.input.shape == (3, 32, 32)


def test_top_k_is_bounded_by_the_real_class_count() -> None:
    from unroll.serving.gateway.classify import class_count, predictions_from_logits

    card = ModelCard(name="m", task="classification", output="logits", labels=("a", "b", "c"),
                     input=InputCard(name="image", shape=(3, 8, 8), colour="rgb"))
    info = SimpleNamespace(outputs={"logits": SimpleNamespace(shape=(-1, 4))})
    assert class_count(card, info) == 4  # the served output's axis wins over a card's (wrong) label count
    info.outputs["logits"] = SimpleNamespace(shape=(-1, -1))
    assert class_count(card, info) == 3
    assert class_count(card.model_copy(update={"labels": None}), info) is None
    preds, msp = predictions_from_logits(np.array([[0.0, 2.0, 1.0]], np.float32), 2, card, "m")
    assert [(p["label"], p["index"]) for p in preds] == [("b", 1), ("c", 2)]
    assert msp == pytest.approx(1 - np.exp(2) / np.exp([0.0, 2.0, 1.0]).sum())  # one minus the softmax's maximum
    with pytest.raises(ApiError) as e:
        predictions_from_logits(np.zeros((1, 3), np.float32), 4, card, "m")
    assert e.value.status == 422 and "3 classes" in e.value.message


def test_shorter_side_crop_work_arrays_bounded_by_the_pixel_limit() -> None:
    """The crop is computed without building the resized image: a 1×N line stays within ``work_bytes_bound``."""
    max_pixels = 600_000
    s = math.isqrt(max_pixels)
    rng = np.random.default_rng(0)
    cases = {"rgba square": (rng.random((s, s, 4)) * 255).astype(np.uint8),
             "1×N line": (rng.random((1, max_pixels)) * 255).astype(np.uint8),
             "N×1 line": (rng.random((max_pixels, 1, 3)) * 255).astype(np.uint8),
             "rgb 32:1": (rng.random((s // 6, s * 32 // 6, 3)) * 255).astype(np.uint8)}
    card = get_spec(IMAGENET).card.input
    for name, arr in cases.items():
        img = images.decode(png(arr, compress_level=1), max_pixels, math.inf)
        tracemalloc.start()
        try:
            x = images.classifier_input(img, card, "false").x
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert x.shape == (1, 3, 224, 224) and np.isfinite(x).all()
        assert peak <= images.work_bytes_bound(max_pixels, card.fixed_hw), (name, peak)


# --- 2. end to end: checkpoints, RGB classifiers and a colour denoiser through real Triton + gateway ---------------


class TinyRGBDenoiser(nn.Module):
    """Mixes the colour channels (so per-channel denoising would answer differently): x − σ·conv(relu(conv(x)))."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, noisy: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return noisy - 4.0 * sigma.view(-1, 1, 1, 1) * self.b(torch.relu(self.a(noisy)))


@pytest.fixture(scope="module")
def denoiser_registered():
    from unroll.registry import REGISTRY, register_model

    register_model(DENOISER, input_shape=(3, 64, 64), card=dict(
        task="denoising", description="test-only colour denoiser (3 channels, dynamic H×W)",
        input=InputCard(name="noisy", shape=(3, -1, -1), min_size=16, colour="rgb"), output="denoised",
        sigma=SigmaCard(), precisions=("fp32",)))(lambda **kw: TinyRGBDenoiser(**kw))
    yield DENOISER
    REGISTRY.pop(DENOISER, None)


def official_checkpoint(name: str, path: Path, wrapped: bool) -> Path:
    """The seeded weights in the official key layout (``module.`` prefix), perturbed so they differ from the
    seeded init; ``checkpoint.pth.tar`` (``{'state_dict': …}``) when ``wrapped``, else a bare ``model_best``."""
    gen = torch.Generator().manual_seed(7)
    state = {}
    for k, v in unroll.load(name, pretrained=False).state_dict().items():
        if v.is_floating_point() and not k.endswith("step_size"):
            noise = torch.randn(v.shape, generator=gen)
            v = v * torch.exp(0.2 * noise) if k.endswith("running_var") else v + 0.1 * noise * max(
                float(v.std()) if v.numel() > 1 else 0.0, 0.05)
        if k == "linear.weight":  # a confident head: scores spread out, so matching them to 1e-4 means something
            v = v * 200.0
        state[f"module.{k}"] = v
    torch.save({"epoch": 90, "state_dict": state, "best_acc1": torch.tensor(70.0)} if wrapped else state, path)
    return path


def export_checkpoint(name: str, ckpt: Path, out_dir: Path) -> None:
    """``unroll export NAME --checkpoint PATH --out DIR``, the command a user runs."""
    r = subprocess.run([str(Path(sys.executable).parent / "unroll"), "export", name, "--checkpoint", str(ckpt),
                        "--out", str(out_dir)], capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "checkpoint" in r.stdout and (out_dir / f"{name}.onnx").exists()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, denoiser_registered: str):
    from unroll.export.onnx_export import export_model
    from unroll.serving.repository import write_repository

    root = tmp_path_factory.mktemp("rgb")
    onnx_dir, repo = root / "onnx", root / "repo"
    onnx_dir.mkdir()
    ckpts = {CIFAR: official_checkpoint(CIFAR, root / "checkpoint.pth.tar", wrapped=True),
             IMAGENET: official_checkpoint(IMAGENET, root / "model_best.pth.tar", wrapped=False)}
    for name, ckpt in ckpts.items():
        export_checkpoint(name, ckpt, onnx_dir)
    export_model(DENOISER, onnx_dir, naive=False)
    names = [CIFAR, IMAGENET, DENOISER]
    write_repository("cpu", names, repo, onnx_dir=onnx_dir)
    with gateway_over_triton(repo, root) as client:
        yield SimpleNamespace(client=client, repo=repo, ckpts=ckpts)


def _torch_logits(name: str, ckpt: Path | None, x: np.ndarray) -> np.ndarray:
    model = unroll.load(name, pretrained=False, checkpoint=ckpt)
    with torch.no_grad():
        return model(torch.from_numpy(x)).double()[0].numpy()


@pytest.mark.triton
@pytest.mark.slow
def test_cifar_checkpoint_classifies_an_rgb_png_like_pytorch(served) -> None:
    from unroll.card import from_onnx

    card = from_onnx(served.repo / CIFAR / "1" / "model.onnx")
    assert card.input.colour == "rgb" and card.labels[3] == "cat"
    for shape, seed in (((32, 32), 0), ((37, 45), 1)):  # the native size, and one the card stretches
        data = png(photo(*shape, seed=seed))
        x = reference_input(data, card.input)
        logits = _torch_logits(CIFAR, served.ckpts[CIFAR], x)
        # the checkpoint, not the seeded init, is what is compared
        assert np.abs(logits - _torch_logits(CIFAR, None, x)).max() > 0.1
        probs = softmax(logits)
        assert probs.max() > 0.2  # not a flat distribution
        r = served.client.post("/v1/classify", params={"model": CIFAR, "top_k": 5},
                               files={"image": ("x.png", data, "image/png")})
        assert r.status_code == 200, r.text
        check_topk(r.json(), probs, 5, card.labels)
    r = served.client.post("/v1/classify", params={"model": CIFAR, "top_k": 11},
                           files={"image": ("x.png", data, "image/png")})
    assert r.status_code == 422 and "10 classes" in r.json()["error"]["message"]


@pytest.mark.triton
@pytest.mark.slow
def test_imagenet_checkpoint_resizes_and_crops_a_jpeg_like_pytorch(served) -> None:
    from unroll.card import from_onnx

    card = from_onnx(served.repo / IMAGENET / "1" / "model.onnx")
    assert card.input.resize == "shorter-side-crop" and card.labels is None
    data = png(photo(180, 290, seed=5), "JPEG", quality=90)  # landscape, non-square
    x = reference_input(data, card.input)
    logits = _torch_logits(IMAGENET, served.ckpts[IMAGENET], x)
    assert np.abs(logits - _torch_logits(IMAGENET, None, x)).max() > 0.1
    probs = softmax(logits)
    assert probs.max() > 0.01  # well above uniform (0.001)
    r = served.client.post("/v1/classify", params={"model": IMAGENET, "top_k": 10},
                           content=data, headers={"content-type": "image/jpeg"})
    assert r.status_code == 200, r.text
    check_topk(r.json(), probs, 10, None)
    # the crop matters: a stretched image would be classified from other pixels
    stretched = reference_input(data, card.input.model_copy(update={"resize": "stretch"}))
    assert np.abs(stretched - x).max() > 0.1
    r = served.client.post("/v1/classify", params={"model": IMAGENET, "top_k": 1001},
                           content=data, headers={"content-type": "image/jpeg"})
    assert r.status_code == 422 and "1000 classes" in r.json()["error"]["message"]


@pytest.mark.triton
@pytest.mark.slow
def test_colour_denoiser_takes_rgb_natively(served) -> None:
    sess = ort.InferenceSession(str(served.repo / DENOISER / "1" / "model.onnx"), providers=["CPUExecutionProvider"])

    def expected(planes: np.ndarray, sigma255: float) -> np.ndarray:  # [3, H, W] in [0, 1] → [3, H, W] out
        return sess.run(None, {"noisy": planes[None].astype(np.float32),
                               "sigma": np.array([sigma255 / 255.0], np.float32)})[0][0]

    def post(data: bytes) -> Image.Image:
        r = served.client.post("/v1/denoise", params={"model": DENOISER, "sigma": 25},
                               files={"image": ("x.png", data, "image/png")})
        assert r.status_code == 200, r.text
        return Image.open(io.BytesIO(r.content))

    def close(got: np.ndarray, want: np.ndarray) -> None:
        want = np.rint(np.clip(want, 0, 1) * 255)
        diff = np.abs(got.astype(np.float64) - want)
        assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (diff.max(), (diff > 0).mean())

    rgb = photo(40, 52, seed=9)
    out = post(png(rgb))
    assert out.mode == "RGB" and out.size == (52, 40)
    want = expected(rgb.transpose(2, 0, 1) / 255.0, 25)
    close(np.asarray(out).transpose(2, 0, 1), want)
    per_channel = np.stack([expected(np.repeat(rgb.transpose(2, 0, 1)[c:c + 1] / 255.0, 3, 0), 25)[c]
                            for c in range(3)])
    assert np.abs(np.rint(np.clip(per_channel, 0, 1) * 255) - np.rint(np.clip(want, 0, 1) * 255)).max() > 2

    alpha = (np.arange(40 * 52).reshape(40, 52) % 256).astype(np.uint8)
    out = post(png(np.dstack([rgb, alpha])))
    assert out.mode == "RGBA" and np.array_equal(np.asarray(out)[..., 3], alpha)
    close(np.asarray(out)[..., :3].transpose(2, 0, 1), want)

    gray = rgb[..., 1]
    out = post(png(gray))  # gray into a colour denoiser: repeated to three planes, averaged back, gray out
    assert out.mode == "L" and out.size == (52, 40)
    close(np.asarray(out)[None], expected(np.repeat(gray[None] / 255.0, 3, 0), 25).mean(0, keepdims=True))
