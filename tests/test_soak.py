"""A small soak (the committed one is `unroll bench soak`, 10,000 requests): real `unroll serve`, mixed traffic
at concurrency 32, tritonserver killed halfway; nothing lost, traffic recovers, nothing left behind."""

from __future__ import annotations

import pytest
from unroll.benchmarks import soak


@pytest.mark.triton
@pytest.mark.slow
def test_soak_with_a_triton_kill_loses_nothing_and_leaves_nothing() -> None:
    p = soak.run(requests=1_000, concurrency=32, out_dir=None)
    summary = {k: p[k] for k in ("status_counts", "error_codes", "lost_examples", "recovery_s",
                                 "requests_after_recovery", "left_processes", "orphans", "leaked_shm")}
    assert p["lost"] == 0, summary
    assert p["unavailable_503"] == p["unavailable_with_retry_after"], summary  # every 503 says when to retry
    assert p["requests_after_recovery"] >= 100 and p["recovery_s"] < 15, summary
    assert not p["left_processes"] and not p["orphans"] and not p["leaked_shm"], summary
    assert p["restart_logged"] and p["shm_regions_seen"] > 0 and p["passed"], summary
