"""A small soak (the committed one is `unroll bench soak`, 10,000 requests): real `unroll serve`, phase 1 kills the
denoiser's Python-backend stub under 512×512 denoise load (issue 22: Triton crashed), phase 2 sends mixed traffic at
concurrency 32 and kills tritonserver halfway through each round; three rounds of each, nothing lost in any, traffic
recovers each time; phase 3 stops tritonserver (SIGSTOP) and phase 4 deploys a new version of the classifier, both
under load; phase 5 does it all again against `unroll serve --standby` (a warm second tritonserver): the kills cost
(next to) no 503, the stall is answered by the other server, the deployment reaches both; nothing left behind."""

from __future__ import annotations

import pytest

from unroll.benchmarks import soak, soak_ops, soak_stub

#: How long a restart may take here before the test calls it stuck. The 3 s target (soak_stub.TARGET_503_S) is a
#: speed target, held by the committed run (test_committed_soak_results_show_both_phases_met_their_targets), not by
#: this test: on a machine twice as slow, or with its cores shared, a restart takes twice as long and is still right.
STUCK_S = 15.0


#: Kills per phase in the test: the lost request of issue 42 showed once in a thousand; each round is a new chance.
ROUNDS = 3


@pytest.mark.triton
@pytest.mark.slow
@pytest.mark.timeout(900)  # about 2 minutes here; a machine twice as slow, with its cores shared, takes 3 times that
def test_soak_with_killed_backend_processes_and_killed_tritons_loses_nothing_and_leaves_nothing() -> None:
    p = soak.run(requests=3_000, concurrency=32, out_dir=None, rounds=ROUNDS)
    summary = {k: p[k] for k in ("status_counts", "error_codes", "lost_examples", "rounds", "left_processes",
                                 "orphans", "leaked_shm")}
    stubs = p["stub_kills"]
    assert len(stubs) == ROUNDS, stubs
    for stub in stubs:  # phase 1: each dead backend process costs 503s (Retry-After) for a while, never a request
        assert stub["kill"]["done"] and stub["lost"] == 0, stub
        assert stub["unavailable_503"] == stub["unavailable_with_retry_after"], stub
        assert stub["unavailable_net_s"] < STUCK_S, stub
        assert stub["requests_after_recovery"] >= soak_stub.SERVED_AFTER, stub
        assert stub["triton_replaced"] and stub["stub_loss_logged"], stub  # the supervisor acted, not luck
    # phase 2: tritonserver killed once per round, nothing lost in any
    assert len(p["rounds"]) == ROUNDS and all(r["lost"] == 0 for r in p["rounds"]), summary
    assert p["lost"] == 0, summary
    assert p["unavailable_503"] == p["unavailable_with_retry_after"], summary  # every 503 says when to retry
    assert all(r["requests_after_recovery"] >= soak.AFTER_RECOVERY and r["recovery_s"] - r["restart_backoff_s"] < 15
               for r in p["rounds"]), summary
    assert not p["left_processes"] and not p["orphans"] and not p["leaked_shm"], summary
    assert p["restart_logged"] and p["shm_regions_seen"] > 0, summary
    # phase 3: a stopped tritonserver is answered for (503) within about the stall detection, not waited out
    stall = p["stall"]
    assert stall["lost"] == 0 and stall["unavailable_503"] == stall["unavailable_with_retry_after"] > 0, stall
    assert stall["longest_wait_s"] < soak_ops.STALL_S - 2, stall  # answered while it was stopped, not after
    assert not stall["triton_replaced"] and stall["served_after"] > 0, stall
    # phase 4: a model update under load loses nothing and replaces no server
    deploy = p["deploy"]
    assert deploy["deploy_rc"] == 0 and deploy["lost"] == 0 and deploy["unavailable_503"] == 0, deploy
    assert not deploy["triton_replaced"], deploy


