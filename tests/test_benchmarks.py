"""Smoke runs of ``unroll bench serve | models | quality`` (tiny durations, --quick) into a temporary folder.

The ONNX graphs are exported afresh into a temporary folder (with an FP16 classifier through the real
quantizer), so the benchmarks never depend on a stale ``build/onnx``. Each run goes through the
Typer command, then the JSON, Markdown and PNG files are checked for a sane structure. The models are
the registry's trained ones (committed weights), never named here; the readers (Markdown, plots) are
also run on the committed results in ``benchmarks/results``.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import typer
from readme_blocks import generated
from typer.testing import CliRunner

from unroll.app import bench_cli as cli
from unroll.benchmarks.common import demo_model, latency_summary, quantizable, trained_models
from unroll.benchmarks.loadgen import InProcessSender
from unroll.benchmarks.serve_bench import level_row, stats_delta
from unroll.benchmarks.serve_load import Traffic, Workload, closed_level
from unroll.registry import REGISTRY, list_models

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
CLASSIFIER, DENOISER = demo_model("classification"), demo_model("denoising")


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("serve")(cli.bench_serve)
    app.command("models")(cli.bench_models)
    app.command("quality")(cli.bench_quality)
    app.command("all")(cli.bench_all)
    return app


def _invoke(*args: str) -> None:
    res = CliRunner().invoke(_app(), list(args))
    assert res.exit_code == 0, f"{args}: exit {res.exit_code}\n{res.output}\n{res.exception!r}"


def _png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert path.stat().st_size > 5_000, f"{path} looks empty"


def _load(out: Path, stem: str) -> tuple[dict, str]:
    return json.loads((out / f"{stem}.json").read_text()), (out / f"{stem}.md").read_text()


@pytest.fixture(scope="module")
def onnx_dir(demo_onnx_dir: Path) -> Path:
    from unroll.export.quantize import quantize

    quantize(CLASSIFIER, "fp16", demo_onnx_dir)
    return demo_onnx_dir


# ----------------------------------------------------------------------------------------------- fast unit checks


def test_latency_summary_and_a_level_on_the_engine_count_requests_and_errors() -> None:
    """A serving level runs on the load engine: an in-process call that sleeps and fails one request in five, three
    in flight; its row counts the answers, the failures by cause with a sample, and the client's CPU per request."""
    s = latency_summary([1.0, 2.0, 3.0, 4.0, 100.0])
    assert s["p50"] == 3.0 and s["max"] == 100.0 and s["p50"] <= s["p90"] <= s["p95"] <= s["p99"] <= s["max"]
    assert all(math.isnan(v) for v in latency_summary([]).values())

    def call(i: int) -> None:
        time.sleep(0.002)
        if i == 4:
            raise RuntimeError("boom")

    started = []
    t = Traffic(InProcessSender(call, 3), list(range(5)))
    res = closed_level(t, 3, duration_s=0.3, warmup_s=0.05, on_measure_start=lambda: started.append(1))
    w = Workload("k", "m", "label", [], [], "", "y")
    r = level_row(w, "onnxruntime", 3, res)
    assert started == [1] and r["requests"] > 20 and r["errors"] > 0 and r["sent"] == r["requests"] + r["errors"]
    assert r["errors_by_cause"] == {"error: RuntimeError": r["errors"]} and "boom" in r["error_samples"][0]
    assert 0.3 <= r["duration_s"] < 2.0 and r["throughput_rps"] == pytest.approx(r["requests"] / r["duration_s"])
    assert r["errors"] == pytest.approx(r["sent"] / 5, abs=4)
    assert 2.0 <= r["latency_ms"]["p50"] < 50 and r["client_cpu_ms_per_request"] > 0


