"""``unroll optimize`` (issue 25): real gate data, real runtimes, a real tritonserver and perf_analyzer.

A candidate whose weights are perturbed is refused before it is timed; an interrupted run resumes without measuring
again; the sweep's choice is exactly what ``unroll repo`` then writes into the config; ``--target gpu`` without a GPU
says why and writes nothing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from google.protobuf import text_format
from onnx import numpy_helper
from tritonclient.grpc import model_config_pb2 as mc
from typer.testing import CliRunner

from unroll import artifacts, pipeline
from unroll.app.cli import app
from unroll.benchmarks import optimize as opt
from unroll.benchmarks import perf_analyzer

MODEL = "sdnet-mnist"
ORT_FP32 = "onnxruntime/fp32"


def _copy_graph(src_dir: Path, dst_dir: Path) -> Path:
    """The model's export and its companions' (λ rule, other iteration counts: without them the model counts as stale
    and is re-exported)."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    for name in pipeline.graphs_of([MODEL]):
        for path in (artifacts.graph(name, onnx_dir=src_dir), artifacts.graph_report(name, onnx_dir=src_dir)):
            shutil.copyfile(path, dst_dir / path.name)
    return artifacts.graph(MODEL, onnx_dir=dst_dir)


def _perturb(graph: Path, scale: float = 1.05) -> str:
    """Scale the largest weight tensor of ``graph`` in place (a deliberately wrong candidate); returns its name."""
    model = onnx.load(str(graph))
    init = max(model.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(scale), init.name))
    onnx.save(model, str(graph))
    return init.name


def _settings(tmp: Path, onnx_dir: Path, **kw) -> opt.Settings:
    return opt.Settings(MODEL, onnx_dir=onnx_dir, optimize_dir=tmp / "optimize", aoti_dir=tmp / "aoti",
                        **{"only": (ORT_FP32,), "sweep": False, "compare": False, **kw})


def test_perturbed_weights_are_refused_before_timing(demo_onnx_dir: Path, tmp_path: Path) -> None:
    graph = _copy_graph(demo_onnx_dir, tmp_path / "onnx")
    _perturb(graph)
    with pytest.raises(opt.OptimizeError, match="no candidate passed"):
        opt.run(_settings(tmp_path, graph.parent), progress=lambda _: None)
    journal = json.loads(artifacts.choice(MODEL, "cpu", tmp_path / "optimize").with_suffix(".partial.json")
                         .read_text())
    row = journal["candidates"][ORT_FP32]
    assert row["status"] == "refused" and "timings" not in row, row
    assert "rel_err" in row["reason"], row["reason"]  # FP32 must match the PyTorch model, not only its accuracy
    assert row["gate"]["metrics"]["rel_err"] > opt.FP32_REL_ERR


def test_the_unperturbed_graph_passes_and_an_interrupted_run_resumes(demo_onnx_dir: Path, tmp_path: Path) -> None:
    onnx_dir = _copy_graph(demo_onnx_dir, tmp_path / "onnx").parent
    only = (ORT_FP32, "openvino/fp32")
    seen: list[str] = []

    def interrupt_after_first(msg: str) -> None:
        seen.append(msg)
        if msg.startswith(f"{MODEL}: openvino/fp32: building"):
            raise KeyboardInterrupt  # what Ctrl-C raises, after the first candidate was saved

    with pytest.raises(KeyboardInterrupt):
        opt.run(_settings(tmp_path, onnx_dir, only=only), progress=interrupt_after_first)
    messages: list[str] = []
    record = opt.run(_settings(tmp_path, onnx_dir, only=only), progress=messages.append)
    assert any("resuming (1 candidates" in m for m in messages), messages
    assert not any(m.startswith(f"{MODEL}: {ORT_FP32}:") for m in messages), "measured again after resuming"
    rows = {r["key"]: r for r in record["candidates"]}
    assert rows[ORT_FP32]["status"] == "passed" and rows[ORT_FP32]["gate"]["metrics"]["rel_err"] < 1e-5
    assert set(rows) == set(only)
    assert record["choice"]["runtime"] in ("onnxruntime", "openvino")
    path = artifacts.choice(MODEL, "cpu", tmp_path / "optimize")
    assert path.exists() and not path.with_suffix(".partial.json").exists()
    assert "## Candidates" in path.with_suffix(".md").read_text()


