"""perf_analyzer (Triton's own client) against the bundled Triton, on real inputs; the backend's clean log.

perf_analyzer comes from ``scripts/perf_analyzer_setup.sh`` (its own virtualenv: tritonclient 2.47.0 pins
numpy < 2). The session fixture runs that script when the tool is missing (idempotent; about 40 s with a
reachable package index) and skips these tests with the script's one-line reason when it cannot set it up.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient

from unroll.benchmarks import perf_analyzer as pa
from unroll.benchmarks.serve_bench import classify_workload, denoise_workload, triton_stats
from unroll.card import from_onnx
from unroll.serving import triton
from unroll.serving.imaging.wire import IMAGE_INFO, info_json

CLASSIFIER, DENOISER = "sdnet-mnist", "csc-denoiser"
SETUP_TIMEOUT_S = 240


@pytest.fixture(scope="session")
def perf_analyzer() -> Path:
    found = pa.find()
    if found is not None:
        return found
    try:
        p = subprocess.run(["bash", str(pa.ROOT / "scripts" / "perf_analyzer_setup.sh")], capture_output=True,
                           text=True, timeout=SETUP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.skip(f"perf_analyzer set-up took over {SETUP_TIMEOUT_S} s; run `{pa.SETUP}`")
    found = pa.find()
    if p.returncode != 0 or found is None:
        why = (p.stderr.strip().splitlines() or ["no message"])[-1]
        pytest.skip(f"perf_analyzer is not set up ({why}); run `{pa.SETUP}`")
    return found


@pytest.fixture(scope="module")
def server(demo_triton: triton.TritonHandle) -> triton.TritonHandle:
    """The session's tritonserver (the demo models): perf_analyzer only sends it requests; counts and the log are
    read from where they stood before."""
    return demo_triton


def _digits(onnx_dir: Path, n: int = 8) -> list[dict[str, np.ndarray]]:
    """Real test digits (the card's test split) with the card's λ, one per request."""
    card = from_onnx(onnx_dir / f"{CLASSIFIER}.onnx")
    return classify_workload(CLASSIFIER, n, card.lam.default).arrays


def test_input_data_json_layout() -> None:
    feeds = [{"image": np.arange(4, dtype=np.float32).reshape(1, 1, 2, 2), "lam": np.array([0.5], np.float32)}]
    assert pa.input_data(feeds) == {"data": [{"image": {"content": [0.0, 1.0, 2.0, 3.0], "shape": [1, 2, 2]},
                                              "lam": {"content": [0.5], "shape": [1]}}]}
    assert pa.input_data(feeds, batching=False)["data"][0]["image"]["shape"] == [1, 1, 2, 2]
    with pytest.raises(ValueError, match="batch 1"):
        pa.input_data([{"image": np.zeros((2, 1, 2, 2), np.float32)}])


def test_parse_csv_rejects_what_is_not_a_latency_report() -> None:
    with pytest.raises(ValueError, match="no rows"):
        pa.parse_csv("Concurrency,Inferences/Second\n")
    with pytest.raises(ValueError, match="lacks"):
        pa.parse_csv("Concurrency,Inferences/Second,p50 latency\n1,100,900\n")


def test_missing_tool_is_reported_with_the_setup_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(pa.ENV_VAR, str(tmp_path / "nope"))
    assert pa.find() is None
    with pytest.raises(pa.PerfAnalyzerError, match="perf_analyzer_setup.sh"):
        pa.measure(CLASSIFIER, "127.0.0.1:9", [], 1)


@pytest.mark.triton
@pytest.mark.slow
def test_real_digits_through_perf_analyzer(perf_analyzer: Path, server, demo_onnx_dir: Path) -> None:
    """perf_analyzer accepts the JSON built from real digits, Triton serves every request, and the CSV parser reads
    its report (client percentiles and the server's per-stage split) consistently with Triton's own statistics."""
    feeds = _digits(demo_onnx_dir)
    before = triton_stats(server.url, CLASSIFIER)
    row = pa.measure(CLASSIFIER, server.grpc_url, feeds, 2, window_ms=500, max_trials=4, binary=perf_analyzer)
    after = triton_stats(server.url, CLASSIFIER)
    served = after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"]
    failed = after["inference_stats"]["fail"]["count"] - before["inference_stats"]["fail"]["count"]
    assert failed == 0 and served > 0
    assert row["concurrency"] == 2 and row["throughput_rps"] > 0
    lat = row["latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p95"] <= lat["p99"]
    assert set(row["server"]) == set(pa.SERVER_COLUMNS.values()) and all(v >= 0 for v in row["server"].values())
    assert row["server"]["compute_infer_ms"] > 0  # the model ran: inference is never free
    assert "--input-data input.json" in row["command"] and "-i grpc" in row["command"]


@pytest.mark.triton
@pytest.mark.slow
def test_perf_analyzer_validates_outputs_against_onnx_runtime(perf_analyzer: Path, server, demo_onnx_dir: Path,
                                                              tmp_path: Path) -> None:
    """With ``validation_data`` (ONNX Runtime's logits for the same real digits) perf_analyzer checks every
    response: the inputs it sends are the digits we gave it, not placeholders. A wrong expected output fails."""
    feeds = _digits(demo_onnx_dir, 4)
    sess = ort.InferenceSession(str(demo_onnx_dir / f"{CLASSIFIER}.onnx"), providers=["CPUExecutionProvider"])
    out, *others = [o.name for o in sess.get_outputs()]  # the logits, and the solver residual (card.ood)
    expected = [sess.run([out], f)[0] for f in feeds]
    rest = [dict(zip(others, sess.run(others, f), strict=True)) for f in feeds]
    data = pa.input_data(feeds)

    def run(logits: list[np.ndarray]) -> subprocess.CompletedProcess:
        # every output needs expected data: image_info too (the encoded-image protocol's; {} for float tensors), and
        # a [B] output as the config's [1]
        info = {IMAGE_INFO: {"content": list(info_json({})), "shape": [len(info_json({}))]}}
        doc = dict(data, validation_data=[
            {out: {"content": y.ravel().tolist(), "shape": list(y.shape[1:])}, **info,
             **{k: {"content": v.ravel().tolist(), "shape": list(v.shape[1:]) or [1]} for k, v in r.items()}}
            for y, r in zip(logits, rest, strict=True)])
        path = tmp_path / "in.json"
        path.write_text(json.dumps(doc))
        cmd = pa.command(perf_analyzer, CLASSIFIER, server.grpc_url, path, 1, tmp_path / "r.csv", window_ms=500,
                         stability_pct=pa.UNSTABLE_PCT, max_trials=3)
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    ok = run(expected)
    assert ok.returncode == 0, ok.stdout[-800:] + ok.stderr[-800:]
    bad = run([y + 1.0 for y in expected])
    assert bad.returncode != 0, bad.stdout[-800:]


@pytest.mark.triton
@pytest.mark.slow
def test_real_images_through_perf_analyzer(perf_analyzer: Path, server) -> None:
    """The denoiser's held-out photos (noisy, with σ) as perf_analyzer input: served without failures."""
    w = denoise_workload(DENOISER, 64, n=2)
    row = pa.measure(DENOISER, server.grpc_url, w.arrays, 1, window_ms=500, max_trials=3, binary=perf_analyzer)
    assert row["throughput_rps"] > 0 and row["server"]["compute_infer_ms"] > 0


@pytest.mark.triton
def test_backend_logs_nothing_per_inference(server, demo_onnx_dir: Path) -> None:
    """The Python backend model converts tensors through DLPack both ways; a capsule whose name the consumer does
    not expect makes NumPy's destructor fail ``PyCapsule_GetPointer`` and print a traceback into Triton's log on
    every response. After batched and single real requests to both models, the log holds no traceback."""
    log = Path(server.log_path)
    offset = log.stat().st_size
    client = grpcclient.InferenceServerClient(server.grpc_url)
    feeds = _digits(demo_onnx_dir, 6)
    batch = {k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]}
    for f in [*feeds, batch]:
        ins = []
        for name, a in f.items():
            a = a.reshape(-1, 1) if a.ndim == 1 else a
            t = grpcclient.InferInput(name, list(a.shape), "FP32")
            t.set_data_from_numpy(a)
            ins.append(t)
        assert client.infer(CLASSIFIER, ins).as_numpy("logits").shape == (a.shape[0], 10)
    w = denoise_workload(DENOISER, 32, n=1)
    ins = []
    for name, a in w.arrays[0].items():
        a = a.reshape(-1, 1) if a.ndim == 1 else a
        t = grpcclient.InferInput(name, list(a.shape), "FP32")
        t.set_data_from_numpy(a)
        ins.append(t)
    client.infer(DENOISER, ins)
    text = log.read_bytes()[offset:].decode(errors="replace")
    for bad in ("Traceback", "PyCapsule", "Exception ignored"):
        assert bad not in text, text[-2000:]
