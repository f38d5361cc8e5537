"""The committed ``unroll profile`` benchmark of the demo models (``python -m unroll.benchmarks.profile_bench``) read
back: every workload and way in is there, each search either found a rate meeting its stated objective (with the
level that first failed, or the maximum reached) or says in one line why it could not, the markdown and the
pages' generated block are what the JSON renders, and every plot it links is committed."""

from __future__ import annotations

import json

from unroll.benchmarks import profile_bench as pb
from unroll.benchmarks.common import RESULTS
from unroll.benchmarks.profile import parse_slo

PAYLOAD = json.loads((RESULTS / "profile_bench.json").read_text())


def test_every_workload_and_way_in_was_searched_against_its_stated_objective() -> None:
    want = {(m, s, slo) for m, s, slo, _ in pb.workloads()}
    rows = PAYLOAD["rows"]
    assert {(r["model"], r["size"], r["slo"]) for r in rows} == want
    assert {r["way"] for r in rows} == set(pb.WAYS) and len(rows) == len(want) * len(pb.WAYS)
    for r in rows:
        if "error" in r:
            assert r["error"].startswith("error: ") and "\n" not in r["error"], r
            continue
        best, limit = r["best"], parse_slo(r["slo"]).limits[0]
        assert best is not None and best["offered_rps"] == r["highest_rate_met_rps"], r
        assert best["p99_ms"] <= limit.value, r  # the rate reported met its objective
        assert r["reached_max_rate"] or r["first_failed_rps"] > r["highest_rate_met_rps"], r
        assert best["client_cpu_ms_per_request"] > 0 and best["service_cpu"]["processes"]["gateway"] == 2, r
        assert (RESULTS / r["plot"]).stat().st_size > 0


def test_the_markdown_and_the_docs_block_are_generated_from_the_json() -> None:
    md = pb.markdown(PAYLOAD)
    assert (RESULTS / "profile_bench.md").read_text() == md
    page = (pb.ROOT / "docs" / "profiling.md").read_text()
    begin, end = pb.BLOCK
    block = page[page.index(begin) + len(begin):page.index(end)]
    assert block.strip() == md.replace("](profile_bench-", "](benchmarks/results/profile_bench-").strip()