def test_stats_delta_splits_per_request_and_averages_the_batch() -> None:
    def snap(n: int, execs: int, ns: int) -> dict:
        part = {"count": n, "ns": ns}
        return {"execution_count": execs, "inference_count": n,
                "inference_stats": {"success": {"count": n, "ns": 4 * ns}, "fail": {"count": 0, "ns": 0},
                                    **{k: dict(part) for k in ("queue", "compute_input", "compute_infer",
                                                               "compute_output")}}}

    d = stats_delta(snap(10, 10, 10_000_000), snap(30, 15, 50_000_000))
    assert d["requests"] == 20 and d["avg_batch"] == 4.0
    assert d["queue_ms"] == pytest.approx(2.0) and d["total_ms"] == pytest.approx(8.0)
    assert stats_delta(snap(3, 3, 1), snap(3, 3, 1)) is None and stats_delta(None, snap(1, 1, 1)) is None


def test_cli_help_and_bad_arguments() -> None:
    runner = CliRunner()
    for cmd in ("serve", "models", "quality", "all"):
        res = runner.invoke(_app(), [cmd, "--help"])
        assert res.exit_code == 0 and "--out" in res.output, res.output
    assert runner.invoke(_app(), ["serve", "--concurrency", "0,x"]).exit_code != 0
    res = runner.invoke(_app(), ["serve", "--url", "http://127.0.0.1:9", "--no-progress"])
    assert res.exit_code == 1 and "--triton-url" in res.output
    assert runner.invoke(_app(), ["models", "-m", "no-such-model"]).exit_code == 1
    assert runner.invoke(_app(), ["all", "--only", "nope"]).exit_code == 1


def test_models_to_benchmark_come_from_the_registry() -> None:
    from unroll.benchmarks.export_speed import default_rows
    from unroll.benchmarks.models_inputs import quantizable_models

    list_models()
    trained = [n for n, s in REGISTRY.items() if s.has_weights]
    assert trained_models() == trained and {CLASSIFIER, DENOISER} <= set(trained)
    assert REGISTRY[CLASSIFIER].task == "classification" and REGISTRY[DENOISER].task == "denoising"
    for name in quantizable_models():
        d = REGISTRY[name].card.data
        assert name in trained and d.train and getattr(d, d.gate)
    assert not any(quantizable(n) for n, s in REGISTRY.items() if s.card.data.train is None)
    assert {m for m, _, _ in default_rows()} >= set(trained)


def test_readers_accept_the_committed_results(tmp_path: Path) -> None:
    """Markdown and plots render from the committed JSON (the format the next `make bench` writes)."""
    from unroll.benchmarks import export_speed, models_bench, plots, quality_bench, serve_bench

    def load(stem: str) -> dict:
        return json.loads((RESULTS / f"{stem}.json").read_text())

    models = load("models")
    assert "| model | case |" in models_bench.markdown(models)
    serve = load("serve")
    assert "## Targets" in serve_bench.markdown(serve)
    assert serve_bench.targets(serve)[0]["met"] is not None
    den, cls = load("quality_denoise"), load("quality_classify")
    assert f"{DENOISER} (ONNX Runtime FP32) takes" in quality_bench.markdown_denoise(den)
    assert "| fp32 |" in quality_bench.markdown_classify(cls)
    assert "| model | case |" in export_speed.markdown(load("export_speed"))
    for path in [*plots.serve_plots(serve, tmp_path), *plots.models_plots(models, tmp_path),
                 plots.quality_denoise_plot(den, tmp_path), plots.quality_classify_plot(cls, tmp_path)]:
        _png(path)


# ----------------------------------------------------------------------------------------------- smoke runs


