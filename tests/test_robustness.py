"""``unroll bench robustness`` on the real trained digit classifier: structure, determinism, the λ choice, the
served FP32/FP16/INT8 graphs (real exports and quantizations, in a temporary folder) and the λ curve."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from readme_blocks import generated

from unroll.benchmarks import robustness
from unroll.evaluation import LAM_GRID

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "robustness.json"


@pytest.fixture(scope="module")
def onnx_dir(demo_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the session's demo exports: the benchmark finds them up to date and quantizes them itself."""
    out = tmp_path_factory.mktemp("robustness_onnx")
    for f in demo_onnx_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def smoke(onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """One small run (40 digits, two corruptions) with its written results."""
    out = tmp_path_factory.mktemp("robustness_out")
    return robustness.run(["sdnet-mnist"], ["gaussian_noise", "occlusion"], n_test=40, n_validation=40,
                          out_dir=out, onnx_dir=onnx_dir), out


def test_smoke_run_is_deterministic_and_chooses_lambda_on_validation(smoke: tuple[dict, Path], onnx_dir: Path
                                                                      ) -> None:
    p, out = smoke
    m = p["models"]["sdnet-mnist"]
    assert [(r["corruption"], r["severity"]) for r in m["rows"]] == [(c, s) for c in ("gaussian_noise", "occlusion")
                                                                      for s in (1, 2, 3)]
    for r in m["rows"]:
        assert 0.0 <= r["trained"] <= 1.0 and r["chosen_lam"] in p["lam_grid"] and "auto" in r
    assert m["clean"] > m["rows"][2]["trained"]  # σ = 0.35 noise costs accuracy at the trained λ
    again = robustness.run(["sdnet-mnist"], ["gaussian_noise", "occlusion"], n_test=40, n_validation=40,
                           out_dir=None, onnx_dir=onnx_dir)
    assert again["models"] == p["models"]  # the cached graphs give the same numbers
    md = (out / "robustness.md").read_text()
    assert "| gaussian_noise | 2 |" in md and md.index("## Summary") < md.index("## Does precision")
    assert (out / "robustness.png").stat().st_size > 10_000
    assert (out / "robustness_lam.png").stat().st_size > 10_000


def test_served_graphs_per_precision_and_fp32_onnx_equals_pytorch(smoke: tuple[dict, Path], onnx_dir: Path) -> None:
    m = smoke[0]["models"]["sdnet-mnist"]
    prec = m["precisions"]
    assert set(prec) == {"fp32", "fp16", "int8"} and all(g["status"] == "served" for g in prec.values())
    assert m["onnx_lam"] == pytest.approx(m["trained_lam"])  # the graphs ran at the trained λ
    assert prec["fp32"]["clean"] == m["clean"] and prec["fp32"]["differs_from_pytorch"] == []
    for r in m["rows"]:
        assert r["onnx"]["fp32"] == r["trained"] and set(r["onnx"]) == {"fp32", "fp16", "int8"}
    for pr in ("fp16", "int8"):
        g = prec[pr]
        assert g["config"] and set(g["gate_metrics"]) == set(g["gate"])
        assert list(g["delta_vs_fp32"]) == ["gaussian_noise", "occlusion"]
        assert all(len(d) == 3 for d in g["delta_vs_fp32"].values())
        assert g["delta_clean"] == pytest.approx(g["clean"] - prec["fp32"]["clean"])
        assert (onnx_dir / f"sdnet-mnist.{pr}.onnx").exists()


def test_lambda_curve_has_one_point_per_grid_lambda_and_chooses_on_validation(smoke: tuple[dict, Path]) -> None:
    p = smoke[0]
    m = p["models"]["sdnet-mnist"]
    conds = m["lam_curve"]["conditions"]
    assert [c["condition"] for c in conds] == ["clean", "gaussian_noise 1", "gaussian_noise 2", "gaussian_noise 3",
                                               robustness.MEAN]
    for c in conds:
        assert len(c["test"]) == len(c["validation"]) == len(LAM_GRID) == len(p["lam_grid"])
        i = LAM_GRID.index(c["chosen_lam"])
        assert c["validation"][i] == max(c["validation"]) and c["chosen"] == c["test"][i]
        assert c["oracle"] == max(c["test"]) >= c["chosen"]
    # each row's choice is read off its test curve; the curve at the trained λ is the trained column
    trained = min(range(len(LAM_GRID)), key=lambda i: abs(LAM_GRID[i] - m["trained_lam"]))
    for r in m["rows"]:
        assert r["chosen"] == r["test_curve"][LAM_GRID.index(r["chosen_lam"])]
        assert r["test_curve"][trained] == r["trained"]
    assert conds[-1]["test"] == pytest.approx([sum(r["test_curve"][i] for r in m["rows"]) / len(m["rows"])
                                               for i in range(len(LAM_GRID))])


def test_a_precision_the_gate_refuses_is_reported_with_the_reason(onnx_dir: Path, tmp_path: Path) -> None:
    for f in onnx_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    p = robustness.run(["sdnet-mnist"], ["occlusion"], n_test=20, n_validation=20, out_dir=tmp_path,
                       onnx_dir=tmp_path, gates={"fp16": {"top1_agreement": 1.01}})  # no graph can agree 101%
    m = p["models"]["sdnet-mnist"]
    refused = m["precisions"]["fp16"]
    assert refused["status"] == "refused" and "failed its accuracy gate" in refused["reason"]
    assert "top1_agreement" in refused["reason"]
    assert all("fp16" not in r["onnx"] for r in m["rows"]) and m["precisions"]["int8"]["status"] == "served"
    md = (tmp_path / "robustness.md").read_text()
    assert "| sdnet-mnist |" in md and "| refused |" in md and "**refused**: sdnet-mnist fp16 failed" in md


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
        assert set(m["precisions"]) == {"fp32", "fp16", "int8"}
        for g in m["precisions"].values():
            assert g["status"] == "served" or g["reason"]
        if m["trained_lam"] is not None:
            assert all(len(c["test"]) == len(p["lam_grid"]) for c in m["lam_curve"]["conditions"])


def test_readme_quotes_the_committed_robustness_results() -> None:
    import json
    from pathlib import Path

    from unroll.benchmarks import robustness

    committed = Path(robustness.__file__).parent / "results" / "robustness.json"
    for block in generated(robustness.README_BEGIN, robustness.README_END):
        assert block == robustness.readme_block(json.loads(committed.read_text())).strip()
