"""The committed ``unroll bench stress`` results: generated (the Markdown is what the JSON renders to), every
reduced precision of the denoiser on both runtimes, and a verdict per set that follows from its numbers."""

from __future__ import annotations

import json

from unroll import stress_patterns
from unroll.benchmarks import precision_stress
from unroll.benchmarks.common import RESULTS


def test_committed_stress_results_are_generated_and_cover_every_precision_and_runtime() -> None:
    payload = json.loads((RESULTS / "precision_stress.json").read_text())
    assert (RESULTS / "precision_stress.md").read_text() == precision_stress.markdown(payload)
    assert payload["patterns"]["kinds"] == list(stress_patterns.KINDS)
    assert payload["patterns"]["per_kind"] == stress_patterns.PER_KIND  # measured on today's sets
    [model] = payload["models"]
    assert model["model"] == "csc-denoiser"
    measured = {(r["precision"], r["runtime"]) for r in model["rows"] if "sets" in r}
    skipped = {r["precision"] for r in model["rows"] if "skipped" in r and "runtime" not in r}
    for precision in ("fp16", "int8"):  # built and measured on both runtimes, or refused by its gate (and said so)
        assert precision in skipped or {(precision, "onnxruntime"), (precision, "openvino"),
                                        (precision, "openvino (static shapes)")} <= measured
    for r in model["rows"]:
        for which, s in r.get("sets", {}).items():
            assert s["images"] == len(stress_patterns.KINDS) * stress_patterns.PER_KIND, which
            worst = s["worst_at_gate_levels"]
            assert worst["sigma"] in model["gate_levels"]
            assert s["holds"] == (worst["loss_db"] <= r["tolerance_db"])