@pytest.mark.slow
def test_models_bench_quick(onnx_dir: Path, tmp_path: Path) -> None:
    _invoke("models", "--quick", "-m", CLASSIFIER, "-m", DENOISER, "--onnx-dir", str(onnx_dir),
            "--out", str(tmp_path), "--no-progress")
    payload, md = _load(tmp_path, "models")
    _png(tmp_path / "models_scaling.png")
    assert payload["machine"]["logical_cores"] and payload["machine"]["versions"]["onnxruntime"]
    assert {r["model"] for r in payload["rows"]} == {CLASSIFIER, DENOISER}
    for r in payload["rows"]:
        assert {"pytorch eager", "onnxruntime fp32"} <= set(r["timings"])
        assert all(t["median_ms"] > 0 and t["repeats"] >= 3 for t in r["timings"].values())
        assert r["speedup_vs_eager"]["pytorch eager"] == pytest.approx(1.0)
    cls = [e for e in payload["precision"] if e["model"] == CLASSIFIER]
    fp16 = [e for e in cls if e["precision"] == "fp16"]
    assert fp16 and all(e["median_ms"] > 0 and e["quality"]["accuracy"] > 0.9 for e in fp16)
    assert all(e["median_ms"] is None and "not quantized" in e["note"] for e in cls if e["precision"] == "int8")
    # the fitted exponent is a timing (a fresh-clone run with the machine shared once fitted outside 0.2-2.5): the
    # fit is checked to be made from the measured points, its value is reported by the committed results, not here
    den = payload["scaling"]["denoiser"]["onnxruntime fp32"]
    assert len(den["points"]) >= 2 and all(p["median_ms"] > 0 for p in den["points"])
    assert math.isfinite(den["fit"]["exponent"]) and math.isfinite(den["fit"]["log_coef"])
    assert all(p["images_per_s"] > 0 for pts in payload["scaling"]["classifier"]["engines"].values() for p in pts)
    assert payload["scaling"]["classifier"]["model"] == CLASSIFIER
    assert payload["scaling"]["denoiser"]["onnxruntime fp32"]["model"] == DENOISER
    assert f"| {CLASSIFIER} | batch 1 |" in md and "FP32 vs FP16 vs INT8" in md and "pixels^" in md


# ----------------------------------------------------------------------------------------------- --device cuda


def _plan_keys(plan) -> set[tuple]:
    return {(r.model, r.runtime, r.precision, r.batch) for r in plan.rows} | {
        (r.model, r.runtime, r.precision, r.batch) for r, _ in plan.skipped}


def _expected_keys(models: list[str], env, quick: bool = False) -> set[tuple]:
    from unroll.benchmarks.models_cuda import cuda_batches

    keys = {(m, rt, p, b) for m in models for b in cuda_batches(quick) for p in ("fp32", "fp16")
            for rt in ("pytorch eager", "torch.compile", env.ort_runtime)}
    return keys | {(m, env.gate_runtime, p, None) for m in models if quantizable(m) for p in ("fp16", "int8")}


def test_cuda_plan_against_this_machine(tmp_path: Path) -> None:
    """The rows a CUDA run would measure and the skip reasons, from a real probe of this machine."""
    import onnxruntime as ort
    import torch

    from unroll import machine
    from unroll.benchmarks import models_cuda as mb

    models = [CLASSIFIER, DENOISER, next(n for n, s in REGISTRY.items() if s.task == "block")]
    env = mb.cuda_environment()
    plan = mb.cuda_plan(models, env, tmp_path)  # an empty folder: no FP16/INT8 graph anywhere
    assert _plan_keys(plan) == _expected_keys(models, env) and len(plan.rows) + len(plan.skipped) == len(
        _expected_keys(models, env))
    assert {b for _, _, _, b in _plan_keys(plan)} == {1, 64, None}
    if not torch.cuda.is_available():  # nothing runs here, and every row says so
        assert not plan.rows and env.reason and {w for _, w in plan.skipped} == {env.reason}
        if torch.version.cuda is None:
            assert "CPU-only build" in env.reason
        return
    skipped = dict(plan.skipped)
    for r in plan.rows + list(skipped):
        why = skipped.get(r)
        if r.runtime == "pytorch eager":
            assert why is None
        elif r.runtime == env.ort_runtime or r.runtime == env.gate_runtime:
            if machine.CUDA_EP not in ort.get_available_providers():
                assert why and "has no CUDAExecutionProvider (pip install onnxruntime-gpu)" in why
            elif r.precision != "fp32":
                assert why and "not quantized" in why


