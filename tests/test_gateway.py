"""End-to-end tests of the REST gateway: a real tritonserver, real uvicorn gateway processes, an httpx client.

Two gateways share one Triton: ``gw`` (gRPC to Triton, the default; small body/pixel limits; started *before*
Triton, so discovery has to cope with a Triton that comes later) and ``gw_key`` (HTTP to Triton, an API key, one
request at a time with no queue and a 1 s Triton deadline). Neither is told which models to serve: they read
the cards from Triton's configs. The repository holds the demo models (exported afresh into a temporary
folder, so the test never serves a stale ``build/onnx``), an RGB classifier with random weights (the pipeline,
not accuracy) and a copy of a model with its card stripped (not served). The Triton restart test runs last:
it stops and restarts the shared server on the same ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
import os
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from unroll.errors import SettingsError
from unroll.serving.gateway.process import gateway_process, wait_ready
from unroll.serving.gateway.settings import Settings
from unroll.serving.triton import free_ports

pytestmark = pytest.mark.triton

MAX_BODY = 2 * 1024 * 1024
MAX_PIXELS = 1_200_000  # 1200×1100 does not fit
API_KEY = "s3cret-key"
MODELS = ["sdnet-mnist", "sdnet-mnist-autolam", "csc-denoiser"]
RGB_CLASSIFIER = "sdnet18-cifar"
NO_CARD = "mystery-model"  # a copy of the λ rule with the card stripped from its Triton config
SERVED = {"sdnet-mnist", "csc-denoiser", RGB_CLASSIFIER}


def png(arr: np.ndarray, mode: str | None = None) -> bytes:
    buf = io.BytesIO()
    img = Image.fromarray(arr) if mode is None else Image.fromarray(arr).convert(mode)
    img.save(buf, format="PNG")
    return buf.getvalue()


def to8(x: np.ndarray) -> np.ndarray:
    return np.rint(np.clip(x, 0, 1) * 255).astype(np.uint8)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(10 * np.log10(1.0 / np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)))


class Triton:
    """The shared tritonserver on fixed (free) ports, restartable in place."""

    def __init__(self, repo: Path, log_dir: Path, ports: tuple[int, int, int]) -> None:
        self.repo, self.log_dir = repo, log_dir
        self.ports = ports
        self.handle = None
        self.start()

    def start(self) -> None:
        from unroll.serving.triton import start

        # Triton waits up to --exit-timeout-secs (default 30) for clients' idle keep-alive connections on SIGTERM
        self.handle = start(self.repo, *self.ports, log_file=self.log_dir / "triton.log", timeout_s=120,
                            extra_args=["--exit-timeout-secs=2"])

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.stop()
            self.handle = None

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.ports[0]}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports[1]}"


@dataclass
class Gateway:
    """A running gateway process (:func:`unroll.serving.gateway.process.gateway_process`) and a client for it."""

    base: str
    client: httpx.Client
    #: Responses recorded before Triton was started (path → response).
    before_triton: dict[str, httpx.Response] = field(default_factory=dict)


@contextlib.contextmanager
def running_gateway(settings: Settings, log: Path) -> Iterator[Gateway]:
    with gateway_process(settings, log, ready_path="/healthz", timeout_s=60) as base, \
            httpx.Client(base_url=base, timeout=60) as client:
        yield Gateway(base, client)


@pytest.fixture(scope="module")
def onnx_dir(demo_onnx_dir: Path) -> Path:
    return demo_onnx_dir


@pytest.fixture(scope="module")
def rgb_onnx_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An RGB classifier (seeded random weights: this is about the pipeline, not accuracy)."""
    from unroll.export.onnx_export import export_model

    out = tmp_path_factory.mktemp("rgb_onnx")
    export_model(RGB_CLASSIFIER, out, naive=False)
    return out


def strip_card(repo: Path, source: str, name: str) -> None:
    """Copy ``repo/source`` to ``repo/name`` without the ``unroll.card`` config parameter (a model without a card)."""
    import shutil

    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    from unroll.card import CARD_KEY

    shutil.copytree(repo / source, repo / name)
    cfg = mc.ModelConfig()
    text_format.Parse((repo / name / "config.pbtxt").read_text(), cfg)
    assert CARD_KEY in cfg.parameters
    del cfg.parameters[CARD_KEY]
    cfg.name = name
    (repo / name / "config.pbtxt").write_text(text_format.MessageToString(cfg))


