"""``unroll bench robustness`` on the real trained digit classifier: structure, determinism, the λ choice."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from unroll.benchmarks import robustness

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "robustness.json"


def test_smoke_run_is_deterministic_and_chooses_lambda_on_validation(tmp_path: Path) -> None:
    p = robustness.run(["sdnet-mnist"], ["gaussian_noise", "occlusion"], n_test=100, n_validation=100,
                       out_dir=tmp_path)
    m = p["models"]["sdnet-mnist"]
    assert [(r["corruption"], r["severity"]) for r in m["rows"]] == [(c, s) for c in ("gaussian_noise", "occlusion")
                                                                      for s in (1, 2, 3)]
    for r in m["rows"]:
        assert 0.0 <= r["trained"] <= 1.0 and r["chosen_lam"] in p["lam_grid"] and "auto" in r
    assert m["clean"] > m["rows"][2]["trained"]  # σ = 0.35 noise costs accuracy at the trained λ
    again = robustness.run(["sdnet-mnist"], ["gaussian_noise", "occlusion"], n_test=100, n_validation=100,
                           out_dir=None)
    assert again["models"] == p["models"]
    assert "| gaussian_noise | 2 |" in (tmp_path / "robustness.md").read_text()
    assert (tmp_path / "robustness.png").stat().st_size > 10_000


def test_cli_names_bad_choices(tmp_path: Path) -> None:
    unroll = str(Path(sys.executable).parent / "unroll")
    r = subprocess.run([unroll, "bench", "robustness", "-c", "fog", "--out", str(tmp_path), "--no-progress"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "unknown corruption" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([unroll, "bench", "robustness", "-m", "csc-denoiser", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "not a trained digit classifier" in r.stderr


def test_committed_results_cover_every_corruption_and_severity() -> None:
    from unroll.corruptions import CORRUPTIONS

    p = json.loads(RESULTS.read_text())
    for m in p["models"].values():
        assert {(r["corruption"], r["severity"]) for r in m["rows"]} == {(c, s) for c in CORRUPTIONS
                                                                         for s in (1, 2, 3)}
        assert "1000 digits" in m["test"]