def test_cuda_plan_skip_reasons(tmp_path: Path) -> None:
    """Each reason a row is skipped for, with the environments made of real probes: the dry-run (CPU provider)
    environment, and the same with this machine's real answer for ONNX Runtime's CUDA provider."""
    import dataclasses

    from unroll import machine
    from unroll.benchmarks import models_cuda as mb
    from unroll.export.quantize import quantize_inputs

    env = mb.cuda_environment("cpu")
    assert env.reason is None and env.ort_reason is None  # the CPU provider always runs
    onnx = tmp_path / "onnx"
    onnx.mkdir()
    (onnx / f"{CLASSIFIER}.onnx").write_bytes(b"")
    (onnx / f"{CLASSIFIER}.fp16.onnx").write_bytes(b"")  # made from this FP32 one (its report says so): usable
    (onnx / f"{CLASSIFIER}.fp16.report.json").write_text(json.dumps(
        {"built_from": quantize_inputs(onnx / f"{CLASSIFIER}.onnx", "fp16")}))
    plan = mb.cuda_plan([CLASSIFIER, DENOISER], env, onnx, quick=True, with_compile=False)
    assert _plan_keys(plan) == _expected_keys([CLASSIFIER, DENOISER], env, quick=True)
    skipped = dict(plan.skipped)
    assert all(skipped[r] == "--no-compile" for r in skipped if r.runtime == "torch.compile")
    ort_rows = {(r.model, r.precision, r.batch) for r in plan.rows if r.runtime == env.ort_runtime}
    assert ort_rows == {(m, p, b) for m in (CLASSIFIER, DENOISER) for b in (1, 4) for p in ("fp32", "fp16")
                        if not (m == DENOISER and p == "fp16")}
    assert {(r.model, r.precision) for r in plan.rows if r.runtime == env.gate_runtime} == {(CLASSIFIER, "fp16")}
    den16 = skipped[mb.PlanRow(DENOISER, env.ort_runtime, "fp16", 1)]
    assert den16 == f"not quantized (unroll quantize {DENOISER} --precision fp16)"
    block = next(n for n, s in REGISTRY.items() if not quantizable(n))
    only = mb.cuda_plan([block], env, onnx, quick=True)
    assert "its card names no calibration/gate data" in dict(only.skipped)[mb.PlanRow(block, env.ort_runtime, "fp16",
                                                                                       1)]
    assert not any(r.runtime == env.gate_runtime for r in only.rows)  # no gate data, no gate row
    (onnx / f"{CLASSIFIER}.onnx").write_bytes(b"re-exported")  # FP32 re-exported after the FP16 graph: stale
    stale = dict(mb.cuda_plan([CLASSIFIER], env, onnx, quick=True).skipped)
    assert "older than the FP32 export" in stale[mb.PlanRow(CLASSIFIER, env.ort_runtime, "fp16", 1)]

    cuda_ep = machine.probe_ort_provider(machine.CUDA_EP)  # this machine's real answer
    no_ort = dataclasses.replace(env, ort_provider=machine.CUDA_EP, ort_reason=None if cuda_ep.ok else cuda_ep.summary)
    plan = mb.cuda_plan([CLASSIFIER], no_ort, onnx, quick=True)
    if not cuda_ep.ok:
        assert not any(r.runtime in (env.ort_runtime, env.gate_runtime) for r in plan.rows)
        assert all(w == cuda_ep.summary for r, w in plan.skipped if r.runtime in (env.ort_runtime, env.gate_runtime))
        if cuda_ep.status == "missing":
            assert "has no CUDAExecutionProvider (pip install onnxruntime-gpu)" in cuda_ep.summary
    assert {r.runtime for r in plan.rows} >= {"pytorch eager", "torch.compile"}  # compile: on unless --no-compile


def test_cuda_bench_without_cuda_writes_nothing(tmp_path: Path) -> None:
    """No CUDA: exit 1 with the probe's reason; the results folder (here with a sentinel) is left untouched."""
    import torch

    from unroll import machine

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: the command would measure")
    out = tmp_path / "results"
    out.mkdir()
    (out / "models_cuda.json").write_text("committed\n")
    res = CliRunner().invoke(_app(), ["models", "--device", "cuda", "--quick", "-m", CLASSIFIER, "--out", str(out),
                                      "--onnx-dir", str(tmp_path / "onnx"), "--no-progress"])
    assert res.exit_code == 1, res.output
    text = " ".join(res.output.split())
    assert "--device cuda: no usable CUDA here" in text and "nothing was written" in text
    assert " ".join(machine.probe_cuda().summary.split()) in text
    assert [p.name for p in out.iterdir()] == ["models_cuda.json"] and (out / "models_cuda.json").read_text() == \
        "committed\n"
    assert not (tmp_path / "onnx").exists()  # nothing exported either
    res = CliRunner().invoke(_app(), ["models", "--device", "tpu"])
    assert res.exit_code != 0 and "--device must be cpu or cuda" in res.output


