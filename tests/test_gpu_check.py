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

from unroll.benchmarks import gpu_check, gpu_check_cases, gpu_check_run
from unroll.errors import BudgetExceeded

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
                                repeats=3, time_per_candidate_s=0.05, quick=True, dial_candidates=[])
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
    assert "iterations" not in payload and "iteration dial" not in md  # no dial candidates: no dial


def test_wrong_candidate_is_refused_and_a_failing_one_recorded(tmp_path: Path, monkeypatch) -> None:
    """Perturbed weights fail the card's FP32 gate (refused, not timed); a build error is a row, not a crash."""
    monkeypatch.setitem(gpu_check_cases.CANDIDATES, "perturbed", gpu_check_cases.Candidate("perturbed", "fp32", 0))
    monkeypatch.setitem(gpu_check_cases.CANDIDATES, "broken", gpu_check_cases.Candidate("broken", "fp32", 0))
    real = gpu_check_run.make_runner

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

    monkeypatch.setattr(gpu_check_run, "make_runner", make_runner)  # where measure looks it up
    [case] = gpu_check_cases.build_cases(["sdnet-mnist"], quick=True)
    import unroll

    model = unroll.load("sdnet-mnist")
    bad = gpu_check_run.measure(case, "perturbed", model, "cpu", tmp_path, 1, 3, 0.05)
    assert bad["status"] == "refused" and "rel_err" in bad["reason"] and "p50_ms" not in bad
    broken = gpu_check_run.measure(case, "broken", model, "cpu", tmp_path, 1, 3, 0.05)
    assert broken["status"] == "error" and "no such backend" in broken["reason"]
    ok = gpu_check_run.measure(case, "eager-fp32", model, "cpu", tmp_path, 1, 3, 0.05)
    assert ok["status"] == "ok" and ok["p50_ms"] > 0


def test_budget_end_inside_a_compile_is_a_skip_not_an_error(tmp_path: Path, monkeypatch) -> None:
    """The budget's alarm raised inside Inductor comes back wrapped in Inductor's own error: still a skip."""

    class InductorError(RuntimeError):
        pass

    def make_runner(cand, model, args, device, workdir):
        try:
            raise BudgetExceeded("the run's time budget (1 s) ended while this candidate ran")
        except BudgetExceeded as e:
            raise InductorError(f"BudgetExceeded: {e}") from e

    monkeypatch.setattr(gpu_check_run, "make_runner", make_runner)  # where measure looks it up
    [case] = gpu_check_cases.build_cases(["sdnet-mnist"], quick=True)
    row = gpu_check_run.measure(case, "compile", None, "cpu", tmp_path, 1, 3, 0.05)
    assert row["status"] == "skipped" and "time budget" in row["reason"]


def test_gate_check_directions() -> None:
    assert gpu_check_run.gate_check({"rel_err": 1e-5, "top1_agreement": 1.0}, {"rel_err": 1e-4,
                                                                              "top1_agreement": 0.999}) == []
    bad = gpu_check_run.gate_check({"rel_err": 1e-3, "top1_agreement": 0.5, "finite": 0.0},
                                   {"rel_err": 1e-4, "top1_agreement": 0.999})
    assert len(bad) == 3


