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


def test_int8_is_a_candidate_only_by_consent_and_a_choice_without_it_is_not_served(demo_onnx_dir: Path,
                                                                                  tmp_path: Path) -> None:
    """``unroll optimize`` without ``--precision …int8`` never measures (so never chooses) INT8; with it, the INT8
    graph is built behind its quantize gate, checked on the gate data, and the record carries the consent and what
    INT8 loses; a choice of INT8 without the consent recorded is refused, not served."""
    from unroll.card import from_onnx
    from unroll.errors import PipelineError
    from unroll.pipeline import choice

    graph = _copy_graph(demo_onnx_dir, tmp_path / "onnx")
    card = from_onnx(graph)
    assert "int8" in card.precisions
    found, skipped = opt.candidates(card, registered=True)
    assert found and all(c.precision != "int8" for c in found)
    refused = [s for s in skipped if "/int8" in s["candidate"]]
    assert refused and all("--precision fp32,fp16,int8" in s["reason"] for s in refused), refused
    found, _ = opt.candidates(card, registered=True, allowed=("fp32", "fp16", "int8"))
    assert any(c.precision == "int8" for c in found)

    record = opt.run(_settings(tmp_path, graph.parent, only=("onnxruntime/int8",),
                               precisions=("fp32", "fp16", "int8")), progress=lambda _: None)
    assert record["choice"]["precision"] == "int8" and "int8" in record["precisions_allowed"]
    assert record["quality"]["precision"] == "int8" and "accuracy_loss" in record["quality"], record["quality"]
    quant_report = json.loads(artifacts.report_of(artifacts.graph(MODEL, "int8", graph.parent)).read_text())
    assert quant_report["passed"]  # the graph measured is the one that passed its quantize gate
    md = artifacts.choice(MODEL, "cpu", tmp_path / "optimize").with_suffix(".md").read_text()
    assert "**Precision:** int8: gate accuracy loss" in md and "allowed: fp32, fp16, int8" in md
    assert "int8: gate accuracy loss" in (choice.served_as(MODEL, "cpu", tmp_path / "optimize") or "")

    path = artifacts.choice(MODEL, "cpu", tmp_path / "optimize")
    path.write_text(json.dumps({**record, "precisions_allowed": ["fp32", "fp16"]}))
    with pytest.raises(PipelineError, match="INT8 without the user allowing it"):
        choice.read(MODEL, "cpu", tmp_path / "optimize")


def test_optimize_precision_option_names_what_it_accepts() -> None:
    r = CliRunner().invoke(app, ["optimize", MODEL, "--precision", "fp32,int4"])
    assert r.exit_code != 0 and "unknown: int4" in r.output and "fp32, fp16, int8" in r.output, r.output


def test_serves_banner_says_how_each_model_runs_and_what_its_precision_loses(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from unroll.app.serve import banner, served_as
    from unroll.registry import get_spec

    monkeypatch.setattr(artifacts, "OPTIMIZE_DIR", tmp_path / "optimize")  # no choice made here
    cards = [get_spec("csc-denoiser").card]
    how = served_as(cards, "cpu")
    assert how == {"csc-denoiser": "openvino, fp32 graph as exported (no `unroll optimize` choice)"}
    path = artifacts.choice("csc-denoiser", "cpu")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"choice": {"runtime": "openvino", "precision": "fp16", "static_shapes": True},
                                "precisions_allowed": ["fp32", "fp16"],
                                "quality": {"precision": "fp16", "psnr_loss_db_worst": 0.0036,
                                            "worst_image": "stress/stripes-7 σ=15"}}))
    how = served_as(cards, "cpu")["csc-denoiser"]
    assert how.startswith("openvino (static shapes), chosen by `unroll optimize` with fp32, fp16 allowed; fp16: "
                          "worst gate image loses 0.004 dB (stress/stripes-7 σ=15)"), how
    text = banner("http://127.0.0.1:8080", cards, {}, api_key=False, triton="grpc://127.0.0.1:8001",
                  served_as={"csc-denoiser": how})
    assert f"served as:\n  csc-denoiser: {how}" in text