@pytest.mark.slow
def test_cuda_bench_code_dry_run_on_cpu(onnx_dir: Path, tmp_path: Path) -> None:
    """The CUDA benchmark's code path end to end (IOBinding, autocast, the device gate, the files), on the CPU."""
    from unroll.benchmarks import models_cuda as mb

    env = mb.cuda_environment("cpu")
    payload = mb.run_cuda([CLASSIFIER, DENOISER], budget_s=0.05, with_compile=False, quick=True, onnx_dir=onnx_dir,
                          out_dir=tmp_path, progress=False, env=env)
    saved, md = _load(tmp_path, "models_cuda")
    assert saved["device"] == "cpu" and "not GPU results" in md
    got = {(r["model"], r["runtime"], r["precision"], r["batch"]) for r in saved["rows"]}
    assert got == {(m, rt, p, b) for m in (CLASSIFIER, DENOISER) for b in (1, 4) for rt, p in (
        ("pytorch eager", "fp32"), ("pytorch eager", "fp16"), ("onnxruntime cpu", "fp32"), ("onnxruntime cpu", "fp16"))
        if not (m == DENOISER and rt == "onnxruntime cpu" and p == "fp16")}, saved["skipped"]
    for r in saved["rows"]:
        assert r["median_ms"] > 0 and r["repeats"] >= 3 and r["items_per_s"] > 0
        assert r["speedup_vs_eager_fp32"] > 0
    [gate] = saved["gates"]
    assert (gate["model"], gate["precision"], gate["passed"]) == (CLASSIFIER, "fp16", True)
    assert gate["metrics"]["top1_agreement"] >= gate["tolerances"]["top1_agreement"]
    assert gate["cpu_gate"]["top1_agreement"] is not None  # beside unroll quantize's own CPU figure
    reasons = {s["reason"] for s in saved["skipped"]}
    assert "--no-compile" in reasons and any("not quantized" in w for w in reasons)
    assert f"| {CLASSIFIER} | batch 4 |" in md and "## Accuracy gates" in md and "## Not measured" in md
    assert payload["rows"] == saved["rows"]


def _no_cuda() -> str | None:
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    return None if torch.cuda.is_available() else "no CUDA device (torch.cuda.is_available() is False)"


@pytest.mark.gpu
@pytest.mark.skipif(_no_cuda() is not None, reason=str(_no_cuda()))
def test_cuda_bench_on_the_gpu(onnx_dir: Path, tmp_path: Path) -> None:
    """Where CUDA exists: a tiny real run of `bench models --device cuda` through the command."""
    import torch

    from unroll.benchmarks import models_cuda as mb

    env = mb.cuda_environment()
    if env.reason:
        pytest.skip(env.reason)
    _invoke("models", "--device", "cuda", "--quick", "--no-compile", "-m", CLASSIFIER, "--onnx-dir", str(onnx_dir),
            "--out", str(tmp_path), "--no-progress")
    saved, md = _load(tmp_path, "models_cuda")
    assert saved["device"] == "cuda" and saved["machine"]["gpu"] == torch.cuda.get_device_name(0)
    assert saved["machine"]["cuda_runtime"] == torch.version.cuda and saved["machine"]["driver"]
    eager = [r for r in saved["rows"] if r["runtime"] == "pytorch eager"]
    assert len(eager) == 4 and all(r["median_ms"] > 0 for r in eager)
    ort_rows = [r for r in saved["rows"] if r["runtime"] == "onnxruntime cuda"]
    if env.ort_reason is None:
        assert ort_rows and saved["gates"] and saved["gates"][0]["passed"], saved["gates"]
    else:
        assert not ort_rows and any(s["reason"] == env.ort_reason for s in saved["skipped"])
    assert "CUDA" in md.splitlines()[0] and torch.cuda.get_device_name(0) in md