def test_iteration_dial_dry_run_and_resume(tmp_path: Path) -> None:
    """The iteration dial section: every served K of a dial model (batch 1 under ``quick``), gated against the CPU
    model at that K, timed, with the CPU model's own time beside it; a resumed run keeps its rows and makes the one
    its process died in an error row."""
    args = dict(warmup=1, repeats=3, time_per_candidate_s=0.05, quick=True, dial_candidates=["eager-fp32"],
                dial_budget_s=60.0)
    gpu_check.run_check(tmp_path, "cpu", ["sdnet-mnist", "cnn-mnist"], ["eager-fp32"], **args)
    payload = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {c["model"]: c.get("iters") for c in payload["cases"]} == {"sdnet-mnist": 2, "cnn-mnist": None}
    dial = payload["iterations"]["cases"]
    assert [(c["model"], c["iters"], c["batch"]) for c in dial] == [("sdnet-mnist", k, 1) for k in (1, 2, 4, 8)]
    for c in dial:
        assert c["trained_iters"] == 2 and c["cpu_eager_fp32"]["p50_ms"] > 0 and c["cpu_eager_fp32"]["images_per_s"] > 0
        [row] = c["rows"]
        assert row["candidate"] == "eager-fp32" and row["status"] == "ok", row
        assert row["parity"]["max_abs"] == 0.0 and row["tolerance_source"] == "card fp32 gate"
    md = (tmp_path / "gpu_check.md").read_text()
    assert "## The iteration dial on the CPU (`iters=K`)" in md and "### sdnet-mnist" in md
    assert "| 2* | 1 | eager-fp32 | ok |" in md and "| 8 | 1 | eager-fp32 | ok |" in md
    assert "## sdnet-mnist, batch 1, iters 2 (" in md

    # the process died while K=4 ran: resuming keeps every other row as it was and records that one as an error
    done = copy.deepcopy(payload)
    done["iterations"]["cases"][2]["rows"][0] = {"candidate": "eager-fp32", "status": "unfinished"}
    (tmp_path / "gpu_check.json").write_text(json.dumps(done))
    gpu_check.run_check(tmp_path, "cpu", ["sdnet-mnist", "cnn-mnist"], ["eager-fp32"], resume=True, **args)
    again = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = [c["rows"][0] for c in again["iterations"]["cases"]]
    assert rows[2]["status"] == "error" and "process died" in rows[2]["reason"]
    assert [r["p50_ms"] for i, r in enumerate(rows) if i != 2] == [
        c["rows"][0]["p50_ms"] for i, c in enumerate(dial) if i != 2]
    assert again["elapsed_s"] >= payload["elapsed_s"]  # the resumed run counts the time already spent


def test_iteration_dial_gates_against_the_same_count(tmp_path: Path) -> None:
    """Each K is checked against the CPU model at that K: the model left at its trained count fails K=8's gate."""
    cases = {c.iters: c for c in gpu_check_cases.build_dial_cases(["sdnet-mnist", "csc-denoiser"], quick=True,
                                                                  cpu_timing=(0, 2, 0.01))}
    assert sorted(cases) == [1, 2, 4, 8]
    import numpy as np

    import unroll

    assert not np.allclose(cases[1].reference, cases[8].reference, atol=1e-3)  # the dial changes the output
    model = unroll.load("sdnet-mnist")  # its trained count, 2
    wrong = gpu_check_run.measure(cases[8], "eager-fp32", model, "cpu", tmp_path, 1, 3, 0.05)
    assert wrong["status"] == "refused" and "p50_ms" not in wrong
    right = gpu_check_run.measure(cases[2], "eager-fp32", model, "cpu", tmp_path, 1, 3, 0.05)
    assert right["status"] == "ok" and right["parity"]["max_abs"] == 0.0


def test_readme_links_every_gpu_check_result() -> None:
    """The results page's GPU row links this run's results and the earlier H200 run's, and each linked file exists."""
    import re

    from readme_blocks import page_with

    page = page_with("| `make gpu-check`")
    row = next(line for line in page.read_text().splitlines() if "| `make gpu-check`" in line)
    links = re.findall(r"\]\((benchmarks/results/[^)]+)\)", row)
    assert "benchmarks/results/gpu_check.md" in links and "benchmarks/results/gpu_check.h200.md" in links
    for link in links:
        assert (ROOT / link).is_file(), link
    for stem in ("gpu_check", "gpu_check.h200"):
        for ext in ("json", "md", "log"):
            assert (ROOT / "benchmarks/results" / f"{stem}.{ext}").is_file(), f"{stem}.{ext}"
