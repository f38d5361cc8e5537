"""A small soak (the committed one is `unroll bench soak`, 10,000 requests): real `unroll serve`, phase 1 kills the
denoiser's Python-backend stub under 512×512 denoise load (issue 22: Triton crashed), phase 2 sends mixed traffic at
concurrency 32 and kills tritonserver halfway; nothing lost, traffic recovers, nothing left behind."""

from __future__ import annotations

import pytest

from unroll.benchmarks import soak, soak_stub

#: Phase 1's 503s may last this much longer than the committed target here: this machine's cores are shared, and a
#: restart (most of those seconds) slows down with them. The committed run is held to the target itself.
SHARED_MACHINE_MARGIN = 1.5


@pytest.mark.triton
@pytest.mark.slow
def test_soak_with_a_killed_backend_process_and_a_killed_triton_loses_nothing_and_leaves_nothing() -> None:
    p = soak.run(requests=1_000, concurrency=32, out_dir=None)
    summary = {k: p[k] for k in ("status_counts", "error_codes", "lost_examples", "recovery_s",
                                 "requests_after_recovery", "left_processes", "orphans", "leaked_shm")}
    stub = p["stub_kill"]
    assert stub is not None and stub["kill"]["done"], stub
    # phase 1: the dead backend process costs 503s (with Retry-After) for a short while, never a lost request
    assert stub["lost"] == 0, stub
    assert stub["unavailable_503"] == stub["unavailable_with_retry_after"], stub
    assert stub["unavailable_s"] <= SHARED_MACHINE_MARGIN * soak_stub.TARGET_503_S, stub
    assert stub["requests_after_recovery"] >= soak_stub.SERVED_AFTER, stub
    assert stub["triton_replaced"] and stub["stub_loss_logged"], stub  # the supervisor acted, not luck
    # phase 2: tritonserver killed
    assert p["lost"] == 0, summary
    assert p["unavailable_503"] == p["unavailable_with_retry_after"], summary  # every 503 says when to retry
    assert p["requests_after_recovery"] >= 100 and p["recovery_s"] < 15, summary
    assert not p["left_processes"] and not p["orphans"] and not p["leaked_shm"], summary
    assert p["restart_logged"] and p["shm_regions_seen"] > 0, summary


def test_committed_soak_results_show_phase_1_met_its_target() -> None:
    """The committed run (benchmarks/results/soak.json, what the README quotes) passed both phases."""
    import json

    from unroll.benchmarks.common import RESULTS

    p = json.loads((RESULTS / "soak.json").read_text())
    stub = p.get("stub_kill")
    assert stub is not None, "soak.json predates the backend-process phase: rerun `unroll bench soak`"
    assert stub["lost"] == 0 and stub["unavailable_s"] <= stub["target_503_s"] == soak_stub.TARGET_503_S, stub
    assert stub["passed"] and p["passed"], {k: p[k] for k in ("lost", "recovery_s", "left_processes", "leaked_shm")}


def test_readme_soak_paragraph_is_the_one_generated_from_the_committed_results() -> None:
    """The README quotes the soak through :func:`soak.readme_paragraph` (`unroll bench soak` writes it), not by hand."""
    import json

    from unroll.benchmarks.common import RESULTS

    readme = (RESULTS.parent.parent / "README.md").read_text()
    start, end = readme.index(soak.README_BEGIN) + len(soak.README_BEGIN), readme.index(soak.README_END)
    p = json.loads((RESULTS / "soak.json").read_text())
    assert readme[start:end].strip() == soak.readme_paragraph(p)