@pytest.mark.slow
def test_quality_bench_quick(onnx_dir: Path, tmp_path: Path) -> None:
    _invoke("quality", "--quick", "--onnx-dir", str(onnx_dir), "--out", str(tmp_path), "--no-progress")
    den, md = _load(tmp_path, "quality_denoise")
    _png(tmp_path / "quality_denoise.png")
    assert {f"{DENOISER} FP32", "BM3D", "NL-means", "TV (Chambolle)", "wavelet (BayesShrink)"} <= set(den["methods"])
    assert den["config"]["missing_precisions"].keys() == {"fp16", "int8"}
    noisy_psnr = 20 * math.log10(255 / 25)  # ≈ 20.2 dB: every method must beat doing nothing
    for r in den["per_image"]:
        assert r["psnr"] > noisy_psnr + 1 and 0 < r["ssim"] <= 1 and r["time_s"] > 0
    assert len(den["per_image"]) == len(den["methods"]) * den["n_images"]
    assert f"| {DENOISER} FP32 |" in md and den["model"] == DENOISER
    cls, md = _load(tmp_path, "quality_classify")
    _png(tmp_path / "quality_classify.png")
    assert set(cls["results"]) == {"fp32", "fp16"} and cls["model"] == CLASSIFIER
    clean = {p: rows[0] for p, rows in cls["results"].items()}
    assert all(r["sigma"] == 0 and r["acc_fixed"] >= 0.9 for r in clean.values())
    noisy = cls["results"]["fp32"][-1]
    assert noisy["sigma"] > 0 and noisy["acc_auto"] > noisy["acc_fixed"]  # lam=auto is what it is for
    assert "| fp32 |" in md


