"""The GPU check (scripts/gpu_check.sh, unroll.benchmarks.gpu_check): skips cleanly without CUDA, and its
measurement code (parity gate, refusal, error rows, results files) runs here on the CPU as a dry run."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from unroll.benchmarks import gpu_check

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present: the script measures instead of skipping")
def test_script_skips_without_cuda_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "results"
    env = {**os.environ, "PYTHON": sys.executable, "UNROLL_WHEELS": str(tmp_path / "no-wheels")}
    r = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), "--out", str(out)], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "skipped, no CUDA GPU here" in r.stdout
    assert not out.exists()


def test_cpu_dry_run_writes_json_and_table(tmp_path: Path) -> None:
    cases = gpu_check.run_check(tmp_path, "cpu", ["sdnet-mnist"], ["eager-fp32", "autocast-bf16"], warmup=1,
                                repeats=3, time_per_candidate_s=0.05, quick=True)
    assert cases is not None
    payload = json.loads((tmp_path / "gpu_check.json").read_text())
    assert payload["machine"]["device"] == "cpu" and payload["machine"]["date_utc"]
    [case] = payload["cases"]
    assert (case["model"], case["batch"]) == ("sdnet-mnist", 1)
    rows = {r["candidate"]: r for r in case["rows"]}
    assert rows["eager-fp32"]["status"] == "ok" and rows["eager-fp32"]["parity"]["max_abs"] == 0.0
    assert rows["eager-fp32"]["speedup_vs_eager"] == pytest.approx(1.0)
    assert rows["autocast-bf16"]["tolerance_source"] == "card fp16 gate"
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| candidate | status | max abs |" in md and "| eager-fp32 | ok |" in md
    assert not list(tmp_path.glob("*.tmp"))


def test_wrong_candidate_is_refused_and_a_failing_one_recorded(tmp_path: Path, monkeypatch) -> None:
    """Perturbed weights fail the card's FP32 gate (refused, not timed); a build error is a row, not a crash."""
    monkeypatch.setitem(gpu_check.CANDIDATES, "perturbed", gpu_check.Candidate("perturbed", "fp32", 0))
    monkeypatch.setitem(gpu_check.CANDIDATES, "broken", gpu_check.Candidate("broken", "fp32", 0))
    real = gpu_check.make_runner

    def make_runner(cand, model, args, device, workdir):
        if cand == "broken":
            raise RuntimeError("no such backend")
        if cand == "perturbed":
            model = copy.deepcopy(model)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            cand = "eager-fp32"
        return real(cand, model, args, device, workdir)

    monkeypatch.setattr(gpu_check, "make_runner", make_runner)
    [case] = gpu_check.build_cases(["sdnet-mnist"], quick=True)
    import unroll

    model = unroll.load("sdnet-mnist")
    bad = gpu_check.measure(case, "perturbed", model, "cpu", tmp_path, 1, 3, 0.05)
    assert bad["status"] == "refused" and "rel_err" in bad["reason"] and "p50_ms" not in bad
    broken = gpu_check.measure(case, "broken", model, "cpu", tmp_path, 1, 3, 0.05)
    assert broken["status"] == "error" and "no such backend" in broken["reason"]
    ok = gpu_check.measure(case, "eager-fp32", model, "cpu", tmp_path, 1, 3, 0.05)
    assert ok["status"] == "ok" and ok["p50_ms"] > 0


def test_gate_check_directions() -> None:
    assert gpu_check.gate_check({"rel_err": 1e-5, "top1_agreement": 1.0}, {"rel_err": 1e-4,
                                                                          "top1_agreement": 0.999}) == []
    bad = gpu_check.gate_check({"rel_err": 1e-3, "top1_agreement": 0.5, "finite": 0.0},
                               {"rel_err": 1e-4, "top1_agreement": 0.999})
    assert len(bad) == 3
