"""The load side of ``unroll bench serve``: the workloads (real inputs of the served demo models) and, per path, what
the project's load engine (:mod:`.loadgen`) sends: in-process ONNX Runtime calls, Triton's HTTP endpoint (binary
tensors), its gRPC endpoint (tensors, or the PNG bytes), the gateway (PNG). One engine for every path, so the paths
differ by what they send and where, never by how they are driven or timed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from unroll import tasks
from unroll.benchmarks import loadgen
from unroll.benchmarks.common import demo_model, png_bytes
from unroll.benchmarks.loadgen import InProcessSender, LevelResult, Load, Payload, Sender, Tensors
from unroll.data import add_noise, dataset, noise_seed
from unroll.errors import BenchError, NoModel
from unroll.registry import get_spec

PATHS = ("onnxruntime", "triton-http", "triton-grpc", "triton-grpc-image", "gateway")
PATH_LABELS = {"onnxruntime": "in-process ONNX Runtime", "triton-http": "Triton HTTP", "triton-grpc": "Triton gRPC",
               "triton-grpc-image": "Triton gRPC (PNG bytes)", "gateway": "gateway (HTTP, PNG)"}
#: The denoiser sweeps skip Triton HTTP (gRPC stands for "Triton direct"): large-image requests are slow.
DENOISE_PATHS = ("onnxruntime", "triton-grpc", "triton-grpc-image", "gateway")
#: Triton-direct levels measured with perf_analyzer (the classifier; the denoisers use their own concurrency).
PERF_ANALYZER_CONCURRENCY = (1, 16)
DENOISE_SIGMA = 25.0
CLASSIFY_SAMPLES = 256
DENOISE_IMAGES = 4
#: Seconds a request may take before it counts as a timeout (a 512² denoise at high concurrency on 2 cores is slow).
REQUEST_TIMEOUT_S = 120.0


@dataclass
class Workload:
    """One model + input kind: the graph inputs (batch 1) and the same inputs as image files for the gateway."""

    key: str  #: short id used in file names and tables, e.g. ``classify`` or ``denoise-512``
    model: str
    label: str
    arrays: list[dict[str, np.ndarray]]
    images: list[bytes]
    gateway_path: str
    output: str
    concurrency: tuple[int, ...] = ()
    paths: tuple[str, ...] = PATHS


@dataclass(frozen=True)
class Served:
    """The models this benchmark serves, from the registry: the trained classifier, its λ rule, the denoiser."""

    classifier: str
    lam_rule: str | None
    denoiser: str

    @property
    def triton_models(self) -> tuple[str, ...]:
        return tuple(m for m in (self.classifier, self.lam_rule, self.denoiser) if m is not None)


def served_models() -> Served:
    try:
        classifier, denoiser = demo_model(tasks.CLASSIFICATION), demo_model(tasks.DENOISING)
    except NoModel as e:
        raise BenchError(str(e)) from None
    lam = get_spec(classifier).card.lam
    return Served(classifier, lam.auto if lam is not None else None, denoiser)


def classify_workload(name: str, n: int = CLASSIFY_SAMPLES, lam: float | None = None) -> Workload:
    """The first ``n`` samples of the classifier's test data (its card's), one per request, with the trained λ."""
    card = get_spec(name).card
    x, _ = dataset(card.data.test).load()
    x = x[:n]
    arrays = []
    for i in range(len(x)):
        feeds = {card.input.name: x[i:i + 1]}
        if card.lam is not None and lam is not None:
            feeds[card.lam.input] = np.array([lam], np.float32)
        arrays.append(feeds)
    hw = "×".join(str(d) for d in x.shape[2:])
    images = [png_bytes(d[0] if d.shape[0] == 1 else d.transpose(1, 2, 0)) for d in x]
    return Workload("classify", name, f"{card.data.test} sample {hw}", arrays, images,
                    f"/v1/classify?model={name}&top_k=5", card.output)


def denoise_workload(name: str, size: int, n: int = DENOISE_IMAGES, sigma255: float = DENOISE_SIGMA) -> Workload:
    """The denoiser's held-out images (its card's test data) resized to ``size``², seeded σ noise (the same noisy
    image for every path)."""
    from skimage.transform import resize

    card = get_spec(name).card
    arrays, images = [], []
    for image_name, clean in list(dataset(card.data.test).load().items())[:n]:
        img = resize(clean, (size, size), anti_aliasing=True).astype(np.float32)
        noisy = add_noise(img, sigma255, noise_seed(image_name, sigma255))
        x = np.repeat(noisy[None, None], card.input.shape[0], axis=1)
        arrays.append({card.input.name: x, card.sigma.input: np.array([sigma255 / card.sigma.scale], np.float32)})
        images.append(png_bytes(noisy))
    return Workload(f"denoise-{size}", name, f"{size}×{size} photo, σ={sigma255:g}", arrays, images,
                    f"/v1/denoise?model={name}&sigma={sigma255:g}", card.output)


def as_batch(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1, 1) if a.ndim == 1 else a  # [B] (lam, sigma) travels as [B, 1] (config: dims [1] + reshape)


def image_feeds(w: Workload) -> list[dict[str, np.ndarray]]:
    """``w``'s samples as the encoded-image protocol sends them (:mod:`unroll.serving.imaging.wire`): the PNG the
    gateway gets, as one ``image_bytes`` row, in place of the float input; λ or σ as they are."""
    from unroll.serving.imaging.wire import IMAGE_BYTES, rows

    image_name = next(iter(w.arrays[0]))  # the card's float input comes first
    return [{IMAGE_BYTES: rows([png]), **{k: as_batch(v) for k, v in a.items() if k != image_name}}
            for png, a in zip(w.images, w.arrays, strict=True)]


def image_output(w: Workload) -> str:
    """What a client of the encoded-image protocol asks for: the encoded result of a denoiser, a classifier's logits."""
    from unroll.serving.imaging.wire import ENCODED

    return ENCODED if w.key.startswith("denoise") else w.output


