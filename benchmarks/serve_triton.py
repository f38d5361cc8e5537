"""The servers ``unroll bench serve`` measures: the Triton repositories it writes (batching on and off, other queue
delays, the Python-backend floor model), tritonservers started on them, and Triton's own statistics."""

from __future__ import annotations

import contextlib
import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from unroll import artifacts, pipeline
from unroll.benchmarks.serve_load import Served
from unroll.errors import BenchError, GatewayStartError, TritonStartError
from unroll.serving.gateway.process import wait_ready
from unroll.serving.repository import write_repository
from unroll.serving.repository_check import validate_model
from unroll.serving.triton import free_ports, start

STAT_KEYS = ("queue", "compute_input", "compute_infer", "compute_output")


def get_json(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def triton_stats(http_url: str, model: str) -> dict | None:
    """Triton's cumulative statistics for ``model`` (``None`` when they cannot be read)."""
    try:
        return get_json(f"http://{http_url}/v2/models/{model}/stats")["model_stats"][0]
    except (OSError, ValueError, KeyError, IndexError):
        return None


def triton_config(http_url: str, model: str) -> dict:
    """The batching part of a served model's config (max_batch_size, dynamic_batching)."""
    try:
        cfg = get_json(f"http://{http_url}/v2/models/{model}/config")
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


@dataclass
class Servers:
    """Where Triton (HTTP + gRPC) and the gateway listen, and whether this run started them."""

    triton_http: str
    triton_grpc: str
    gateway: str | None
    started_triton: bool = False
    started_gateway: bool = False
    gateway_protocol: str = "grpc"


def wait_attached(url: str, timeout_s: float) -> None:
    """An attached server must answer 200 on ``url`` (a health endpoint) within ``timeout_s``."""
    try:
        wait_ready(url, timeout_s)
    except GatewayStartError as e:
        raise BenchError(str(e)) from None


def check_grpc(url: str) -> None:
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

    # export what is missing or stale (registered models; companions come along)
    pipeline.run(pipeline.plan([served.classifier, served.denoiser], onnx_dir=onnx_dir))
    on, off = root / "batching", root / "no-batching"
    write_repository("cpu", list(served.triton_models), on, onnx_dir=onnx_dir)
    write_repository("cpu", [served.classifier], off, onnx_dir=onnx_dir, max_batch_size=1)
    path = artifacts.model_config(off / served.classifier)
    text = path.read_text()
    header = "".join(ln + "\n" for ln in text.splitlines() if ln.startswith("#"))
    cfg = text_format.Parse(text, mc.ModelConfig())
    cfg.ClearField("dynamic_batching")
    path.write_text(header + "# unroll bench serve: dynamic batching removed (max_batch_size 1, default scheduler).\n"
                    + text_format.MessageToString(cfg))
    validate_model(off / served.classifier, reference_onnx=artifacts.graph(served.classifier, onnx_dir=onnx_dir))
    write_floor_model(off, artifacts.model_config(on / served.classifier))
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
    artifacts.model_config(repo / FLOOR_MODEL).write_text(text_format.MessageToString(cfg))
    (repo / FLOOR_MODEL / "1" / "model.py").write_text(_FLOOR_PY)


def write_delay_repository(onnx_dir: Path, root: Path, served: Served, queue_delay_us: int) -> Path:
    """The classifier alone, batching as the project default except ``max_queue_delay_microseconds``."""
    write_repository("cpu", [served.classifier], root, onnx_dir=onnx_dir, queue_delay_us=queue_delay_us)
    return root


@contextlib.contextmanager
def triton_server(repo: Path, log: Path, load: list[str] | None = None) -> Iterator[tuple[str, str]]:
    """A tritonserver on free ports; yields (HTTP url, gRPC url) and always stops it. ``load``: explicit model
    control with these models loaded (others can be loaded, or reloaded with a new config, through its API)."""
    control = {"model_control": "explicit"} if load is not None else {}
    args = ["--exit-timeout-secs=2", *(f"--load-model={m}" for m in load or [])]
    try:
        handle = start(repo, *free_ports(3), log_file=log, timeout_s=300, extra_args=args, **control)
    except TritonStartError as e:
        raise BenchError(f"could not start Triton: {e.reason} (log: {log})") from None
    try:
        yield handle.url, handle.grpc_url
    finally:
        handle.stop()
