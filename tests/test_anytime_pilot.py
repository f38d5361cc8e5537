"""The anytime pilot (``python -m unroll.train.anytime_pilot``): a smoke run writes both tables, a row per served
count, and its command line says it was a smoke run; the committed result is a full run of the same code."""

from __future__ import annotations

import json
from pathlib import Path

from unroll.registry import get_spec
from unroll.train import anytime_pilot

RESULTS = Path(__file__).parent.parent / "benchmarks" / "results"


def test_a_smoke_run_writes_every_count_and_says_it_is_a_smoke_run(tmp_path: Path) -> None:
    assert anytime_pilot.main(["--epochs", "1", "--max-steps", "2", "--eval-limit", "200", "--out", str(tmp_path),
                               "--save", str(tmp_path / "w.pt")]) == 0
    res = json.loads((tmp_path / "anytime_pilot.json").read_text())
    counts = sorted({*get_spec(anytime_pilot.model_name()).card.iters.served, anytime_pilot.default_count()})
    for key in ("today", "anytime"):
        assert [r["iters"] for r in res[key]["rows"]] == counts
        assert all(0.0 <= r[c] <= 1.0 for r in res[key]["rows"] for c in r if c != "iters")
    assert "(a smoke run: not a result)" in (tmp_path / "anytime_pilot.md").read_text()
    assert (tmp_path / "w.pt").stat().st_size > 0


def test_the_committed_result_is_a_full_run() -> None:
    res = json.loads((RESULTS / "anytime_pilot.json").read_text())
    assert res["max_steps"] is None and res["eval_limit"] is None and res["epochs"] >= 30
    assert "smoke run" not in (RESULTS / "anytime_pilot.md").read_text()
