"""One load generator for the gateway and Triton's v2 HTTP endpoint alike: ApacheBench (``ab``, C, keep-alive).

The Python clients of :mod:`.serve_load` cost more CPU than the servers they measure once concurrency is high,
and the gateway and Triton direct would otherwise be driven by different clients. ``ab`` sends one request body
over and over on ``-c`` kept-alive connections, so the same client measures ``POST /v1/classify`` with a PNG and
Triton's ``POST /v2/models/M/infer`` with the binary tensor extension (or the encoded image as a ``BYTES`` input).
Its ``-e`` report gives each percentile in fractional milliseconds.
"""

from __future__ import annotations

import csv
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from unroll.benchmarks.processes import cpu_by_pid, cpu_ms_per_request
from unroll.benchmarks.serve_load import Workload, as_batch, image_feeds, image_output
from unroll.benchmarks.serve_triton import get_json
from unroll.errors import BenchError

#: Where ``ab`` comes from (Debian's package).
SETUP = "apt-get install -y apache2-utils"
#: ``-n`` large enough that ``-t`` (the duration) ends the run.
_MANY = 50_000_000


def find() -> str | None:
    return shutil.which("ab")


def missing_reason() -> str:
    return f"ab (ApacheBench) not found; install it with `{SETUP}`"


def triton_body(inputs: dict[str, np.ndarray], outputs: list[str]) -> tuple[bytes, dict[str, str]]:
    """A v2 HTTP inference request, inputs in the binary tensor extension (tritonclient's own encoder), outputs
    asked as JSON: body, headers.

    JSON outputs because a binary answer carries an ``Inference-Header-Content-Length`` header, which ``ab`` takes
    for ``Content-Length`` (it looks for the name as a substring) and then loses its place in any answer longer than
    one read; a classifier's logits are a few numbers either way."""
    import tritonclient.http as th
    from tritonclient.utils import np_to_triton_dtype

    reqs = []
    for name, a in inputs.items():
        i = th.InferInput(name, list(a.shape), np_to_triton_dtype(a.dtype))
        i.set_data_from_numpy(a, binary_data=True)
        reqs.append(i)
    outs = [th.InferRequestedOutput(n, binary_data=False) for n in outputs]
    body, json_size = th.InferenceServerClient.generate_request_body(reqs, outputs=outs)
    headers = {"Inference-Header-Content-Length": str(json_size)} if json_size is not None else {}
    return body, headers


def run(url: str, body: bytes, content_type: str, concurrency: int, duration_s: float,
        headers: dict[str, str] | None = None) -> dict:
    """``ab -k`` POSTing ``body`` to ``url`` for ``duration_s`` (whole seconds, at least 1) at ``concurrency``:
    requests, failures, throughput and latency percentiles (ms)."""
    binary = find()
    if binary is None:
        raise BenchError(missing_reason())
    seconds = max(1, round(duration_s))  # ab's -t takes whole seconds (and 0 would mean no limit)
    with tempfile.TemporaryDirectory(prefix="unroll-ab-") as tmp:
        body_file, report = Path(tmp) / "body", Path(tmp) / "percentiles.csv"
        body_file.write_bytes(body)
        cmd = [binary, "-k", "-q", "-r", "-c", str(concurrency), "-t", str(seconds), "-n", str(_MANY),
               "-p", str(body_file), "-T", content_type, "-e", str(report), "-s", "30"]
        for k, v in (headers or {}).items():
            cmd += ["-H", f"{k}: {v}"]
        try:
            proc = subprocess.run([*cmd, url], capture_output=True, text=True, timeout=seconds + 60)
        except subprocess.TimeoutExpired:
            raise BenchError(f"ab did not finish within {seconds + 60} s: {' '.join([*cmd, url])}") from None
        if proc.returncode != 0 or not report.exists():
            raise BenchError(f"ab failed ({proc.returncode}) on {url}: {(proc.stderr or proc.stdout).strip()[-400:]}")
        with report.open() as f:
            pct = {int(float(r["Percentage served"])): float(r["Time in ms"]) for r in csv.DictReader(f)}
    out = proc.stdout

    def num(label: str, default: float = 0.0) -> float:
        m = re.search(rf"^{label}:\s+([\d.]+)", out, re.M)
        return float(m.group(1)) if m else default

    # ab counts an answer whose length differs from the first one's as failed ("Length"): the gateway's JSON
    # carries its latency, so lengths vary; only connection, receive and exception failures and non-2xx count.
    kinds = re.search(r"\(Connect: (\d+), Receive: (\d+), Length: (\d+), Exceptions: (\d+)\)", out)
    broken = sum(int(kinds.group(i)) for i in (1, 2, 4)) if kinds else int(num("Failed requests"))
    return {"requests": int(num("Complete requests")), "failed": broken + int(num("Non-2xx responses")),
            "keep_alive": int(num("Keep-Alive requests")), "throughput_rps": num("Requests per second"),
            "latency_ms": {"p50": pct.get(50, float("nan")), "p90": pct.get(90, float("nan")),
                           "p95": pct.get(95, float("nan")), "p99": pct.get(99, float("nan")),
                           "max": pct.get(100, float("nan"))},
            "command": " ".join([*cmd, url])}


