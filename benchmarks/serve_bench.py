"""The serving path under load: in-process ONNX Runtime vs Triton (HTTP, gRPC) vs the REST gateway.

A closed-loop load generator sweeps concurrency levels on real inputs of the trained demo models and records
throughput, latency percentiles, errors and Triton's own per-stage split and batch sizes; Triton direct is also
measured with ``perf_analyzer`` (:mod:`unroll.benchmarks.perf_analyzer`). Dynamic batching on vs off runs in
interleaved rounds (the median ratio), so load drifting on a shared machine hits both alike. The targets
(:func:`targets`) are ratios within one run; client, gateway and Triton share the machine's cores, so the numbers
say what this box serves.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from unroll.benchmarks.common import (
    NoModel,
    demo_model,
    exported_card,
    latency_summary,
    load_note,
    machine_info,
    ort_session,
    png_bytes,
    progress_bars,
    write_results,
)

from unroll import artifacts, pipeline, tasks
from unroll.errors import BenchError  # a server could not be started or reached (re-exported for callers)

PATHS = ("onnxruntime", "triton-http", "triton-grpc", "gateway")
PATH_LABELS = {"onnxruntime": "in-process ONNX Runtime", "triton-http": "Triton HTTP", "triton-grpc": "Triton gRPC",
               "gateway": "gateway (HTTP, PNG)"}
DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32)
DEFAULT_DENOISE_CONCURRENCY = (1, 4)
DEFAULT_DENOISE_SIZES = (256, 512)
#: The denoiser sweeps skip Triton HTTP (gRPC stands for "Triton direct"): large-image requests are slow.
DENOISE_PATHS = ("onnxruntime", "triton-grpc", "gateway")
DENOISE_SIGMA = 25.0
CLASSIFY_SAMPLES = 256
DENOISE_IMAGES = 4
TARGET_OVERHEAD_MS = 2.0
TARGET_BATCHING_SPEEDUP = 1.5
#: Triton direct (perf_analyzer, one digit, concurrency 1) p50 ≤ in-process ONNX Runtime p50 + this.
TARGET_DIRECT_OVERHEAD_MS = 0.5
#: Triton direct at the batching concurrency ≥ this share of ONNX Runtime's in-process batched ceiling.
TARGET_CEILING_SHARE = 0.7
#: Triton-direct levels measured with perf_analyzer (the classifier; the denoisers use their own concurrency).
PERF_ANALYZER_CONCURRENCY = (1, 16)
#: Batch sizes tried for ONNX Runtime's in-process batched ceiling (the best one is the ceiling).
CEILING_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
#: Queue delays (µs) compared with the default (serving/repository.py) at concurrency 1 and the batching level.
COMPARE_QUEUE_DELAYS_US = (500,)
MAX_ERROR_SAMPLES = 3


# ----------------------------------------------------------------------------------------------- workloads


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
    from unroll.registry import get_spec

    try:
        classifier, denoiser = demo_model(tasks.CLASSIFICATION), demo_model(tasks.DENOISING)
    except NoModel as e:
        raise BenchError(str(e)) from None
    lam = get_spec(classifier).card.lam
    return Served(classifier, lam.auto if lam is not None else None, denoiser)


def classify_workload(name: str, n: int = CLASSIFY_SAMPLES, lam: float | None = None) -> Workload:
    """The first ``n`` samples of the classifier's test data (its card's), one per request, with the trained λ."""
    from unroll.data import dataset
    from unroll.registry import get_spec

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

    from unroll.data import add_noise, dataset, noise_seed
    from unroll.registry import get_spec

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


# ----------------------------------------------------------------------------------------------- clients

#: Per-thread client: ``(call(i), close())``; ``call`` sends sample ``i`` and raises on any error.
Client = tuple[Callable[[int], object], Callable[[], None]]


def _as_batch(a: np.ndarray) -> np.ndarray:
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
                a = _as_batch(a)
                t = httpclient.InferInput(name, list(a.shape), "FP32")
                t.set_data_from_numpy(a, binary_data=True)
                ins.append(t)
            return client.infer(w.model, ins, outputs=outputs).as_numpy(w.output)

        return call, client.close

    return make


def triton_grpc_client(url: str, w: Workload) -> Callable[[], Client]:
    def make() -> Client:
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(url)
        outputs = [grpcclient.InferRequestedOutput(w.output)]

        def call(i: int) -> object:
            ins = []
            for name, a in w.arrays[i % len(w.arrays)].items():
                a = _as_batch(a)
                t = grpcclient.InferInput(name, list(a.shape), "FP32")
                t.set_data_from_numpy(a)
                ins.append(t)
            return client.infer(w.model, ins, outputs=outputs, client_timeout=120).as_numpy(w.output)

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


# ----------------------------------------------------------------------------------------------- load loop


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


# ----------------------------------------------------------------------------------------------- Triton statistics

STAT_KEYS = ("queue", "compute_input", "compute_infer", "compute_output")


def _get_json(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def triton_stats(http_url: str, model: str) -> dict | None:
    """Triton's cumulative statistics for ``model`` (``None`` when they cannot be read)."""
    try:
        return _get_json(f"http://{http_url}/v2/models/{model}/stats")["model_stats"][0]
    except (OSError, ValueError, KeyError, IndexError):
        return None


def triton_config(http_url: str, model: str) -> dict:
    """The batching part of a served model's config (max_batch_size, dynamic_batching)."""
    try:
        cfg = _get_json(f"http://{http_url}/v2/models/{model}/config")
    except (OSError, ValueError):
        return {}
    return {"max_batch_size": cfg.get("max_batch_size"), "dynamic_batching": cfg.get("dynamic_batching"),
            "instances": sum(int(g.get("count", 1)) for g in cfg.get("instance_group", []))}


