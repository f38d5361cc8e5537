"""The GPU serving check (scripts/gpu_serve_check.sh, unroll.benchmarks.gpu_serve, issue 37): its CPU half through
the real tritonserver and gateway (`--device cpu`), its clean skip without CUDA, its load (on the project's load
engine), and the pack's size accounting against the 64 MiB one device call may send."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from unroll.benchmarks import gpu_serve_pack
from unroll.benchmarks.gpu_serve_load import ceiling
from unroll.serving.triton import free_ports

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_serve_check.sh"


def _run(args: list[str], tmp_path: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "UNROLL_GPU_PACK": str(tmp_path / "no-pack")}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present: the script measures instead of skipping")
def test_without_cuda_it_says_why_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "results"
    r = _run(["--out", str(out)], tmp_path, 120)
    assert r.returncode == 0, r.stderr
    assert "gpu_serve: skipped, no CUDA GPU here" in r.stdout and "Nothing written" in r.stdout
    assert not out.exists()


@pytest.mark.triton
@pytest.mark.slow
def test_cpu_half_serves_measures_and_stops_through_the_real_tritonserver(demo_onnx_dir: Path, tmp_path: Path
                                                                            ) -> None:
    out = tmp_path / "results"
    r = _run(["--device", "cpu", "--quick", "--out", str(out), "--onnx-dir", str(demo_onnx_dir)], tmp_path, 240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "gpu_serve.json").read_text())
    assert res["complete"] and res["machine"]["device"] == "cpu" and res["machine"]["tritonserver"]
    assert (out / "gpu_serve.md").read_text().startswith("# Served on a GPU")
    levels = {(x["workload"], x["path"], x["concurrency"]) for x in res["levels"]}
    workloads = {x["workload"] for x in res["levels"]}
    assert workloads == {"classify", "denoise-256"}
    assert levels == {(w, p, c) for w in workloads for p in ("triton-tensors", "triton-image", "gateway")
                      for c in (1, 8)}, levels
    for x in res["levels"]:
        where = (x["workload"], x["path"], x["concurrency"])
        assert x["requests"] > 0 and x["errors"] == 0, (where, x["error_samples"])
        assert x["throughput"] > 0 and 0 < x["latency_ms"]["p50"] <= x["latency_ms"]["p99"] <= x["latency_ms"]["max"]
        assert x["triton"]["requests"] > 0 and x["triton"]["avg_batch"] >= 1, where
        assert sum(x["batches"].values()) > 0 and min(map(int, x["batches"])) >= 1, where
        cpu = x["cpu_ms_per_request"]
        # /proc counts CPU in 10 ms ticks: a short level of a few requests may see none for tritonserver itself
        assert cpu["tritonserver"] >= 0 and cpu["backends"] > 0 and cpu["client"] > 0, (where, cpu)
        assert x["gpu"] is None  # no NVML on the CPU
    gateway = [x for x in res["levels"] if x["path"] == "gateway"]
    assert sum(x["cpu_ms_per_request"]["gateway"] for x in gateway) > 0
    assert {p["model"] for p in res["parity"]} == {"sdnet-mnist", "csc-denoiser"}
    assert all(p["passed"] and p["tolerance"] for p in res["parity"]), res["parity"]
    assert {x["model"] for x in res["inprocess"]} == {"sdnet-mnist", "csc-denoiser"}
    assert all(x["p50_ms"] > 0 and x["images_per_s"] > 0 for x in res["inprocess"])
    assert res["load_generator"]["req_per_s_per_process"] > 0 and res["load_generator"]["errors"] == 0
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not leftover, f"processes left running: {leftover}"


def test_the_load_engine_holds_many_requests_in_flight_and_reports_its_own_cpu() -> None:
    """The check's ceiling: the project's load engine in two client processes against a server that does nothing."""
    r = ceiling(free_ports(1)[0], concurrency=64, processes=2, duration_s=0.5)
    assert r.errors_total == 0 and r.ok > 64 and r.processes == 2 and r.load.concurrency == 64, r.error_samples
    assert r.throughput > 0 and 0 < r.client_cpu_share <= 1.5 and r.cpu_ms_per_request > 0
    starts, ends = zip(*r.windows, strict=True)
    assert len(r.windows) == 2 and max(starts) < min(ends), r.windows  # the two processes measured together


def test_size_accounting_flags_a_call_over_64_mib(tmp_path: Path) -> None:
    limit = gpu_serve_pack.BUDGET_BYTES
    assert limit == 64 * 2**20
    fits = gpu_serve_pack.budget({"tracked tree": limit // 2}, {".gpu_pack/a": limit // 4, ".gpu_pack/b": limit // 4})
    assert fits["fits"] and fits["total"] == limit and fits["left"] == 0
    over = gpu_serve_pack.budget({"tracked tree": limit // 2}, {".gpu_pack/a": limit // 2 + 1})
    assert not over["fits"] and over["left"] == -1 and "OVER BY" in gpu_serve_pack.format_budget(over)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"x" * 1000)
    assert gpu_serve_pack.tree_bytes(tmp_path / "d") == 1000
    sent = gpu_serve_pack.sent_bytes(ROOT)
    assert 0 < sent["tracked tree"] < limit, sent


def test_the_pack_if_made_fits_in_one_device_call() -> None:
    pack = gpu_serve_pack.PACK
    if not (pack / "MANIFEST.json").exists():
        pytest.skip(f"no pack at {pack}: scripts/gpu_serve_pack.sh makes one (it downloads wheels from PyPI)")
    r = subprocess.run([sys.executable, "-m", "unroll.benchmarks.gpu_serve_pack", "--account-only"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fits" in r.stdout
    manifest = json.loads((pack / "MANIFEST.json").read_text())
    assert manifest["python"] == "3.12" and "libtritonserver" in " ".join(manifest["triton"]["libraries"])