#: The issue-24 comparisons: the classifier at these concurrency levels (a denoised image is a long binary
#: answer, which ab cannot follow on a kept-alive connection to Triton: see :func:`triton_body`).
AB_CONCURRENCY = (1, 32)
#: Paths ``ab`` drives (row labels).
AB_PATHS = {"gateway": "gateway (PNG)", "triton-tensor": "Triton HTTP (tensors)",
            "triton-image": "Triton HTTP (PNG bytes)"}


def accepts_image_bytes(triton_http: str, model: str) -> bool:
    """Whether Triton's ``model`` takes an encoded image (:data:`unroll.serving.imaging.wire.IMAGE_BYTES`)."""
    from unroll.serving.imaging.wire import IMAGE_BYTES

    try:
        meta = get_json(f"http://{triton_http}/v2/models/{model}")
    except (OSError, ValueError):
        return False
    return any(i.get("name") == IMAGE_BYTES for i in meta.get("inputs", []))


def _targets(w: Workload, triton_http: str, gateway: str | None) -> list[tuple[str, str, bytes, str, dict]]:
    """(path, url, body, content type, headers) for each way ``ab`` can send ``w``'s first sample."""
    infer = f"http://{triton_http}/v2/models/{w.model}/infer"
    tensors = {k: as_batch(v) for k, v in w.arrays[0].items()}
    out = []
    if gateway is not None:
        out.append(("gateway", gateway + w.gateway_path, w.images[0], "image/png", {}))
    body, headers = triton_body(tensors, [w.output])
    out.append(("triton-tensor", infer, body, "application/octet-stream", headers))
    if accepts_image_bytes(triton_http, w.model):
        body, headers = triton_body(image_feeds(w)[0], [image_output(w)])
        out.append(("triton-image", infer, body, "application/octet-stream", headers))
    return out


def runs(workloads: list[Workload], triton_http: str, gateway: str | None, duration_s: float,
         concurrency: tuple[int, ...] = AB_CONCURRENCY, show: Callable[[str], None] = lambda text: None) -> dict:
    """``ab`` over the gateway and Triton's HTTP endpoint (tensors, and the PNG itself where the model takes it) for
    the classifier (the first workload) at ``concurrency``; CPU ms per request by process (``ab``'s own from this
    process's children's rusage)."""
    import resource

    if find() is None:
        return {"available": False, "missing": missing_reason(), "runs": []}
    w, rows = workloads[0], []
    for c in concurrency:
        for path, url, body, ctype, headers in _targets(w, triton_http, gateway):
            show(f"ab {w.key} {path} c={c}")
            run(url, body, ctype, c, 1, headers)  # warm-up
            before, kids = cpu_by_pid(), resource.getrusage(resource.RUSAGE_CHILDREN)
            r = run(url, body, ctype, c, duration_s, headers)
            after, kids_after = cpu_by_pid(), resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = cpu_ms_per_request(before, after, r["requests"])
            if cpu is not None:
                spent = (kids_after.ru_utime + kids_after.ru_stime) - (kids.ru_utime + kids.ru_stime)
                cpu["client"] = spent * 1e3 / r["requests"]
            rows.append({"workload": w.key, "model": w.model, "input": w.label, "path": path, "concurrency": c,
                         "body_bytes": len(body), **r, "cpu_ms_per_request": cpu})
    return {"available": True, "runs": rows}