def stats_delta(before: dict | None, after: dict | None) -> dict | None:
    """Per-request server split (mean ms) and average batch size between two statistics snapshots."""
    if before is None or after is None:
        return None
    a, b = after["inference_stats"], before["inference_stats"]

    def d(key: str, what: str) -> int:
        return int(a.get(key, {}).get(what, 0)) - int(b.get(key, {}).get(what, 0))

    n = d("success", "count")
    if n <= 0:
        return None
    out = {"requests": n, "failed": d("fail", "count"),
           "executions": int(after.get("execution_count", 0)) - int(before.get("execution_count", 0)),
           "inferences": int(after.get("inference_count", 0)) - int(before.get("inference_count", 0)),
           "total_ms": d("success", "ns") / n / 1e6}
    for k in STAT_KEYS:
        out[f"{k}_ms"] = d(k, "ns") / n / 1e6
    out["avg_batch"] = out["inferences"] / out["executions"] if out["executions"] > 0 else None
    out["other_ms"] = max(0.0, out["total_ms"] - sum(out[f"{k}_ms"] for k in STAT_KEYS))
    return out


# ----------------------------------------------------------------------------------------------- servers


@dataclass
class Servers:
    """Where Triton (HTTP + gRPC) and the gateway listen, and whether this run started them."""

    triton_http: str
    triton_grpc: str
    gateway: str | None
    started_triton: bool = False
    started_gateway: bool = False
    gateway_protocol: str = "grpc"


def _wait_ready(url: str, timeout_s: float) -> None:
    """An attached server must answer 200 on ``url`` (a health endpoint) within ``timeout_s``."""
    from unroll.serving.gateway.process import GatewayStartError, wait_ready

    try:
        wait_ready(url, timeout_s)
    except GatewayStartError as e:
        raise BenchError(str(e)) from None


def _check_grpc(url: str) -> None:
    """Fail early when an attached Triton's gRPC endpoint is not where we think (every request would fail)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    try:
        with grpcclient.InferenceServerClient(url) as c:
            if c.is_server_ready(client_timeout=5):
                return
    except InferenceServerException:
        pass
    raise BenchError(f"no ready Triton gRPC endpoint at {url}; pass --triton-grpc-url HOST:PORT")


def write_repositories(onnx_dir: Path, root: Path, served: Served) -> tuple[Path, Path]:
    """The batching repository (project defaults) and a no-batching one for the classifier.

    No batching = ``max_batch_size: 1`` and the ``dynamic_batching`` block removed (Triton's default
    scheduler: one request per execution). The no-batching repository also holds :data:`FLOOR_MODEL`.
    """
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc
    from unroll.serving.repository import write_repository
    from unroll.serving.repository_check import validate_model

    # export what is missing or stale (registered models; companions come along)
    pipeline.run(pipeline.plan([served.classifier, served.denoiser], onnx_dir=onnx_dir))
    on, off = root / "batching", root / "no-batching"
    write_repository("cpu", list(served.triton_models), on, onnx_dir=onnx_dir)
    write_repository("cpu", [served.classifier], off, onnx_dir=onnx_dir, max_batch_size=1)
    path = off / served.classifier / "config.pbtxt"
    text = path.read_text()
    header = "".join(ln + "\n" for ln in text.splitlines() if ln.startswith("#"))
    cfg = text_format.Parse(text, mc.ModelConfig())
    cfg.ClearField("dynamic_batching")
    path.write_text(header + "# unroll bench serve: dynamic batching removed (max_batch_size 1, default scheduler).\n"
                    + text_format.MessageToString(cfg))
    validate_model(off / served.classifier, reference_onnx=artifacts.graph(served.classifier, onnx_dir=onnx_dir))
    write_floor_model(off, on / served.classifier / "config.pbtxt")
    return on, off


#: A do-nothing Python-backend model (output = input, zero-copy) beside the classifier in the no-batching repository:
#: what Triton + gRPC + the Python backend's stub cost per request before any model runs (the floor under
#: "Triton direct ≤ in-process ONNX Runtime + 0.5 ms").
FLOOR_MODEL = "python-backend-floor"
_FLOOR_PY = '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """unroll bench serve: output = input, zero-copy (DLPack), nothing else."""

    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor.from_dlpack(
            "y", pb_utils.get_input_tensor_by_name(r, "x").to_dlpack())]) for r in requests]
'''


def write_floor_model(repo: Path, like: Path) -> None:
    """:data:`FLOOR_MODEL` in ``repo``: the classifier's main input shape (config ``like``), batching as the default."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    src = text_format.Parse(like.read_text(), mc.ModelConfig())
    cfg = mc.ModelConfig(name=FLOOR_MODEL, backend="python", max_batch_size=src.max_batch_size or 32)
    first = src.input[0]
    cfg.input.add(name="x", data_type=first.data_type, dims=first.dims)
    cfg.output.add(name="y", data_type=first.data_type, dims=first.dims)
    cfg.dynamic_batching.max_queue_delay_microseconds = 0
    cfg.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=1)
    (repo / FLOOR_MODEL / "1").mkdir(parents=True, exist_ok=True)
    (repo / FLOOR_MODEL / "config.pbtxt").write_text(text_format.MessageToString(cfg))
    (repo / FLOOR_MODEL / "1" / "model.py").write_text(_FLOOR_PY)


def write_delay_repository(onnx_dir: Path, root: Path, served: Served, queue_delay_us: int) -> Path:
    """The classifier alone, batching as the project default except ``max_queue_delay_microseconds``."""
    from unroll.serving.repository import write_repository

    write_repository("cpu", [served.classifier], root, onnx_dir=onnx_dir, queue_delay_us=queue_delay_us)
    return root