@pytest.fixture(scope="module")
def repo(onnx_dir: Path, rgb_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from unroll.serving.repository import write_repository

    repo = tmp_path_factory.mktemp("repo")
    write_repository("cpu", MODELS, repo, onnx_dir=onnx_dir)
    write_repository("cpu", [RGB_CLASSIFIER], repo, onnx_dir=rgb_onnx_dir)
    strip_card(repo, "sdnet-mnist-autolam", NO_CARD)
    return repo


@pytest.fixture(scope="module")
def triton_ports() -> tuple[int, int, int]:
    return tuple(free_ports(3))


@pytest.fixture(scope="module")
def gw_early(triton_ports: tuple[int, int, int], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """The gRPC gateway, started before Triton: what it answered then is kept in ``before_triton``."""
    with running_gateway(Settings(triton_url=f"127.0.0.1:{triton_ports[1]}", max_body_bytes=MAX_BODY,
                                  max_pixels=MAX_PIXELS, request_timeout_s=20, retry_after_s=3),
                         tmp_path_factory.mktemp("gw") / "gateway.log") as g:
        g.before_triton["/v1/models"] = g.client.get("/v1/models")
        g.before_triton["/readyz"] = g.client.get("/readyz")
        yield g


@pytest.fixture(scope="module")
def triton(repo: Path, triton_ports: tuple[int, int, int], gw_early: Gateway,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Triton]:
    server = Triton(repo, tmp_path_factory.mktemp("triton-log"), triton_ports)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def gw(gw_early: Gateway, triton: Triton) -> Gateway:
    """The gRPC gateway once it has found Triton (its gRPC channel retries within about a second)."""
    wait_ready(gw_early.base + "/readyz", timeout_s=30)
    return gw_early


@pytest.fixture(scope="module")
def gw_key(triton: Triton, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with running_gateway(Settings(triton_url=triton.url, triton_protocol="http", api_key=API_KEY, max_concurrency=1,
                                  max_queue=0, request_timeout_s=1.0),
                         tmp_path_factory.mktemp("gw-key") / "gateway.log") as g:
        yield g


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray]:
    from unroll.data import mnist_split

    _, _, x, y = mnist_split()
    return x[:50, 0], y[:50]


@pytest.fixture(scope="module")
def digit_png(digits: tuple[np.ndarray, np.ndarray]) -> bytes:
    return png(to8(digits[0][0]))


@pytest.fixture(scope="module")
def camera() -> tuple[np.ndarray, np.ndarray]:
    """Clean camera in [0, 1] and its σ = 25 noisy version quantised to 8 bits."""
    from unroll.data import add_noise, bundled_image, noise_seed

    clean = bundled_image("camera")
    return clean, to8(add_noise(clean, 25.0, noise_seed("camera", 25.0)))


def classify_ok(g: Gateway, digit_png: bytes, **headers: str) -> None:
    r = g.client.post("/v1/classify?top_k=1", content=digit_png, headers={"Content-Type": "image/png", **headers})
    assert r.status_code == 200, r.text
    assert r.json()["predictions"][0]["label"] in "0123456789"


def assert_error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) >= {"error"} and set(body["error"]) == {"code", "message"}, body
    assert body["error"]["code"] == code, body
    assert body["error"]["message"]


# --- health, docs, models ------------------------------------------------------------------------------------


def test_health_ready_models_docs(gw: Gateway) -> None:
    assert gw.client.get("/healthz").json() == {"status": "ok"}
    r = gw.client.get("/readyz")
    assert r.status_code == 200 and r.json()["models"] == dict.fromkeys([*MODELS, RGB_CLASSIFIER], True), r.text
    listing = gw.client.get("/v1/models").json()
    models = {m["name"]: m for m in listing["models"]}
    assert set(models) == SERVED and all(m["ready"] for m in models.values())
    assert [m["name"] for m in listing["models"] if m["default"]] == ["sdnet-mnist", "csc-denoiser"]
    assert models["sdnet-mnist"]["lam_auto"] and models["sdnet-mnist"]["input_defaults"] == {"lam": pytest.approx(0.1)}
    assert models[RGB_CLASSIFIER]["card"]["input"]["colour"] == "rgb" and not models[RGB_CLASSIFIER]["lam_auto"]
    assert models["csc-denoiser"]["task"] == "denoising"
    not_served = {m["name"]: m["reason"] for m in listing["not_served"]}
    assert set(not_served) == {"sdnet-mnist-autolam", NO_CARD}, not_served
    assert gw.client.get("/docs").status_code == 200
    spec = gw.client.get("/openapi.json").json()
    post = spec["paths"]["/v1/classify"]["post"]
    assert "multipart/form-data" in post["requestBody"]["content"] and "image/png" in post["requestBody"]["content"]
    assert post["responses"]["413"]["content"]["application/json"]["example"]["error"]["code"] == "image_too_large"
    assert not any("repository" in p or "load" in p for p in spec["paths"])  # no model control exposed
    text = json.dumps(spec)
    assert not any(name in text for name in [*MODELS, RGB_CLASSIFIER, "mnist"]), "model names in the OpenAPI"


def test_discovery_when_triton_starts_after_the_gateway(gw: Gateway, digit_png: bytes) -> None:
    """The gateway was up before Triton: it answered 503, then found the models without a restart."""
    assert_error(gw.before_triton["/v1/models"], 503, "triton_unavailable")
    assert_error(gw.before_triton["/readyz"], 503, "not_ready")
    assert {m["name"] for m in gw.client.get("/v1/models").json()["models"]} == SERVED
    classify_ok(gw, digit_png)


def test_model_without_card_is_not_served(gw: Gateway, digit_png: bytes) -> None:
    listing = gw.client.get("/v1/models").json()
    assert NO_CARD not in {m["name"] for m in listing["models"]}
    reason = {m["name"]: m["reason"] for m in listing["not_served"]}[NO_CARD]
    assert "no model card" in reason and "unroll.card" in reason, reason
    for route in ("classify", "denoise"):
        r = gw.client.post(f"/v1/{route}?model={NO_CARD}", content=digit_png, headers={"Content-Type": "image/png"})
        assert_error(r, 404, "unknown_model")
        assert "no model card" in r.json()["error"]["message"]
    assert gw.client.get("/readyz").status_code == 200  # a model that is not served does not block readiness


def test_lam_bounds_from_the_card(gw: Gateway, digit_png: bytes) -> None:
    from unroll.registry import get_spec

    hi = get_spec("sdnet-mnist").card.lam.max
    raw = {"Content-Type": "image/png"}
    for bad in (hi * 1.01, -0.01):
        r = gw.client.post(f"/v1/classify?lam={bad}", content=digit_png, headers=raw)
        assert_error(r, 422, "invalid_parameter")
        assert f"{hi:g}" in r.json()["error"]["message"]
    r = gw.client.post(f"/v1/classify?lam={hi}", content=digit_png, headers=raw)
    assert r.status_code == 200 and r.json()["lam"] == pytest.approx(hi), r.text
    # a card without a λ rule: lam=auto is a client error, not a 5xx
    r = gw.client.post(f"/v1/classify?model={RGB_CLASSIFIER}&lam=auto", content=digit_png, headers=raw)
    assert_error(r, 422, "invalid_parameter")


def test_rgb_classifier_follows_its_card(gw: Gateway, rgb_onnx_dir: Path) -> None:
    """A real RGB photo through an RGB classifier: labels from its card, scores equal to ONNX Runtime's on the
    card's fitting (stretch to 32×32, three planes), computed here independently of the gateway's code."""
    import onnxruntime as ort
    from skimage.data import coffee

    from unroll.card import from_onnx

    card = from_onnx(rgb_onnx_dir / f"{RGB_CLASSIFIER}.onnx")
    photo = coffee()[:300, :500]  # 500×300 RGB: not square, not the model's size
    r = gw.client.post(f"/v1/classify?model={RGB_CLASSIFIER}&top_k=10", content=png(photo),
                       headers={"Content-Type": "image/png"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == RGB_CLASSIFIER and body["lam"] == pytest.approx(card.lam.default)
    assert {p["label"] for p in body["predictions"]} == set(card.labels) and len(card.labels) == 10

    h, w = card.input.fixed_hw

    def reference(rgb: np.ndarray) -> np.ndarray:
        x = np.stack([np.asarray(Image.fromarray(rgb[..., c].astype(np.float32) / 255.0).resize(
            (w, h), Image.Resampling.LANCZOS)) for c in range(3)]).clip(0, 1)[None].astype(np.float32)
        (logits,) = sess.run(None, {card.input.name: x, card.lam.input: np.array([card.lam.default], np.float32)})
        p = np.exp(logits[0] - logits[0].max())
        return p / p.sum()

    sess = ort.InferenceSession(str(rgb_onnx_dir / f"{RGB_CLASSIFIER}.onnx"), providers=["CPUExecutionProvider"])
    p = reference(photo)
    # random weights give near-uniform scores: the tolerance must be far below what a wrong pipeline changes
    tol = 3e-6
    assert np.abs(reference(photo[..., ::-1].copy()) - p).max() > 5 * tol, "BGR would pass: test cannot fail"
    served = {q["index"]: q["score"] for q in body["predictions"]}
    assert served == {i: pytest.approx(float(p[i]), abs=tol) for i in range(10)}
    assert body["predictions"][0]["label"] == card.labels[int(np.argmax(p))]


# --- settings (pydantic-settings, UNROLL_* variables) ------------------------------------------------------------


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNROLL_MAX_PIXELS", "1234")
    monkeypatch.setenv("UNROLL_CLASSIFY_MODELS", "a, b")
    monkeypatch.setenv("UNROLL_TRITON_PROTOCOL", "http")
    monkeypatch.setenv("UNROLL_API_KEY", "")
    s = Settings.from_env(request_timeout_s=7, api_key=None)  # keywords win; None keywords are ignored
    assert (s.max_pixels, s.classify_models, s.denoise_models, s.triton_protocol, s.request_timeout_s, s.api_key) \
        == (1234, ("a", "b"), (), "http", 7.0, None)
    env = s.env()
    assert env["UNROLL_MAX_PIXELS"] == "1234" and env["UNROLL_CLASSIFY_MODELS"] == "a,b"
    for k in list(os.environ):
        if k.startswith("UNROLL_"):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert Settings() == s  # env() round-trips

    monkeypatch.setenv("UNROLL_MAX_PIXELS", "many")
    with pytest.raises(SettingsError, match="UNROLL_MAX_PIXELS.*'many'"):
        Settings()
    monkeypatch.setenv("UNROLL_MAX_PIXELS", "0")
    with pytest.raises(SettingsError, match="UNROLL_MAX_PIXELS"):
        Settings.from_env()
    monkeypatch.delenv("UNROLL_MAX_PIXELS")
    monkeypatch.setenv("UNROLL_DENOISE_MODELS", "b")
    with pytest.raises(SettingsError, match="both name"):
        Settings()


def test_gateway_process_refuses_bad_env() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNROLL_")} | {"UNROLL_MAX_PIXELS": "lots"}
    p = subprocess.run([sys.executable, "-m", "unroll.serving.gateway", "--port", str(free_ports(1)[0])], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "UNROLL_MAX_PIXELS" in p.stderr, (p.returncode, p.stderr[-2000:])


# --- classification ------------------------------------------------------------------------------------------


def test_mnist_digits_accuracy(gw: Gateway, digits: tuple[np.ndarray, np.ndarray], tmp_path: Path) -> None:
    from unroll.registry import get_spec

    if not get_spec("sdnet-mnist").has_weights:
        pytest.skip("sdnet-mnist has no committed weights (unroll/weights/sdnet-mnist.pt): accuracy is meaningless")
    x, y = digits
    correct = 0
    for i, (img, label) in enumerate(zip(x, y, strict=True)):
        path = tmp_path / f"digit{i}.png"
        Image.fromarray(to8(img)).save(path)
        if i % 2:  # both upload forms
            r = gw.client.post("/v1/classify?model=sdnet-mnist&top_k=3", files={"image": (path.name, path.read_bytes(),
                                                                                        "image/png")})
        else:
            r = gw.client.post("/v1/classify?top_k=3", content=path.read_bytes(), headers={"Content-Type": "image/png"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == "sdnet-mnist" and len(body["predictions"]) == 3 and body["latency_ms"] > 0
        scores = [p["score"] for p in body["predictions"]]
        assert scores == sorted(scores, reverse=True) and 0 < sum(scores) <= 1.0 + 1e-6
        correct += body["predictions"][0]["label"] == str(label)
    assert correct / len(y) >= 0.98, f"{correct}/{len(y)} correct"


def test_classify_probabilities_lam_and_conversions(gw: Gateway, digit_png: bytes,
                                                    digits: tuple[np.ndarray, np.ndarray]) -> None:
    full = gw.client.post("/v1/classify?top_k=10", content=digit_png, headers={"Content-Type": "image/png"}).json()
    assert sum(p["score"] for p in full["predictions"]) == pytest.approx(1.0, abs=1e-4)
    assert sorted(p["index"] for p in full["predictions"]) == list(range(10))
    assert full["lam"] == pytest.approx(0.1)  # the trained λ, reported when lam is omitted

    auto = gw.client.post("/v1/classify?lam=auto&top_k=2", content=digit_png, headers={"Content-Type": "image/png"})
    assert auto.status_code == 200, auto.text
    lam = auto.json()["lam"]
    assert math.isfinite(lam) and lam >= 0
    fixed = gw.client.post("/v1/classify?lam=0.3", content=digit_png, headers={"Content-Type": "image/png"})
    assert fixed.status_code == 200 and fixed.json()["lam"] == pytest.approx(0.3)

    # colour, non-square, JPEG, with alpha: converted by the documented rules and classified like the original
    x = to8(digits[0][0])
    rgb = np.stack([x] * 3, -1)
    wide = np.zeros((28, 56, 3), np.uint8)
    wide[:, 14:42] = rgb
    buf = io.BytesIO()
    Image.fromarray(wide).save(buf, "JPEG", quality=95)
    rgba = np.dstack([rgb, np.full((28, 28), 255, np.uint8)])
    want = full["predictions"][0]["label"]
    upscaled = np.kron(x, np.ones((4, 4), np.uint8))  # 112×112: resized back to 28×28
    for data, ctype in ((buf.getvalue(), "image/jpeg"), (png(rgba), "image/png"), (png(upscaled), "image/png")):
        r = gw.client.post("/v1/classify?top_k=1", content=data, headers={"Content-Type": ctype})
        assert r.status_code == 200, r.text
        assert r.json()["predictions"][0]["label"] == want


# --- denoising -----------------------------------------------------------------------------------------------


def test_denoise_matches_onnx_in_process(gw: Gateway, camera: tuple[np.ndarray, np.ndarray], onnx_dir: Path) -> None:
    import onnxruntime as ort

    clean, noisy8 = camera
    r = gw.client.post("/v1/denoise?model=csc-denoiser&sigma=25", content=png(noisy8),
                       headers={"Content-Type": "image/png"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "image/png"
    assert float(r.headers["X-Sigma-Used"]) == pytest.approx(25.0) and r.headers["X-Sigma-Estimated"] == "false"
    assert float(r.headers["X-Latency-Ms"]) > 0
    out = Image.open(io.BytesIO(r.content))
    assert out.mode == "L" and out.size == (clean.shape[1], clean.shape[0])
    served = np.asarray(out, np.float32) / 255.0

    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(str(onnx_dir / "csc-denoiser.onnx"), so, providers=["CPUExecutionProvider"])
    (ref,) = sess.run(None, {"noisy": (noisy8.astype(np.float32) / 255.0)[None, None],
                             "sigma": np.array([25.0 / 255.0], np.float32)})
    ref = np.clip(ref[0, 0], 0, 1)
    p_served, p_ref, p_noisy = psnr(served, clean), psnr(ref, clean), psnr(noisy8 / 255.0, clean)
    assert abs(p_served - p_ref) < 0.05, (p_served, p_ref)
    assert p_served > p_noisy + 5, (p_served, p_noisy)


def test_denoise_large_image_goes_in_windows_equal_to_whole(gw: Gateway, triton: Triton, onnx_dir: Path) -> None:
    """An image larger than the card's tiling window is denoised window by window (Triton counts the windows) and
    comes back as the whole image does through the same graph (8-bit rounding apart)."""
    import onnxruntime as ort

    from unroll.card import from_onnx
    from unroll.data import add_noise, bundled_image, noise_seed
    from unroll.tiling import Tiler

    card = from_onnx(onnx_dir / "csc-denoiser.onnx")
    assert card.tiling is not None
    clean = np.tile(bundled_image("camera"), (2, 2))[:1031, :733]  # odd sides, more than one window each way
    noisy8 = to8(add_noise(clean, 25.0, noise_seed("camera", 25.0)))
    windows = len(Tiler(*noisy8.shape, card.tiling).windows())
    assert windows > 1

    def inferences() -> int:
        stats = httpx.get(f"http://{triton.url}/v2/models/csc-denoiser/stats").json()
        return int(stats["model_stats"][0]["inference_count"])

    before = inferences()
    r = gw.client.post("/v1/denoise?model=csc-denoiser&sigma=25", content=png(noisy8),
                       headers={"Content-Type": "image/png"})
    assert r.status_code == 200, r.text
    assert inferences() - before == windows
    served = np.asarray(Image.open(io.BytesIO(r.content)), np.int16)
    sess = ort.InferenceSession(str(onnx_dir / "csc-denoiser.onnx"), providers=["CPUExecutionProvider"])
    (whole,) = sess.run(None, {"noisy": (noisy8.astype(np.float32) / 255.0)[None, None],
                               "sigma": np.array([25.0 / 255.0], np.float32)})
    ref = np.rint(np.clip(whole[0, 0], 0, 1) * 255).astype(np.int16)
    assert served.shape == ref.shape
    diff = np.abs(served - ref)
    assert diff.max() <= 1 and (diff == 0).mean() > 0.999, (diff.max(), (diff == 0).mean())


def test_denoise_estimated_sigma(gw: Gateway, camera: tuple[np.ndarray, np.ndarray]) -> None:
    clean, noisy8 = camera
    r = gw.client.post("/v1/denoise", files={"image": ("noisy.png", png(noisy8), "image/png")})
    assert r.status_code == 200, r.text
    assert r.headers["X-Sigma-Estimated"] == "true"
    assert 20 < float(r.headers["X-Sigma-Used"]) < 30, r.headers["X-Sigma-Used"]
    served = np.asarray(Image.open(io.BytesIO(r.content)), np.float32) / 255.0
    assert psnr(served, clean) > psnr(noisy8 / 255.0, clean) + 5


def test_denoise_colour_odd_sizes_and_modes(gw: Gateway) -> None:
    from skimage.data import coffee

    from unroll.data import add_noise

    clean = coffee()[30:363, 40:557].astype(np.float32) / 255.0  # 333×517 RGB: colour and odd-sized
    noisy = to8(add_noise(clean, 25.0, seed=1))
    r = gw.client.post("/v1/denoise?sigma=25", content=png(noisy), headers={"Content-Type": "image/png"})
    assert r.status_code == 200, r.text
    out = Image.open(io.BytesIO(r.content))
    assert out.mode == "RGB" and out.size == (517, 333)
    assert psnr(np.asarray(out) / 255.0, clean) > psnr(noisy / 255.0, clean) + 3

    rng = np.random.default_rng(0)
    small = to8(rng.random((61, 97)))
    alpha = (np.arange(61 * 97).reshape(61, 97) % 256).astype(np.uint8)
    cases = [
        (png(small), "image/png", "L", None),
        (png(np.dstack([noisy[:61, :97], alpha])), "image/png", "RGBA", alpha),
        (png(np.dstack([small, alpha])), "image/png", "LA", alpha),
        (png(small.astype(np.uint16) * 257), "image/png", "I;16", None),
    ]
    tiff = io.BytesIO()
    Image.fromarray(small).save(tiff, "TIFF")
    cases.append((tiff.getvalue(), "image/tiff", "L", None))
    for data, ctype, mode, kept_alpha in cases:
        r = gw.client.post("/v1/denoise?sigma=15", content=data, headers={"Content-Type": ctype})
        assert r.status_code == 200, (mode, r.text)
        out = Image.open(io.BytesIO(r.content))
        assert (out.mode, out.size) == (mode, (97, 61)), (mode, out.mode, out.size)
        if kept_alpha is not None:
            assert np.array_equal(np.asarray(out)[..., -1], kept_alpha)


# --- errors: each followed by a good request ---------------------------------------------------------------


def _png_chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)


def _bomb() -> bytes:
    """A valid PNG header claiming 100000×100000 pixels (10 Gpx) with a tiny body."""
    ihdr = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", zlib.compress(b"\0" * 1024))
            + _png_chunk(b"IEND", b""))


def _error_cases(digit_png: bytes) -> list[tuple[str, str, dict, int, str]]:
    """(method+path, query, request kwargs, status, code)."""
    raw = {"headers": {"Content-Type": "image/png"}}
    corrupt = bytearray(digit_png)
    i = corrupt.index(b"IDAT") + 8
    corrupt[i:i + 40] = bytes(40)
    big = io.BytesIO()
    Image.new("L", (1200, 1100)).save(big, "PNG")  # 1.32 Mpx in ~1 kB
    gif = io.BytesIO()
    Image.new("L", (20, 20)).save(gif, "GIF")
    return [
        ("POST /v1/classify", "", {"content": b"this is not an image", **raw}, 400, "invalid_image"),
        ("POST /v1/classify", "", {"content": digit_png[: len(digit_png) // 2], **raw}, 400, "invalid_image"),
        ("POST /v1/classify", "", {"content": bytes(corrupt), **raw}, 400, "invalid_image"),
        ("POST /v1/denoise", "", {"content": b"", **raw}, 400, "invalid_image"),
        ("POST /v1/classify", "", {"files": {"file": ("d.png", digit_png, "image/png")}}, 400, "missing_image"),
        ("POST /v1/classify", "", {"content": digit_png, "headers": {"Content-Type": "text/plain"}}, 415,
         "unsupported_media_type"),
        ("POST /v1/classify", "", {"content": gif.getvalue(), "headers": {"Content-Type": "image/gif"}}, 415,
         "unsupported_media_type"),
        ("POST /v1/classify", "", {"content": gif.getvalue(), **raw}, 415, "unsupported_media_type"),
        ("POST /v1/classify", "", {"files": {"image": ("d.txt", b"hello", "text/plain")}}, 415,
         "unsupported_media_type"),
        ("POST /v1/classify", "", {"content": b"\0" * (MAX_BODY + 1), **raw}, 413, "payload_too_large"),
        ("POST /v1/classify", "", {"files": {"image": ("d.png", b"\0" * (MAX_BODY + 1), "image/png")}}, 413,
         "payload_too_large"),
        ("POST /v1/denoise", "", {"content": big.getvalue(), **raw}, 413, "image_too_large"),
        ("POST /v1/classify", "", {"content": _bomb(), **raw}, 413, "image_too_large"),
        ("POST /v1/classify", "?model=resnet-9000", {"content": digit_png, **raw}, 404, "unknown_model"),
        ("POST /v1/denoise", "?model=sdnet-mnist", {"content": digit_png, **raw}, 404, "unknown_model"),
        ("POST /v1/denoise", "?sigma=-3", {"content": digit_png, **raw}, 422, "invalid_parameter"),
        ("POST /v1/denoise", "?sigma=300", {"content": digit_png, **raw}, 422, "invalid_parameter"),
        ("POST /v1/denoise", "?sigma=nan", {"content": digit_png, **raw}, 422, "invalid_parameter"),
        ("POST /v1/denoise", "?sigma=abc", {"content": digit_png, **raw}, 422, "invalid_parameter"),
        ("POST /v1/classify", "?top_k=0", {"content": digit_png, **raw}, 422, "invalid_parameter"),
        ("POST /v1/classify", "?top_k=11", {"content": digit_png, **raw}, 422, "invalid_parameter"),
        *[("POST /v1/classify", f"?top_k={k}", {"content": digit_png, **raw}, 422, "invalid_parameter")
          for k in ("2%20", "%2B2", "%D9%A2", "2_0")],  # a count is ASCII digits only
        ("POST /v1/classify", "?lam=nan", {"content": digit_png, **raw}, 422, "invalid_parameter"),
        ("POST /v1/classify", "?lam=-1", {"content": digit_png, **raw}, 422, "invalid_parameter"),
        ("POST /v1/classify", "?lam=inf", {"content": digit_png, **raw}, 422, "invalid_parameter"),
        ("POST /v1/classify", "?lam=big", {"content": digit_png, **raw}, 422, "invalid_parameter"),
        ("POST /v1/denoise", "?sigma=25", {"content": png(np.zeros((8, 8), np.uint8)), **raw}, 422,
         "image_too_small"),
        ("GET /v1/classify", "", {}, 405, "method_not_allowed"),
        ("GET /v1/nothing-here", "", {}, 404, "not_found"),
    ]


def test_errors_are_json_4xx_and_server_keeps_serving(gw: Gateway, digit_png: bytes) -> None:
    for target, query, kwargs, status, code in _error_cases(digit_png):
        method, path = target.split()
        r = gw.client.request(method, path + query, **kwargs)
        assert_error(r, status, code)
        classify_ok(gw, digit_png)


def test_body_limit_applies_while_streaming(gw: Gateway, digit_png: bytes) -> None:
    """Chunked uploads (no Content-Length) over the limit are cut off at the limit, raw and multipart."""
    def chunks(total: int, head: bytes = b"", tail: bytes = b"") -> Iterator[bytes]:
        yield head
        for _ in range(total // 65536):
            yield b"\0" * 65536
        yield tail

    r = gw.client.post("/v1/classify", content=chunks(MAX_BODY + 65536), headers={"Content-Type": "image/png"})
    assert "content-length" not in r.request.headers
    assert_error(r, 413, "payload_too_large")
    classify_ok(gw, digit_png)

    boundary = "gwtestboundary"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"x.png\"\r\n"
            "Content-Type: image/png\r\n\r\n").encode()
    r = gw.client.post("/v1/classify", content=chunks(MAX_BODY + 65536, head, f"\r\n--{boundary}--\r\n".encode()),
                       headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert_error(r, 413, "payload_too_large")
    classify_ok(gw, digit_png)

    # a streamed upload under the limit is fine
    r = gw.client.post("/v1/classify", content=iter([digit_png[:100], digit_png[100:]]),
                       headers={"Content-Type": "image/png"})
    assert r.status_code == 200, r.text


def test_metrics(gw: Gateway, digit_png: bytes) -> None:
    raw = {"Content-Type": "image/png"}
    assert gw.client.post("/v1/classify", content=digit_png, headers=raw).status_code == 200
    assert gw.client.post("/v1/denoise?sigma=5", content=png(np.zeros((16, 16), np.uint8)), headers=raw).status_code \
        == 200
    assert gw.client.post("/v1/classify?top_k=0", content=digit_png, headers=raw).status_code == 422
    assert gw.client.post("/v1/denoise", content=b"\0" * (MAX_BODY + 1), headers=raw).status_code == 413
    assert gw.client.get("/no/such/path").status_code == 404
    text = gw.client.get("/metrics").text
    assert 'unroll_gateway_requests_total{method="POST",route="/v1/classify",status="200"}' in text
    assert 'unroll_gateway_requests_total{method="POST",route="/v1/classify",status="422"}' in text
    assert 'unroll_gateway_requests_total{method="POST",route="/v1/denoise",status="413"}' in text
    assert 'unroll_gateway_requests_total{method="GET",route="unmatched",status="404"}' in text
    assert 'unroll_gateway_request_duration_seconds_bucket{le="0.05",method="POST",route="/v1/classify"}' in text
    assert "unroll_gateway_requests_in_flight 1.0" in text  # this very request
    assert 'unroll_gateway_triton_request_duration_seconds_count{model="sdnet-mnist",outcome="ok",version="1"}' in text
    assert 'unroll_gateway_triton_request_duration_seconds_count{model="csc-denoiser",outcome="ok",version="1"}' in text


# --- API key, concurrency limit, timeout (the gRPC gateway) --------------------------------------------------


def test_api_key(gw_key: Gateway, digit_png: bytes) -> None:
    c = gw_key.client
    for headers in ({}, {"X-API-Key": "wrong"}, {"Authorization": f"Basic {API_KEY}"},
                    {"Authorization": "Bearer nope"}):
        r = c.post("/v1/classify", content=digit_png, headers={"Content-Type": "image/png", **headers})
        assert_error(r, 401, "unauthorized")
        assert_error(c.get("/v1/models", headers=headers), 401, "unauthorized")
    classify_ok(gw_key, digit_png, **{"X-API-Key": API_KEY})
    classify_ok(gw_key, digit_png, Authorization=f"Bearer {API_KEY}")
    assert c.get("/v1/models", headers={"X-API-Key": API_KEY}).status_code == 200
    for open_path in ("/healthz", "/readyz", "/metrics"):
        assert c.get(open_path).status_code == 200, open_path


def test_concurrency_limit_429_and_triton_timeout_504(triton: Triton, digit_png: bytes,
                                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    """Limit 1 in flight, queue 0: of three concurrent denoises one runs, and its Triton calls (each a batch of
    windows, far slower than the 20 ms deadline here) hit the deadline: 504. The gateway reads Triton's models under
    the same deadline: the burst waits until it has read the denoiser (on a loaded machine a read can take longer,
    answered 503 until it is read again: test_a_model_the_gateway_could_not_read_is_503_not_404)."""
    rng = np.random.default_rng(0)
    big = png(to8(rng.random((1536, 1536))))  # windows of 448², four per call: tenths of a second each on a CPU
    settings = Settings(triton_url=triton.url, triton_protocol="http", api_key=API_KEY, max_concurrency=1,
                        max_queue=0, request_timeout_s=0.02)
    with running_gateway(settings, tmp_path_factory.mktemp("gw-deadline") / "gateway.log") as g:
        _wait_served(g, "csc-denoiser", {"X-API-Key": API_KEY})

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=g.base, timeout=60, headers={"X-API-Key": API_KEY}) as ac:
                return await asyncio.gather(*(ac.post("/v1/denoise?sigma=25", content=big,
                                                      headers={"Content-Type": "image/png"}) for _ in range(3)))

        t0 = time.monotonic()
        rs = asyncio.run(burst())
        assert sorted(r.status_code for r in rs) == [429, 429, 504], [(r.status_code, r.text) for r in rs]
        for r in rs:
            if r.status_code == 429:
                assert_error(r, 429, "too_many_requests")
                assert int(r.headers["Retry-After"]) >= 1
            else:
                assert_error(r, 504, "triton_timeout")
        assert time.monotonic() - t0 < 10


def _wait_served(g: Gateway, name: str, headers: dict[str, str], within_s: float = 60.0) -> None:
    """Until the gateway lists ``name`` among its served models (each look at most one re-read of Triton's)."""
    deadline = time.monotonic() + within_s
    while name not in {m["name"] for m in g.client.get("/v1/models", headers=headers).json()["models"]}:
        assert time.monotonic() < deadline, f"{name} not served by the gateway within {within_s:g} s"
        time.sleep(0.2)


class _ConfigNotGiven:
    """The gateway's real Triton client, except that Triton does not give ``name``'s config in time while ``slow``
    (a slow answer on a loaded machine cannot be caused on cue for one call; every other call is real)."""

    def __init__(self, real, name: str) -> None:
        self.real, self.name, self.slow = real, name, True

    def __getattr__(self, attr: str):
        return getattr(self.real, attr)

    async def model_config(self, name: str) -> dict:
        from unroll.errors import TritonTimeout

        if self.slow and name == self.name:
            raise TritonTimeout(f"Triton did not answer config of {name} within 0.02 s")
        return await self.real.model_config(name)


def test_a_model_the_gateway_could_not_read_is_503_not_404(triton: Triton, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton lists the denoiser but did not give its config in time: it is not known to be absent, so a request for
    it, or for its task while nothing else serves it, gets 503 with Retry-After (it was a 404 "serves no denoising
    model", run 37); the other task is served meanwhile, a model Triton does not list is still 404, and the next
    read serves the denoiser."""
    from unroll.errors import ApiError
    from unroll.serving.gateway import catalog
    from unroll.serving.gateway.triton_client import TritonBackend

    monkeypatch.setattr(catalog, "MIN_REFRESH_S", 0.0)
    settings = Settings(triton_url=triton.url, triton_protocol="http")

    async def scenario() -> None:
        real = TritonBackend(triton.url, "http", 10.0)
        backend = _ConfigNotGiven(real, "csc-denoiser")
        cat = catalog.Catalog(backend, settings)  # type: ignore[arg-type]
        try:
            assert (await cat.resolve(None, "classification")).name == "sdnet-mnist"
            for model in (None, "csc-denoiser"):
                with pytest.raises(ApiError) as e:
                    await cat.resolve(model, "denoising")
                assert (e.value.status, e.value.code) == (503, "model_unavailable"), e.value.message
                assert e.value.headers["Retry-After"] == str(settings.retry_after_s)
                assert "csc-denoiser: cannot read its config from Triton" in e.value.message, e.value.message
            with pytest.raises(ApiError) as e:
                await cat.resolve("no-such-model", "denoising")
            assert e.value.status == 404
            with pytest.raises(ApiError) as e:
                await cat.loaded("csc-denoiser")
            assert e.value.status == 503
            backend.slow = False
            assert (await cat.resolve(None, "denoising")).name == "csc-denoiser"
        finally:
            await real.close()

    asyncio.run(scenario())


def test_triton_down_then_back(gw: Gateway, gw_key: Gateway, triton: Triton, digit_png: bytes) -> None:
    classify_ok(gw, digit_png)
    triton.stop()
    t0 = time.monotonic()
    r = gw.client.post("/v1/classify", content=digit_png, headers={"Content-Type": "image/png"})
    assert time.monotonic() - t0 < 20  # well within the gateway's Triton timeout
    assert_error(r, 503, "triton_unavailable")
    assert r.headers["Retry-After"] == "3"
    r = gw_key.client.post("/v1/classify", content=digit_png,
                           headers={"Content-Type": "image/png", "X-API-Key": API_KEY})
    assert_error(r, 503, "triton_unavailable")
    ready = gw.client.get("/readyz")
    assert_error(ready, 503, "not_ready")
    assert ready.json()["triton"] is False and "Retry-After" in ready.headers
    assert gw.client.get("/healthz").status_code == 200

    triton.start()  # same ports; the gateways are not restarted
    for g, headers in ((gw, {}), (gw_key, {"X-API-Key": API_KEY})):
        deadline = time.monotonic() + 30
        while True:
            r = g.client.post("/v1/classify", content=digit_png, headers={"Content-Type": "image/png", **headers})
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert r.status_code == 200, r.text
    assert gw.client.get("/readyz").status_code == 200