@pytest.mark.triton
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_with_a_warm_standby_the_same_faults_lose_nothing_and_the_deployment_reaches_both_servers() -> None:
    """Phase 5 (one kill of each kind) against `unroll serve --standby`, as the soak runs it."""
    from unroll import tasks
    from unroll.benchmarks.common import demo_model

    sb = soak.standby_phase(demo_model(tasks.CLASSIFICATION), demo_model(tasks.DENOISING), rounds=1, requests=1_000,
                            concurrency=32, log=lambda m: None)
    # the same faults lose nothing; a stopped server's traffic goes to the other while it is still stopped; the
    # deployment reaches both servers; nothing is left behind
    assert sb["lost"] == 0 and sb["longest_503_s"] < STUCK_S, {k: sb[k] for k in ("stub_kills", "rounds")}
    assert all(x["triton_replaced"] for x in sb["stub_kills"]), sb["stub_kills"]  # the supervisor replaced it
    assert sb["stall"]["served_while_stopped"] > 0 and not sb["stall"]["triton_replaced"], sb["stall"]
    assert sb["deploy"]["deploy_rc"] == 0 and sb["same_versions_everywhere"], (sb["deploy"], sb["versions"])
    assert all(v == [2] for v in sb["versions"].values()), sb["versions"]
    assert len(sb["memory_mb"]) == 2 and all(m > 0 for m in sb["memory_mb"].values()), sb["memory_mb"]
    assert not sb["left_processes"] and not sb["orphans"] and not sb["leaked_shm"], sb


def test_committed_soak_results_lose_nothing_in_any_phase() -> None:
    """The committed run (benchmarks/results/soak.json, what the README quotes): three rounds of each kill, nothing
    lost in any phase or round, the stall answered and the deployment clean. The 3 s target of phase 1 is reported per
    round, met or not (without a standby a restart loads every model, 2-6 s here), never asserted here; with a standby
    (phase 5) the target is the claim, and is asserted."""
    import json

    from unroll.benchmarks.common import RESULTS

    p = json.loads((RESULTS / "soak.json").read_text())
    stubs = p.get("stub_kills")
    assert stubs, "soak.json predates the rounds of the backend-process phase: rerun `unroll bench soak`"
    assert len(stubs) == len(p["rounds"]) == p["kill"]["rounds"] >= 3, p["kill"]
    for stub in stubs:
        assert stub["lost"] == 0 and stub["target_503_s"] == soak_stub.TARGET_503_S, stub
        assert stub["passed"] == (stub["unavailable_net_s"] <= stub["target_503_s"] and
                                  stub["requests_after_recovery"] >= soak_stub.SERVED_AFTER), stub
    assert all(r["lost"] == 0 for r in p["rounds"]) and p["lost"] == 0, p["rounds"]
    assert p["stall"]["passed"] and p["deploy"]["passed"], (p["stall"], p["deploy"])
    sb = p.get("standby")
    assert sb and len(sb["stub_kills"]) == len(sb["rounds"]) >= 3, "soak.json has no phase 5: rerun `unroll bench soak`"
    # issue 38 item 6's claim: with a standby, every kill's 503s end within the target (3 s), nothing lost
    assert sb["passed"] and sb["lost"] == 0 and sb["longest_503_s"] <= sb["target_503_s"], sb
    assert p["passed"] and p["stub_target_met_by"] == "standby", p["stub_target_met_by"]
    assert not p["left_processes"] and not p["leaked_shm"] and not p["orphans"], p


def test_readme_soak_paragraph_is_the_one_generated_from_the_committed_results() -> None:
    """The README quotes the soak through :func:`soak.readme_paragraph` (`unroll bench soak` writes it), not by hand."""
    import json

    from unroll.benchmarks.common import RESULTS

    readme = (RESULTS.parent.parent / "README.md").read_text()
    start, end = readme.index(soak.README_BEGIN) + len(soak.README_BEGIN), readme.index(soak.README_END)
    p = json.loads((RESULTS / "soak.json").read_text())
    assert readme[start:end].strip() == soak.readme_paragraph(p)