def gateway_payloads(w: Workload) -> list[Payload]:
    """``w``'s images as the gateway takes them: the PNG as the raw body of its ``/v1`` route."""
    return [Payload(w.gateway_path, png, {"Content-Type": "image/png"}) for png in w.images]


@dataclass(frozen=True)
class Traffic:
    """What one path sends: the engine's target (a URL, a ``grpc://`` Triton or an in-process sender) and the
    requests it cycles through."""

    target: str | Sender
    payloads: list


def traffic(path: str, w: Workload, concurrency: int, *, triton_http: str | None = None,
            triton_grpc: str | None = None, gateway: str | None = None, session: Any = None) -> Traffic:
    """``w``'s requests on ``path`` (:data:`PATHS`); the in-process sender gets a thread per request in flight."""
    tensors = [{k: as_batch(v) for k, v in a.items()} for a in w.arrays]
    if path == "onnxruntime":
        return Traffic(InProcessSender(lambda feeds: session.run(None, feeds), concurrency), list(w.arrays))
    if path == "triton-http" and triton_http:
        return Traffic(f"http://{triton_http}", [loadgen.v2_infer(w.model, t, [w.output]) for t in tensors])
    if path == "triton-grpc" and triton_grpc:
        return Traffic(f"grpc://{triton_grpc}", [Tensors(w.model, t, (w.output,)) for t in tensors])
    if path == "triton-grpc-image" and triton_grpc:
        return Traffic(f"grpc://{triton_grpc}", [Tensors(w.model, f, (image_output(w),)) for f in image_feeds(w)])
    if path == "gateway" and gateway:
        return Traffic(gateway, gateway_payloads(w))
    raise BenchError(f"no server to measure {path} on")


def closed_level(t: Traffic, concurrency: int, duration_s: float, warmup_s: float,
          on_measure_start: Callable[[], object] | None = None, progress: Callable[[float], None] | None = None,
          timeout_s: float = REQUEST_TIMEOUT_S) -> LevelResult:
    """One closed-loop level of ``t`` on the engine: ``concurrency`` requests in flight, ``warmup_s`` not counted,
    then ``duration_s`` measured (``on_measure_start`` runs as that window opens: the statistics snapshots)."""
    return loadgen.run(t.target, t.payloads, Load(concurrency=concurrency), duration_s, warmup_s, timeout_s,
                       progress=progress, on_measure_start=on_measure_start)