@contextlib.contextmanager
def triton_server(repo: Path, log: Path) -> Iterator[tuple[str, str]]:
    """A tritonserver on free ports; yields (HTTP url, gRPC url) and always stops it."""
    from unroll.serving.triton import TritonStartError, free_ports, start

    try:
        handle = start(repo, *free_ports(3), log_file=log, timeout_s=300, extra_args=["--exit-timeout-secs=2"])
    except TritonStartError as e:
        raise BenchError(f"could not start Triton: {e.reason} (log: {log})") from None
    try:
        yield handle.url, handle.grpc_url
    finally:
        handle.stop()


# ----------------------------------------------------------------------------------------------- perf_analyzer, ceiling


def perf_analyzer_level(w: Workload, concurrency: int, servers: Servers, window_ms: int) -> dict:
    """One Triton-direct level measured by ``perf_analyzer`` (gRPC, real inputs), in :func:`measure`'s row format
    (``path`` ``perf-analyzer``; latency mean/max are not reported by it), with its server split and the average
    batch Triton formed (statistics delta around the run). Raises ``PerfAnalyzerError``."""
    from unroll.benchmarks import perf_analyzer as pa

    before = triton_stats(servers.triton_http, w.model)
    row = pa.measure(w.model, servers.triton_grpc, w.arrays, concurrency, window_ms=window_ms)
    delta = stats_delta(before, triton_stats(servers.triton_http, w.model)) or {}
    lat = {k: float("nan") for k in ("mean", "p50", "p90", "p95", "p99", "max")} | row["latency_ms"]
    return {"workload": w.key, "model": w.model, "input": w.label, "path": "perf-analyzer",
            "concurrency": concurrency, "requests": delta.get("requests"), "errors": delta.get("failed", 0),
            "error_samples": [], "throughput_rps": row["throughput_rps"], "latency_ms": lat,
            "server": row["server"] | {"avg_batch": delta.get("avg_batch")}, "client_split": row["client"],
            "stable": row["stable"], "command": row["command"]}


def _pa_window_ms(duration_s: float) -> int:
    """perf_analyzer's measurement window for a level of ``duration_s``: half of it (it needs ≥ 2 windows), ≥ 0.5 s."""
    return max(500, int(duration_s * 1000 / 2))


def direct_level(w: Workload, concurrency: int, servers: Servers, sessions: dict, duration_s: float,
                 warmup_s: float, use_perf_analyzer: bool, tick: Callable[[float], None] | None = None) -> dict:
    """Triton direct: ``perf_analyzer`` when present, else our own gRPC client."""
    if use_perf_analyzer:
        return perf_analyzer_level(w, concurrency, servers, _pa_window_ms(duration_s))
    return measure("triton-grpc", w, concurrency, duration_s, warmup_s, servers, sessions, tick=tick)


def ort_ceiling(session, w: Workload, batch_sizes: tuple[int, ...] = CEILING_BATCH_SIZES,
                duration_s: float = 2.0) -> dict:
    """ONNX Runtime's in-process batched ceiling: for each batch size, back-to-back ``session.run`` on real samples
    concatenated to that batch for ``duration_s``; items/s and the p50 per run. ``best`` is the highest items/s."""
    rows = []
    names = list(w.arrays[0])
    for b in batch_sizes:
        feeds = [{k: np.concatenate([w.arrays[(j * b + i) % len(w.arrays)][k] for i in range(b)]) for k in names}
                 for j in range(4)]
        session.run(None, feeds[0])  # warm-up (allocations for this shape)
        lat, t_end, j = [], time.perf_counter() + duration_s, 0
        start = time.perf_counter()
        while (t0 := time.perf_counter()) < t_end:
            session.run(None, feeds[j % len(feeds)])
            lat.append((time.perf_counter() - t0) * 1e3)
            j += 1
        elapsed = time.perf_counter() - start
        rows.append({"batch": b, "runs": len(lat), "items_per_s": b * len(lat) / elapsed,
                     "p50_ms": float(np.percentile(lat, 50))})
    best = max(rows, key=lambda r: r["items_per_s"])
    return {"model": w.model, "input": w.label, "rows": rows, "best": best}


# ----------------------------------------------------------------------------------------------- the benchmark


def _client_for(path: str, w: Workload, servers: Servers, sessions: dict) -> Callable[[], Client]:
    if path == "onnxruntime":
        return ort_client(sessions[w.model], w)
    if path == "triton-http":
        return triton_http_client(servers.triton_http, w)
    if path == "triton-grpc":
        return triton_grpc_client(servers.triton_grpc, w)
    if servers.gateway is None:
        raise BenchError("no gateway to measure")
    return gateway_client(servers.gateway, w)


def measure(path: str, w: Workload, concurrency: int, duration_s: float, warmup_s: float, servers: Servers | None,
            sessions: dict, stats_url: str | None = None, tick: Callable[[float], None] | None = None) -> dict:
    """One (path, concurrency) cell: client latencies + throughput, and Triton's split when a server is involved."""
    make = _client_for(path, w, servers, sessions)  # type: ignore[arg-type]
    stats_url = stats_url or (servers.triton_http if servers is not None and path != "onnxruntime" else None)
    snap: dict[str, dict | None] = {}

    def before() -> None:
        if stats_url:
            snap["before"] = triton_stats(stats_url, w.model)

    res = closed_loop(make, concurrency, duration_s, warmup_s, before, tick)
    server = stats_delta(snap.get("before"), triton_stats(stats_url, w.model)) if stats_url else None
    n = len(res.latencies_ms)
    return {"workload": w.key, "model": w.model, "input": w.label, "path": path, "concurrency": concurrency,
            "duration_s": res.elapsed_s, "requests": n, "errors": len(res.errors),
            "error_samples": list(dict.fromkeys(res.errors))[:MAX_ERROR_SAMPLES],
            "throughput_rps": n / res.elapsed_s if res.elapsed_s > 0 else 0.0,
            "latency_ms": latency_summary(res.latencies_ms), "server": server}


