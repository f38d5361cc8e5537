"""The load engine against perf_analyzer on the gateway's ``/v2`` front (issue 57, item 6).

The committed result (``python -m unroll.benchmarks.profile_agreement``) is read back: its differences are the
ones its numbers give, its verdict the one they give against the bar, its markdown the one its JSON renders. The
full tier runs both clients for real on a short window: perf_analyzer must be able to drive the gateway (server
metadata, config, statistics, binary infer) and the engine must send the same rate; the timing verdict belongs to
the benchmark run on a quiet machine, not to a test on a shared one.
"""

from __future__ import annotations

import json

import pytest

from unroll.benchmarks import perf_analyzer as pa
from unroll.benchmarks import profile_agreement as agreement
from unroll.benchmarks.common import RESULTS

RESULT = RESULTS / "profile_agreement.json"


def test_the_committed_agreement_is_what_its_numbers_say() -> None:
    payload = json.loads(RESULT.read_text())
    assert payload["tolerance"] == agreement.TOLERANCE
    assert {lv["distribution"] for lv in payload["levels"]} == set(agreement.DISTRIBUTIONS)
    assert {lv["rate_rps"] for lv in payload["levels"]} == set(agreement.RATES)  # the default command's levels
    worst = 0.0
    for lv in payload["levels"]:
        ref, eng = lv["perf_analyzer"], lv["engine"]
        assert ref["stable"] and not eng["errors"], lv
        assert lv["p50_diff"] == pytest.approx(eng["p50_ms"] / ref["p50_ms"] - 1)
        assert lv["throughput_diff"] == pytest.approx(eng["throughput_rps"] / ref["throughput_rps"] - 1)
        assert eng["client_cpu_ms_per_request"] > 0
        worst = max(worst, abs(lv["p50_diff"]), abs(lv["throughput_diff"]))
    assert payload["worst_diff"] == pytest.approx(worst)
    assert payload["agrees"] == (worst <= agreement.TOLERANCE)
    assert payload["agrees"], f"the engine is {100 * worst:.1f}% off perf_analyzer"
    assert (RESULTS / "profile_agreement.md").read_text() == agreement.markdown(payload)


@pytest.mark.triton
@pytest.mark.slow
def test_perf_analyzer_and_the_engine_both_drive_the_gateways_v2_front() -> None:
    if pa.find() is None:  # `make test` sets it up (scripts/perf_analyzer_setup.sh); tests/test_perf_analyzer.py too
        pytest.skip(pa.missing_reason())
    payload = agreement.run(rates=(30.0,), distributions=("poisson",), window_ms=1500, log=lambda _: None)
    (lv,) = payload["levels"]
    ref, eng = lv["perf_analyzer"], lv["engine"]
    assert ref["throughput_rps"] > 0 and ref["p50_ms"] > 0, ref
    assert eng["sent"] > 0 and not eng["errors"] and eng["p50_ms"] > 0, eng
    assert "--request-rate-range 30:30" in ref["command"] and "-i http" in ref["command"], ref