@pytest.mark.slow
@pytest.mark.triton
def test_serve_bench_quick(onnx_dir: Path, tmp_path: Path) -> None:
    _invoke("serve", "--quick", "--duration", "0.6", "--batching-concurrency", "8", "--batching-rounds", "2",
            "--onnx-dir", str(onnx_dir),
            "--out", str(tmp_path), "--no-progress")
    payload, md = _load(tmp_path, "serve")
    for name in ("serve_latency.png", "serve_throughput.png", "serve_split.png"):
        _png(tmp_path / name)
    runs = payload["runs"]
    assert {r["path"] for r in runs} == {"onnxruntime", "triton-http", "triton-grpc", "triton-grpc-image", "gateway"}
    assert {r["workload"] for r in runs} == {"classify", "denoise-128"}
    assert {r["model"] for r in runs} == {CLASSIFIER, DENOISER} and payload["batching"]["model"] == CLASSIFIER
    for r in runs:  # every level on the load engine, its own CPU per request beside
        assert r["requests"] > 0 and r["throughput_rps"] > 0 and r["sent"] >= r["requests"], r
        assert r["client_cpu_ms_per_request"] > 0 and sum(r["errors_by_cause"].values()) == r["errors"], r
        L = r["latency_ms"]
        assert 0 < L["p50"] <= L["p90"] <= L["p95"] <= L["p99"] <= L["max"], r
        if r["concurrency"] == 1:
            assert r["errors"] == 0, r["error_samples"]
        if r["path"] != "onnxruntime":  # Triton's own statistics for the level
            s = r["server"]
            assert s["requests"] > 0 and s["avg_batch"] >= 1 and s["compute_infer_ms"] > 0, s
    assert all("gateway_share_ms" in r and "gateway_share_image_ms" in r for r in runs if r["path"] == "gateway")
    for r in runs:  # CPU per request by process, read from /proc for the servers this run started
        c = r["cpu_ms_per_request"]
        assert set(c) == {"gateway", "tritonserver", "backends", "client"} and min(c.values()) >= 0, r
        if r["path"] != "onnxruntime":  # Triton and its stub did the work; through the gateway, it did some too
            assert c["tritonserver"] > 0 and c["backends"] > 0, c
        if r["path"] == "gateway":
            assert c["gateway"] > 0, c
    assert "## CPU per request" in md
    b = payload["batching"]
    assert b["off"]["server"]["avg_batch"] == 1.0 and b["config_off"]["max_batch_size"] == 1
    assert b["config_off"].get("dynamic_batching") is None and b["speedup"] > 0
    assert len(b["rounds"]) == 2 and b["speedup"] == min(b["speedups"])  # lower median of two rounds
    pa_ok = payload["perf_analyzer"]["available"]  # the Triton-direct targets need perf_analyzer
    if pa_ok:  # the Python backend's floor: a do-nothing model, measured and named in the latency target
        floor = payload["perf_analyzer"]["floor"]
        assert floor["model"] == "python-backend-floor" and floor["server"]["avg_batch"] == 1.0, floor
        assert 0 < floor["latency_ms"]["p50"] and "do-nothing Python-backend model" in payload["targets"][2]["measured"]
        requests = {(r["workload"], r["request"]) for r in payload["perf_analyzer"]["runs"]}
        # the PNG files beside the tensors
        assert requests == {(w, k) for w in ("classify", "denoise-128") for k in ("tensors", "png")}
    other = payload["other_spinning"]  # the classifier again, ONNX Runtime's threads spinning the other way
    assert other["spinning"] is not payload["config"]["spinning"]
    assert {(r["path"], r["concurrency"]) for r in other["runs"]} == {(p, c) for p in ("gateway", "triton-http")
                                                                       for c in (1, 4)}
    through_gateway = {r["concurrency"]: r["cpu_ms_per_request"]["gateway"] for r in other["runs"]
                       if r["path"] == "gateway"}
    for r in other["runs"]:
        assert r["requests"] > 0 and (r["errors"] == 0 or r["concurrency"] > 1), r
        c = r["cpu_ms_per_request"]
        assert c["tritonserver"] > 0 and c["client"] > 0 and r["client_cpu_ms_per_request"] > 0, r
        if r["path"] == "gateway":
            assert c["gateway"] > 0, r
        else:  # Triton direct: the idle gateway's background work only (its catalog look every 2 s)
            assert c["gateway"] < 0.25 * through_gateway[r["concurrency"]], r
    assert "## Spinning on vs off" in md and "ab" not in payload
    # every target measured here but the two that need perf_analyzer: the request-path ones from the sweep's levels
    assert [t["met"] is not None for t in payload["targets"]] == [True, True, pa_ok, pa_ok] + [True] * 5
    assert "## Targets" in md and "measured" in md and "Dynamic batching on vs off" in md


def test_readme_serve_block_is_the_one_generated_from_the_committed_results() -> None:
    """The README quotes the serving targets through :func:`serve_report.readme_block` (`unroll bench serve` writes
    it into the README with the committed results), not by hand."""
    from unroll.benchmarks import serve_report
    from unroll.benchmarks.common import RESULTS

    payload = json.loads((RESULTS / "serve.json").read_text())
    blocks = generated(serve_report.README_BEGIN, serve_report.README_END)
    assert len(blocks) == 2, "the README's headline and the REST guide's request-path costs"
    for block in blocks:
        assert block == serve_report.readme_block(payload)
        assert "gateway CPU per classify request" in block and "Triton direct" in block


def test_the_pytorch_call_fits_every_registered_models_inputs() -> None:
    """`unroll bench models` times every registered model in PyTorch: the call it builds takes each model's inputs
    (a classifier without λ takes the image alone)."""
    import torch

    from unroll import registry
    from unroll.benchmarks.models_inputs import torch_call

    for name in ("sdnet-mnist", "vit-mnist", "csc-denoiser"):
        card = registry.get_spec(name).card
        shape = [s if s > 0 else 32 for s in card.input.shape]
        feeds = {card.input.name: torch.rand(1, *shape)}
        if card.lam is not None:
            feeds[card.lam.input] = torch.full((1,), 0.1)
        if card.sigma is not None:
            feeds[card.sigma.input] = torch.full((1,), 0.1)
        with torch.no_grad():
            assert torch.isfinite(torch_call(registry.load(name, pretrained=False).eval(), name, feeds)()).all(), name