def _add_gateway_share(runs: list[dict], gateway_protocol: str = "grpc") -> None:
    """Gateway latency minus Triton-direct latency at the same workload and concurrency (p50 and mean).

    Triton-direct is the gateway's own protocol to Triton where measured, else the other one.
    """
    own = _direct_path(gateway_protocol)
    other = "triton-grpc" if own == "triton-http" else "triton-http"
    direct: dict[tuple[str, int], dict] = {}
    for path in (other, own):  # its own protocol, updated last, wins where both were measured
        direct.update({(r["workload"], r["concurrency"]): r for r in runs if r["path"] == path and r["requests"]})
    for r in runs:
        d = direct.get((r["workload"], r["concurrency"]))
        if r["path"] == "gateway" and d is not None:
            r["gateway_share_ms"] = {"vs": d["path"], "p50": r["latency_ms"]["p50"] - d["latency_ms"]["p50"],
                                     "mean": r["latency_ms"]["mean"] - d["latency_ms"]["mean"]}


def targets(payload: dict) -> list[dict]:
    """The issue's targets, measured vs target (``met`` is None when this run could not measure one)."""
    runs = payload["runs"]
    first = next(iter(payload["config"]["workloads"]))  # the classifier's single-sample requests
    what = payload["config"]["workloads"][first]

    def cell(path: str, c: int = 1) -> dict | None:
        return next((r for r in runs if r["workload"] == first and r["path"] == path and r["concurrency"] == c),
                    None)

    out = []
    gw, ort_ = cell("gateway"), cell("onnxruntime")
    over = gw["latency_ms"]["p50"] - ort_["latency_ms"]["p50"] if gw and ort_ else None
    out.append({"target": f"gateway + Triton adds ≤ {TARGET_OVERHEAD_MS:g} ms p50 over in-process ONNX Runtime "
                          f"(one {what['input']} for {what['model']}, concurrency 1)",
                "measured": None if over is None else f"{over:+.2f} ms (gateway p50 {gw['latency_ms']['p50']:.2f} ms, "
                                                      f"ONNX Runtime p50 {ort_['latency_ms']['p50']:.2f} ms)",
                "value": over, "met": None if over is None else over <= TARGET_OVERHEAD_MS})
    b = payload.get("batching")
    sp = b.get("speedup") if b else None
    out.append({"target": f"dynamic batching ≥ {TARGET_BATCHING_SPEEDUP:g}× the throughput of no batching "
                          f"(concurrency {b['concurrency'] if b else '-'})",
                "measured": None if sp is None else f"{sp:.2f}× ({b['on']['throughput_rps']:.0f} vs "
                                                    f"{b['off']['throughput_rps']:.0f} req/s)",
                "value": sp, "met": None if sp is None else sp >= TARGET_BATCHING_SPEEDUP})
    out += _direct_targets(payload)
    all_runs = runs + _batching_runs(b)
    n_err = sum(r["errors"] for r in all_runs)
    bad = sorted({f"{r['workload']} {r['path']} c={r['concurrency']}" for r in all_runs if r["errors"]})
    out.append({"target": "zero errors at every level", "value": n_err, "met": n_err == 0,
                "measured": f"{n_err} errors" + (f" ({', '.join(bad[:6])})" if bad else "")})
    return out


def _floor_note(pa_: dict) -> str:
    """"; floor …": the do-nothing Python-backend model's p50 at concurrency 1, when it was measured."""
    f = pa_.get("floor")
    if not f:
        return ""
    return (f"; a do-nothing Python-backend model on the same tritonserver build: p50 {f['latency_ms']['p50']:.2f} "
            f"ms, so the floor for this target is ONNX Runtime + {f['latency_ms']['p50']:.2f} ms")


def _direct_targets(payload: dict) -> list[dict]:
    """Triton direct (perf_analyzer) vs in-process ONNX Runtime: latency at concurrency 1, and throughput at the
    batching level (its own level, else the batching comparison's "on" side when perf_analyzer measured it) vs
    the batched ceiling. Empty for results from before perf_analyzer was part of the benchmark."""
    pa_ = payload.get("perf_analyzer")
    if pa_ is None:  # results from before perf_analyzer was part of the benchmark
        return []
    first = next(iter(payload["config"]["workloads"]))
    what = payload["config"]["workloads"][first]
    ceiling = payload.get("ort_ceiling") or {}
    best = ceiling.get("best")
    ort1 = next((r for r in payload["runs"] if r["workload"] == first and r["path"] == "onnxruntime"
                 and r["concurrency"] == 1), None)
    ort_p50 = ort1["latency_ms"]["p50"] if ort1 else next(
        (r["p50_ms"] for r in ceiling.get("rows", []) if r["batch"] == 1), None)
    pa_runs = {r["concurrency"]: r for r in pa_["runs"] if r["workload"] == first}
    why = pa_.get("missing") or "not measured"
    out = []
    d1 = pa_runs.get(1)
    over = d1["latency_ms"]["p50"] - ort_p50 if d1 and ort_p50 is not None else None
    out.append({"target": f"Triton direct (perf_analyzer) ≤ in-process ONNX Runtime + {TARGET_DIRECT_OVERHEAD_MS:g} ms "
                          f"p50 (one {what['input']} for {what['model']}, concurrency 1)",
                "measured": why if over is None else f"{over:+.2f} ms (Triton direct p50 {d1['latency_ms']['p50']:.2f} "
                                                     f"ms, ONNX Runtime p50 {ort_p50:.2f} ms{_floor_note(pa_)})",
                "value": over, "met": None if over is None else over <= TARGET_DIRECT_OVERHEAD_MS})
    b = payload.get("batching") or {}
    c = b.get("concurrency", max(PERF_ANALYZER_CONCURRENCY))
    dc = pa_runs.get(c) or (b.get("on") if b.get("path") == "perf-analyzer" else None)
    share = dc["throughput_rps"] / best["items_per_s"] if dc and best else None
    out.append({"target": f"Triton direct at concurrency {c} ≥ {TARGET_CEILING_SHARE:.0%} of ONNX Runtime's in-process "
                          f"batched ceiling ({ceiling.get('threads', '-')} threads, best batch size)",
                "measured": (why if dc is None else "no ceiling measured") if share is None else
                f"{share:.0%} ({dc['throughput_rps']:.0f} vs {best['items_per_s']:.0f}/s at batch {best['batch']})",
                "value": share, "met": None if share is None else share >= TARGET_CEILING_SHARE})
    return out