def _config(model_dir: Path) -> mc.ModelConfig:
    return text_format.Parse(
        "\n".join(ln for ln in (model_dir / "config.pbtxt").read_text().splitlines() if not ln.startswith("#")),
        mc.ModelConfig())


@pytest.mark.slow
@pytest.mark.triton
def test_the_sweeps_choice_is_what_the_repository_serves(demo_onnx_dir: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    if perf_analyzer.find() is None:
        pytest.skip(perf_analyzer.missing_reason())
    onnx_dir = _copy_graph(demo_onnx_dir, tmp_path / "onnx").parent
    monkeypatch.setattr(artifacts, "OPTIMIZE_DIR", tmp_path / "optimize")  # where `unroll repo` looks, this test only
    monkeypatch.setattr(opt.optimize_sweep, "QUEUE_DELAYS_US", (0, 2000))
    settings = opt.Settings(MODEL, onnx_dir=onnx_dir, only=(ORT_FP32,), compare=False)
    record = opt.run(settings, progress=lambda _: None)
    sweep = record["sweep"]
    assert sweep["status"] == "measured", sweep
    assert sweep["points"][0]["config"] == sweep["hand_set"]  # today's configuration, measured in the same run
    assert all(lv["throughput_rps"] > 0 for p in sweep["points"] for lv in p["levels"])
    chosen = record["choice"]

    repo = tmp_path / "repo"
    pipeline.run(pipeline.plan([MODEL], onnx_dir=onnx_dir, repo=repo, companions=False), progress=None)
    cfg = _config(repo / MODEL)
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert cfg.max_batch_size == chosen["max_batch_size"]
    assert cfg.instance_group[0].count == chosen["instances"]
    assert cfg.dynamic_batching.max_queue_delay_microseconds == chosen["queue_delay_us"]
    assert params["intra_op_num_threads"] == str(chosen["threads"])
    assert params["intra_op_spinning"] == ("1" if chosen["spinning"] else "0")
    assert params["cpu_runtime"] == chosen["runtime"] == "onnxruntime"

    # --no-optimized: the hand-set configuration again
    plain = tmp_path / "plain"
    options = pipeline.RepoOptions(optimized=False)
    pipeline.run(pipeline.plan([MODEL], onnx_dir=onnx_dir, repo=plain, options=options, companions=False),
                 progress=None)
    assert _config(plain / MODEL).max_batch_size == sweep["hand_set"]["max_batch_size"]


def test_gpu_target_without_a_gpu_says_why_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from unroll.benchmarks.gpu_check import cuda_unavailable

    if cuda_unavailable() is None:
        pytest.skip("a CUDA GPU is present: scripts/gpu_check.sh runs the GPU target there")
    monkeypatch.setattr(artifacts, "OPTIMIZE_DIR", tmp_path)
    result = CliRunner().invoke(app, ["optimize", MODEL, "--target", "gpu", "--no-progress"])
    assert result.exit_code != 0
    assert "needs a CUDA GPU" in result.output and cuda_unavailable() in result.output, result.output
    assert not artifacts.choice(MODEL, "gpu").exists()


def test_the_gpu_targets_code_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    """The dry run of ``--target gpu``: the same code on the CPU device, two candidates, a real parity gate."""
    from unroll.benchmarks.optimize_gpu import run_gpu

    record = run_gpu(MODEL, 120, device="cpu", candidates=["eager-fp32", "autocast-bf16"], optimize_dir=tmp_path)
    assert record["choice"] == {}  # measured only: the GPU repository serves TensorRT
    assert set(record["best"]) and all(v["candidate"] in ("eager-fp32", "autocast-bf16")
                                       for v in record["best"].values())
    assert {s["candidate"] for s in record["skipped"]} >= {"TensorRT plan"}
    assert artifacts.choice(MODEL, "gpu", tmp_path).with_suffix(".md").exists()
