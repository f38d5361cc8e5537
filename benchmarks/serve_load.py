"""The load side of ``unroll bench serve``: the workloads (real inputs of the served demo models), one client per
path (in-process ONNX Runtime, Triton HTTP and gRPC, the gateway) and the closed loop that drives them."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from unroll import tasks
from unroll.benchmarks.common import demo_model, png_bytes
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
MAX_ERROR_SAMPLES = 3


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


#: Per-thread client: ``(call(i), close())``; ``call`` sends sample ``i`` and raises on any error.
Client = tuple[Callable[[int], object], Callable[[], None]]


def as_batch(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1, 1) if a.ndim == 1 else a  # [B] (lam, sigma) travels as [B, 1] (config: dims [1] + reshape)


def ort_client(session, w: Workload) -> Callable[[], Client]:
    feeds = w.arrays

    def make() -> Client:
        return (lambda i: session.run(None, feeds[i % len(feeds)])), (lambda: None)

    return make


def triton_http_client(url: str, w: Workload) -> Callable[[], Client]:
    def make() -> Client:
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(url, connection_timeout=60, network_timeout=120)
        outputs = [httpclient.InferRequestedOutput(w.output, binary_data=True)]

        def call(i: int) -> object:
            ins = []
            for name, a in w.arrays[i % len(w.arrays)].items():
                a = as_batch(a)
                t = httpclient.InferInput(name, list(a.shape), "FP32")
                t.set_data_from_numpy(a, binary_data=True)
                ins.append(t)
            return client.infer(w.model, ins, outputs=outputs).as_numpy(w.output)

        return call, client.close

    return make


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


def triton_grpc_client(url: str, w: Workload, image: bool = False) -> Callable[[], Client]:
    """Triton's gRPC endpoint with ``w``'s tensors, or (``image``) with its PNG bytes."""
    feeds = image_feeds(w) if image else [{k: as_batch(v) for k, v in a.items()} for a in w.arrays]
    output = image_output(w) if image else w.output

    def make() -> Client:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import np_to_triton_dtype

        client = grpcclient.InferenceServerClient(url)
        outputs = [grpcclient.InferRequestedOutput(output)]

        def call(i: int) -> object:
            ins = []
            for name, a in feeds[i % len(feeds)].items():
                t = grpcclient.InferInput(name, list(a.shape), np_to_triton_dtype(a.dtype))
                t.set_data_from_numpy(a)
                ins.append(t)
            return client.infer(w.model, ins, outputs=outputs, client_timeout=120).as_numpy(output)

        return call, client.close

    return make


def gateway_client(base: str, w: Workload) -> Callable[[], Client]:
    def make() -> Client:
        import httpx

        client = httpx.Client(base_url=base, timeout=120)

        def call(i: int) -> object:
            r = client.post(w.gateway_path, content=w.images[i % len(w.images)],
                            headers={"Content-Type": "image/png"})
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:160]}")
            return r.content

        return call, client.close

    return make


@dataclass
class LoopResult:
    latencies_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0


def closed_loop(make: Callable[[], Client], concurrency: int, duration_s: float, warmup_s: float,
                on_measure_start: Callable[[], None] | None = None,
                tick: Callable[[float], None] | None = None) -> LoopResult:
    """``concurrency`` threads, each sending its next request as soon as the previous one answered.

    Phase 1 (``warmup_s``, not recorded) warms connections and caches; all threads then drain and
    meet, ``on_measure_start`` runs (statistics snapshot), and phase 2 records for ``duration_s``.
    Requests in flight at the deadline finish and count; none starts after it. ``tick(elapsed)`` is
    called about 10× a second from the calling thread (progress bars).
    """
    lat: list[list[float]] = [[] for _ in range(concurrency)]
    errs: list[list[str]] = [[] for _ in range(concurrency)]
    ends = [0.0] * concurrency
    ready = threading.Barrier(concurrency + 1)
    go = threading.Event()
    clock: dict[str, float] = {}

    def worker(k: int) -> None:
        try:
            call, close = make()
        except Exception as e:  # a client that cannot even connect is an error of this level
            errs[k].append(f"client: {type(e).__name__}: {e}"[:200])
            with contextlib.suppress(threading.BrokenBarrierError):
                ready.wait()
            return
        try:
            i = k
            stop = time.perf_counter() + warmup_s
            while time.perf_counter() < stop:
                with contextlib.suppress(Exception):
                    call(i)
                i += concurrency
            ready.wait()
            go.wait()
            deadline = clock["deadline"]
            while (t0 := time.perf_counter()) < deadline:
                try:
                    call(i)
                    lat[k].append((time.perf_counter() - t0) * 1e3)
                except Exception as e:
                    errs[k].append(f"{type(e).__name__}: {e}"[:200])
                i += concurrency
            ends[k] = time.perf_counter()
        finally:
            close()

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(concurrency)]
    for t in threads:
        t.start()
    ready.wait()
    if on_measure_start is not None:
        on_measure_start()
    clock["start"] = time.perf_counter()
    clock["deadline"] = clock["start"] + duration_s
    go.set()
    while any(t.is_alive() for t in threads):
        if tick is not None:
            tick(time.perf_counter() - clock["start"])
        time.sleep(0.1)
    for t in threads:
        t.join()
    end = max([e for e in ends if e > 0], default=clock["start"] + duration_s)
    return LoopResult([x for part in lat for x in part], [x for part in errs for x in part], end - clock["start"])