def _workloads(onnx_dir: Path, served: Served, concurrency: tuple[int, ...], denoise_sizes: tuple[int, ...],
               denoise_concurrency: tuple[int, ...], paths: tuple[str, ...], classify_samples: int) -> list[Workload]:
    """The classifier's workload first (targets and the batching comparison use it), then one per denoiser size."""
    card = exported_card(served.classifier, onnx_dir)
    classify = classify_workload(served.classifier, classify_samples, card.lam.default if card.lam else None)
    classify.concurrency, classify.paths = tuple(concurrency), tuple(paths)
    out = [classify]
    for size in denoise_sizes:
        w = denoise_workload(served.denoiser, size)
        w.concurrency, w.paths = tuple(denoise_concurrency), tuple(p for p in paths if p in DENOISE_PATHS)
        out.append(w)
    return out


def run(concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY, duration_s: float = 5.0, warmup_s: float = 0.5,
        denoise_sizes: tuple[int, ...] = DEFAULT_DENOISE_SIZES,
        denoise_concurrency: tuple[int, ...] = DEFAULT_DENOISE_CONCURRENCY, batching_concurrency: int = 16,
        batching_rounds: int = 3, paths: tuple[str, ...] = PATHS, url: str | None = None,
        triton_url: str | None = None,
        triton_grpc_url: str | None = None, onnx_dir: Path = artifacts.ONNX_DIR, threads: int = 2,
        classify_samples: int = CLASSIFY_SAMPLES, progress: bool = True, out_dir: Path | None = None,
        log: Callable[[str], None] = print,
        perf_analyzer_concurrency: tuple[int, ...] = PERF_ANALYZER_CONCURRENCY,
        compare_queue_delays_us: tuple[int, ...] = COMPARE_QUEUE_DELAYS_US,
        ceiling_batch_sizes: tuple[int, ...] = CEILING_BATCH_SIZES) -> dict:
    """Start (or attach to) Triton and the gateway, sweep every workload × path × concurrency; write results.

    ``url`` attaches to a running gateway (then ``triton_url``, the Triton behind it, is required);
    ``triton_url`` (HTTP ``host:port``) attaches to a running Triton (gRPC: ``triton_grpc_url``, by
    default the HTTP port + 1). The no-batching comparison always starts its own Triton.

    Triton direct is also measured with ``perf_analyzer`` (Triton's own client, :mod:`unroll.benchmarks.
    perf_analyzer`) when it is set up, at ``perf_analyzer_concurrency`` for the classifier and the denoiser
    concurrency for each image size; it then also drives the batching on/off rounds and the queue-delay
    comparison (a Triton per delay in ``compare_queue_delays_us``, against the repository default). When it is
    missing, the results say so with the set-up command and those use the Python gRPC client.
    ONNX Runtime's in-process batched ceiling (``ceiling_batch_sizes``) is measured on the classifier.
    """
    if batching_rounds < 1:
        raise BenchError(f"batching rounds must be ≥ 1, not {batching_rounds}")
    bad = [p for p in paths if p not in PATHS]
    if bad:
        raise BenchError(f"unknown path(s) {bad}; choose from {', '.join(PATHS)}")
    if url is not None and triton_url is None:
        raise BenchError("--url needs --triton-url: the Triton behind that gateway (for Triton-direct and its "
                         "statistics)")
    onnx_dir = Path(onnx_dir)
    from unroll.benchmarks import perf_analyzer as pa
    from unroll.serving.repository import DEFAULT_QUEUE_DELAY_US, INTRA_OP_SPINNING

    pa_binary = pa.find()
    payload: dict = {"benchmark": "serve", "machine": machine_info(threads),
                     "perf_analyzer": {"available": pa_binary is not None,
                                       "missing": None if pa_binary else pa.missing_reason(), "runs": []}}
    runs: list[dict] = []
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="unroll-bench-serve-")))
        served = served_models()
        log(f"writing Triton repositories from {onnx_dir}")
        repo_on, repo_off = write_repositories(onnx_dir, tmp, served)
        classify_input = exported_card(served.classifier, onnx_dir).input.name
        delays = [d for d in dict.fromkeys(compare_queue_delays_us) if d != DEFAULT_QUEUE_DELAY_US]
        repo_delays = {d: write_delay_repository(onnx_dir, tmp / f"delay-{d}", served, d) for d in delays}
        workloads = _workloads(onnx_dir, served, concurrency, denoise_sizes, denoise_concurrency, paths,
                               classify_samples)
        cells = [(w, p, c) for w in workloads for p in w.paths for c in w.concurrency]
        payload["config"] = {
            "duration_s": duration_s, "warmup_s": warmup_s, "threads": threads, "spinning": INTRA_OP_SPINNING,
            "workloads": {w.key: {"model": w.model, "input": w.label, "paths": list(w.paths),
                                  "concurrency": list(w.concurrency)} for w in workloads},
            "batching_concurrency": batching_concurrency,
            "client": "closed loop, one thread (and client) per in-flight request, on the same machine"}
        if triton_url is None:
            log("starting Triton (batching repository)")
            http_url, grpc_url = stack.enter_context(triton_server(repo_on, tmp / "triton.log"))
            servers = Servers(http_url, grpc_url, None, started_triton=True)
        else:
            host, port = triton_url.rsplit(":", 1)
            servers = Servers(triton_url, triton_grpc_url or f"{host}:{int(port) + 1}", None)
            _wait_ready(f"http://{triton_url}/v2/health/ready", 10)
            _check_grpc(servers.triton_grpc)
        if "gateway" in paths:
            if url is None:
                log("starting the gateway")
                from unroll.serving.gateway.process import GatewayStartError, gateway_process
                from unroll.serving.gateway.settings import Settings

                settings = Settings(triton_url=servers.triton_grpc, triton_protocol="grpc")
                try:
                    servers.gateway = stack.enter_context(gateway_process(settings, tmp / "gw.log"))
                except GatewayStartError as e:
                    raise BenchError(str(e)) from None
                servers.started_gateway = True
            else:
                servers.gateway = url.rstrip("/")
                servers.gateway_protocol = "unknown (attached)"
                _wait_ready(servers.gateway + "/readyz", 10)
        sessions = {m: ort_session(artifacts.graph(m, onnx_dir=onnx_dir), threads, spinning=INTRA_OP_SPINNING)
                    for m in (served.classifier, served.denoiser)}
        payload["servers"] = {"triton_http": servers.triton_http, "triton_grpc": servers.triton_grpc,
                              "gateway": servers.gateway, "started_triton": servers.started_triton,
                              "started_gateway": servers.started_gateway,
                              "gateway_triton_protocol": servers.gateway_protocol,
                              "config": {m: triton_config(servers.triton_http, m) for m in served.triton_models}}
        with progress_bars(progress) as bars:
            total = bars.add_task("serve sweep", total=len(cells) + 4, info="")
            level = bars.add_task("level", total=duration_s, info="")
            for w, p, c in cells:
                bars.update(level, description=f"{w.key} {p} c={c}", completed=0, info="")
                r = measure(p, w, c, duration_s, warmup_s, servers, sessions,
                            tick=lambda t: bars.update(level, completed=min(t, duration_s)))
                bars.update(level, info=f"{r['throughput_rps']:.1f} req/s, p50 {r['latency_ms']['p50']:.1f} ms"
                                        + (f", {r['errors']} errors" if r["errors"] else ""))
                runs.append(r)
                bars.advance(total)
            classify = workloads[0]
            bars.update(level, description="ONNX Runtime batched ceiling", completed=0, info="")
            payload["ort_ceiling"] = ort_ceiling(sessions[served.classifier], classify, tuple(ceiling_batch_sizes))
            payload["ort_ceiling"]["threads"] = threads
            bars.advance(total)
            if pa_binary is not None:
                for w in workloads:
                    for c in (perf_analyzer_concurrency if w is classify else w.concurrency):
                        bars.update(level, description=f"{w.key} perf_analyzer c={c}", completed=0, info="")
                        payload["perf_analyzer"]["runs"].append(perf_analyzer_level(
                            w, c, servers, _pa_window_ms(duration_s)))
            bars.advance(total)
            use_pa = pa_binary is not None
            # dynamic batching on (the main server) vs off (its own server), the classifier over gRPC,
            # interleaved rounds so that drifting load hits both alike
            bars.update(level, description="starting Triton without batching", completed=0, info="")
            rounds = []
            with triton_server(repo_off, tmp / "triton-off.log") as (off_http, off_grpc):
                off_servers = Servers(off_http, off_grpc, None)
                off_cfg = triton_config(off_http, served.classifier)
                if use_pa:  # the Python backend's floor: a do-nothing model, same inputs, concurrency 1
                    bars.update(level, description="perf_analyzer: Python-backend floor c=1", completed=0, info="")
                    floor = Workload("floor", FLOOR_MODEL, classify.label,
                                     [{"x": a[classify_input]} for a in classify.arrays], [], "", "y")
                    payload["perf_analyzer"]["floor"] = perf_analyzer_level(
                        floor, 1, off_servers, _pa_window_ms(duration_s))
                for k in range(batching_rounds):
                    pair = {}
                    for tag, srv in (("on", servers), ("off", off_servers)):
                        bars.update(level, description=f"batching {tag}, c={batching_concurrency} "
                                                       f"(round {k + 1}/{batching_rounds})", completed=0)
                        pair[tag] = direct_level(
                            classify, batching_concurrency, srv, sessions, duration_s, warmup_s, use_pa,
                            tick=lambda t: bars.update(level, completed=min(t, duration_s)))
                    off_rps = pair["off"]["throughput_rps"]
                    pair["speedup"] = pair["on"]["throughput_rps"] / off_rps if off_rps else None
                    rounds.append(pair)
            bars.advance(total, 2)
            # the default queue delay vs the others, at concurrency 1 and the batching level
            levels = sorted({1, batching_concurrency})
            qd = {DEFAULT_QUEUE_DELAY_US: {c: direct_level(classify, c, servers, sessions, duration_s, warmup_s, use_pa)
                                           for c in levels}}
            for d, repo in repo_delays.items():
                bars.update(level, description=f"starting Triton with queue delay {d} µs", completed=0, info="")
                with triton_server(repo, tmp / f"triton-delay-{d}.log") as (d_http, d_grpc):
                    qd[d] = {c: direct_level(classify, c, Servers(d_http, d_grpc, None), sessions, duration_s,
                                             warmup_s, use_pa) for c in levels}
            payload["queue_delay"] = {"default_us": DEFAULT_QUEUE_DELAY_US, "model": served.classifier,
                                      "client": "perf_analyzer" if use_pa else "python gRPC", "concurrency": levels,
                                      "rows": [{"delay_us": d, "concurrency": c, **{k: r[k] for k in (
                                          "throughput_rps", "latency_ms", "server")}}
                                               for d, by_c in qd.items() for c, r in by_c.items()]}
    _add_gateway_share(runs, servers.gateway_protocol)
    payload["runs"] = runs
    median = _median_round(rounds)
    payload["batching"] = {"concurrency": batching_concurrency, "model": served.classifier,
                           "path": "perf-analyzer" if use_pa else "triton-grpc",
                           "on": median["on"], "off": median["off"], "speedup": median["speedup"],
                           "rounds": rounds, "speedups": [r["speedup"] for r in rounds],
                           "config_on": payload["servers"]["config"].get(served.classifier, {}),
                           "config_off": off_cfg}
    payload["targets"] = targets(payload)
    if out_dir is not None:
        write(payload, Path(out_dir))
    return payload


def _batching_runs(b: dict | None) -> list[dict]:
    """Every measured level of the batching comparison (each round's on and off)."""
    return [r[tag] for r in b["rounds"] for tag in ("on", "off")] if b else []


def _median_round(rounds: list[dict]) -> dict:
    """The round whose on/off ratio is the median (lower median for an even count; failed ratios last)."""
    ranked = sorted(rounds, key=lambda r: (r["speedup"] is None, r["speedup"] or 0.0))
    valid = [r for r in ranked if r["speedup"] is not None] or ranked
    return valid[(len(valid) - 1) // 2]


def write(payload: dict, out_dir: Path) -> list[Path]:
    """``serve.json``, ``serve.md`` and the three PNG plots."""
    from unroll.benchmarks import plots

    paths = list(write_results("serve", payload, markdown(payload), out_dir))
    paths += plots.serve_plots(payload, out_dir)
    return paths


# ----------------------------------------------------------------------------------------------- Markdown


def _f(x: float | None, d: int = 2) -> str:
    return "-" if x is None or x != x else f"{x:.{d}f}"


def _batching(cfg: dict) -> str:
    db = cfg.get("dynamic_batching")
    if db is None:
        return f"max_batch_size {cfg.get('max_batch_size', '-')}, no dynamic batching"
    return (f"max_batch_size {cfg.get('max_batch_size', '-')}, dynamic batching (max queue delay "
            f"{int(db.get('max_queue_delay_microseconds', 0))} µs)")


def _direct_path(gateway_protocol: str) -> str:
    """The Triton-direct path the gateway's share is measured against: its own protocol to Triton."""
    return "triton-http" if gateway_protocol == "http" else "triton-grpc"


def _direct_markdown(payload: dict) -> list[str]:
    """Triton direct from perf_analyzer (or why not), ONNX Runtime's batched ceiling, the queue-delay comparison."""
    pa_ = payload.get("perf_analyzer")
    if pa_ is None:
        return []
    lines = ["", "## Triton direct, measured by perf_analyzer (gRPC, real inputs)", ""]
    if not pa_.get("available"):
        lines.append(f"Not measured: {pa_.get('missing')}.")
    else:
        lines += ["Triton's own client (`perf_analyzer` from tritonclient 2.47.0, synchronous requests, "
                  "`--input-data` from the same real samples). Latency in ms from the client; the server split "
                  "is perf_analyzer's (Triton's statistics over its measurement windows); batch = average batch "
                  "Triton formed over the run. † = no stable measurement (perf_analyzer's stability demand dropped). "
                  f"`{FLOOR_MODEL}`: a do-nothing Python-backend model (output = input, zero-copy) with the "
                  "classifier's input, on the no-batching server: Triton + gRPC + the Python backend's own cost.",
                  "", "| model | input | conc. | req/s | p50 | p90 | p95 | p99 | queue | in | infer | out | batch |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in pa_["runs"] + ([pa_["floor"]] if pa_.get("floor") else []):
            L, sv = r["latency_ms"], r["server"]
            lines.append(f"| {r['model']} | {r['input']} | {r['concurrency']}{'' if r.get('stable', True) else '†'} "
                         f"| {_f(r['throughput_rps'], 1)} | {_f(L['p50'])} | {_f(L['p90'])} | {_f(L['p95'])} | "
                         f"{_f(L['p99'])} | {_f(sv.get('queue_ms'))} | {_f(sv.get('compute_input_ms'))} | "
                         f"{_f(sv.get('compute_infer_ms'))} | {_f(sv.get('compute_output_ms'))} | "
                         f"{_f(sv.get('avg_batch'))} |")
    ceiling = payload.get("ort_ceiling")
    if ceiling:
        lines += ["", f"## ONNX Runtime's in-process batched ceiling ({ceiling['model']}, {ceiling['input']}, "
                      f"{ceiling.get('threads', '-')} threads)", "",
                  "| batch | items/s | p50 per run (ms) |", "|---|---|---|"]
        for r in ceiling["rows"]:
            mark = " (best)" if r["batch"] == ceiling["best"]["batch"] else ""
            lines.append(f"| {r['batch']}{mark} | {_f(r['items_per_s'], 0)} | {_f(r['p50_ms'])} |")
    qd = payload.get("queue_delay")
    if qd:
        lines += ["", f"## Dynamic batching queue delay ({qd['model']}, {qd['client']}; the default is "
                      f"{qd['default_us']} µs, serving/repository.py)", "",
                  "| max queue delay (µs) | conc. | req/s | p50 | p99 | queue | infer | batch |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in qd["rows"]:
            L, sv = r["latency_ms"], r["server"] or {}
            lines.append(f"| {r['delay_us']}{' (default)' if r['delay_us'] == qd['default_us'] else ''} | "
                         f"{r['concurrency']} | {_f(r['throughput_rps'], 1)} | {_f(L['p50'])} | {_f(L['p99'])} | "
                         f"{_f(sv.get('queue_ms'))} | {_f(sv.get('compute_infer_ms'))} | {_f(sv.get('avg_batch'))} |")
    return lines


def markdown(payload: dict) -> str:
    m, cfg, srv = payload["machine"], payload["config"], payload.get("servers", {})
    own = _direct_path(srv.get("gateway_triton_protocol", "grpc"))
    b = payload.get("batching")
    classifier = (b or {}).get("model") or next(iter(cfg["workloads"].values()))["model"]
    gw_cfg = srv.get("config", {}).get(classifier, {})
    lines = [f"# Serving under load ({m['cpu']}, {m['logical_cores']} cores, onnxruntime "
             f"{m['versions'].get('onnxruntime')}, tritonclient {m['versions'].get('tritonclient')})", "",
             f"Closed loop: one client thread per in-flight request, {cfg['duration_s']:g} s per level after "
             f"{cfg['warmup_s']:g} s warm-up, client, gateway and Triton on the same machine. Latency from the "
             "client in ms. Triton split: mean ms per request from its statistics API over the level "
             "(queue, compute input, infer, output); batch = average batch size Triton formed. Gateway share = "
             f"gateway latency − {PATH_LABELS[own]} latency at the same concurrency (p50). "
             f"Triton {classifier}: {_batching(gw_cfg)}; in-process ONNX Runtime uses the same session options "
             f"as Triton's model ({cfg['threads']} threads, "
             f"{'spinning' if cfg.get('spinning') else 'no spinning'}). {load_note(m)}", ""]
    lines += ["## Targets", "", "| target | measured | met |", "|---|---|---|"]
    for t in payload["targets"]:
        met = "n/a" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['target']} | {t['measured'] or 'not measured'} | {met} |")
    for key, w in cfg["workloads"].items():
        rows = [r for r in payload["runs"] if r["workload"] == key]
        if not rows:
            continue
        lines += ["", f"## {w['model']}: {w['input']}", "",
                  "| path | conc. | req/s | p50 | p90 | p95 | p99 | max | errors | queue | in | infer | out | batch "
                  "| gateway share |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            L, s = r["latency_ms"], r["server"] or {}
            gs = r.get("gateway_share_ms", {})
            share = _f(gs.get("p50")) + ("†" if gs.get("vs") not in (None, own) else "")
            lines.append(f"| {PATH_LABELS[r['path']]} | {r['concurrency']} | {_f(r['throughput_rps'], 1)} | "
                         f"{_f(L['p50'])} | {_f(L['p90'])} | {_f(L['p95'])} | {_f(L['p99'])} | {_f(L['max'])} | "
                         f"{r['errors']} | {_f(s.get('queue_ms'))} | {_f(s.get('compute_input_ms'))} | "
                         f"{_f(s.get('compute_infer_ms'))} | {_f(s.get('compute_output_ms'))} | "
                         f"{_f(s.get('avg_batch'))} | {share} |")
        other = {r["gateway_share_ms"]["vs"] for r in rows
                 if r.get("gateway_share_ms", {}).get("vs") not in (None, own)}
        for vs in sorted(other):
            lines += ["", f"† vs {PATH_LABELS[vs]} ({PATH_LABELS[own]} not measured for this input)."]
    lines += _direct_markdown(payload)
    if b:
        client = "perf_analyzer" if b.get("path") == "perf-analyzer" else "Triton gRPC, Python client"
        lines += ["", f"## Dynamic batching on vs off ({classifier}, {client}, concurrency {b['concurrency']})", "",
                  "| Triton config | req/s | p50 | p99 | avg batch | errors |", "|---|---|---|---|---|---|"]
        for tag, r, c in (("on", b["on"], b["config_on"]), ("off", b["off"], b["config_off"])):
            lines.append(f"| {tag}: {_batching(c)} | {_f(r['throughput_rps'], 1)} | {_f(r['latency_ms']['p50'])} | "
                         f"{_f(r['latency_ms']['p99'])} | {_f((r['server'] or {}).get('avg_batch'))} | "
                         f"{r['errors']} |")
        rounds = b["rounds"]
        best = (payload.get("ort_ceiling") or {}).get("best")
        if best and b["off"]["throughput_rps"]:
            ceil = best["items_per_s"]
            lines += ["", f"Against ONNX Runtime's in-process batched ceiling ({_f(ceil, 0)}/s at batch "
                          f"{best['batch']}, same threads): on {b['on']['throughput_rps'] / ceil:.0%}, off "
                          f"{b['off']['throughput_rps'] / ceil:.0%}; the ceiling is "
                          f"{ceil / b['off']['throughput_rps']:.2f}× no batching, the most batching could give."]
        lines += ["", f"Speed-up: {_f(b['speedup'])}× (the median of {len(rounds)} interleaved round(s) of on, off; "
                      "the rows above are that round; every round: "
                      + ", ".join(f"{_f(r['on']['throughput_rps'], 0)} vs {_f(r['off']['throughput_rps'], 0)} req/s "
                                  f"→ {_f(r['speedup'])}×" for r in rounds) + ")."]
    errs = [(r, e) for r in payload["runs"] + _batching_runs(b) for e in r["error_samples"]]
    if errs:
        lines += ["", "## Error samples", ""]
        lines += [f"- {r['workload']} {r['path']} c={r['concurrency']}: `{e}`" for r, e in errs[:20]]
    lines += ["", "Plots: `serve_latency.png` (p50/p99 vs concurrency), `serve_throughput.png`, `serve_split.png` "
              "(per-layer mean ms).", ""]
    return "\n".join(lines)
