"""A small soak (the committed one is `unroll bench soak`, 10,000 requests) on the default `unroll serve` (a warm
standby where this machine's memory allows it): phase 1 kills the denoiser's Python-backend stub under 512×512
denoise load and the classifier's under classify load, phase 2 sends mixed traffic at concurrency 32 and kills
tritonserver halfway through each round; three rounds of each, nothing lost in any, traffic recovers each time; phase
3 stops tritonserver (SIGSTOP) and phase 4 deploys a new version of the classifier, both under load; phase 5 kills
the same on `unroll serve --no-standby` (one server, replaced whole: 503s each time); nothing left behind. The
committed results are checked from their raw data: the times of the non-200 answers after each kill."""

from __future__ import annotations

import json

import pytest
from readme_blocks import generated

from unroll.benchmarks import soak, soak_ops, soak_stub
from unroll.benchmarks.common import RESULTS

#: How long a fault window may last here before the test calls the service stuck. The 3 s target
#: (soak_stub.TARGET_503_S) is a speed target, held by the committed run (test_committed_soak_...), not by these tests:
#: on a machine twice as slow, or with its cores shared, a restart takes twice as long and is still right.
STUCK_S = 15.0
#: Kills per phase in the test: the lost request of issue 42 showed once in a thousand; each round is a new chance.
ROUNDS = 3
#: The issues' figure (22, 55): the longest a fault may cost clients non-200 answers.
ISSUE_TARGET_S = 3.0


def window_from(offsets: list[float]) -> float:
    """The fault window from its raw data, as issue 55 defines it: from the kill (time 0) or the first non-200 answer,
    whichever is earlier, to the last non-200 answer; 0 when there was none."""
    return max(offsets) - min(0.0, min(offsets)) if offsets else 0.0


@pytest.mark.triton
@pytest.mark.slow
@pytest.mark.timeout(900)  # about 3 minutes here; a machine twice as slow, with its cores shared, takes 3 times that
def test_soak_on_the_default_deployment_loses_nothing_and_leaves_nothing() -> None:
    p = soak.run(requests=3_000, concurrency=32, out_dir=None, rounds=ROUNDS)
    summary = {k: p[k] for k in ("deployment", "status_counts", "error_codes", "lost_examples", "left_processes",
                                 "orphans", "leaked_shm")}
    d = p["deployment"]
    # the default chose and said so; what it runs is what it said
    assert d["choice"].startswith(("standby: on (auto)", "standby: off (auto)")), d
    assert d["servers"] == (2 if d["standby"] else 1) == len(d["memory_mb"]["ready"]), d
    assert all(mb > 0 for mb in d["memory_mb"]["ready"].values()), d
    stubs = p["stub_kills"]
    assert len(stubs) == 2 * ROUNDS and {x["model"] for x in stubs} == set(p["models"].values()), stubs
    for stub in stubs:  # phase 1: a dead backend process costs at most 503s (Retry-After) for a while, never a request
        assert stub["kill"]["done"] and stub["lost"] == 0, stub
        assert stub["unavailable_503"] == stub["unavailable_with_retry_after"], stub
        assert stub["window_s"] < STUCK_S, stub
        assert stub["requests_after_recovery"] >= soak_stub.SERVED_AFTER, stub
        assert stub["triton_replaced"] and stub["stub_loss_logged"], stub  # the supervisor acted, not luck
        if not d["standby"]:  # one server: its replacement shows as 503s
            assert stub["unavailable_503"] > 0, stub
    # phase 2: tritonserver killed once per round, nothing lost in any, traffic recovered after each
    assert len(p["rounds"]) == ROUNDS and all(r["lost"] == 0 for r in p["rounds"]), summary
    assert p["lost"] == 0 and p["unavailable_503"] == p["unavailable_with_retry_after"], summary
    assert all(r["recovered"] and r["requests_after_recovery"] >= soak.AFTER_RECOVERY and r["window_s"] < STUCK_S
               for r in p["rounds"]), p["rounds"]
    assert not p["left_processes"] and not p["orphans"] and not p["leaked_shm"], summary
    assert p["restart_logged"] and p["shm_regions_seen"] > 0, summary
    # phase 3: a stopped tritonserver is answered for (503) within about the stall detection, not waited out
    stall = p["stall"]
    assert stall["lost"] == 0 and stall["unavailable_503"] == stall["unavailable_with_retry_after"] > 0, stall
    assert stall["longest_wait_s"] < soak_ops.STALL_S - 2, stall  # answered while it was stopped, not after
    assert not stall["triton_replaced"] and stall["served_after"] > 0, stall
    if d["standby"]:  # the other server answers while this one is still stopped
        assert stall["served_while_stopped"] > 0, stall
    # phase 4: a model update under load loses nothing, replaces no server, and reaches every server
    deploy = p["deploy"]
    assert deploy["deploy_rc"] == 0 and deploy["lost"] == 0 and deploy["unavailable_503"] == 0, deploy
    assert not deploy["triton_replaced"], deploy
    assert len(deploy["versions"]) == d["servers"] and all(v == [2] for v in deploy["versions"].values()), deploy


@pytest.mark.triton
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_without_a_standby_each_kill_replaces_the_one_server_with_503s_and_loses_nothing() -> None:
    """Phase 5 (one kill of each kind) on `unroll serve --no-standby`, as the soak runs it: the single server's
    restart path, whose 503s the standby saves."""
    from unroll import tasks
    from unroll.benchmarks.common import demo_model

    ns = soak.no_standby_phase(demo_model(tasks.CLASSIFICATION), demo_model(tasks.DENOISING), rounds=1,
                               requests=1_000, concurrency=32, log=lambda m: None)
    assert ns["choice"].startswith("standby: off (--no-standby"), ns["choice"]
    assert len(ns["memory_mb"]) == 1 and all(m > 0 for m in ns["memory_mb"].values()), ns["memory_mb"]
    assert ns["lost"] == 0 and ns["correct"], {k: ns[k] for k in ("stub_kills", "rounds")}
    assert len(ns["stub_kills"]) == 2 and len(ns["rounds"]) == 1, ns
    for kill in [*ns["stub_kills"], *ns["rounds"]]:  # one server: every kill costs 503s until it is replaced
        assert kill["unavailable_503"] > 0 and 0 < kill["window_s"] < STUCK_S, kill
        assert kill["unavailable_503"] == kill["unavailable_with_retry_after"], kill
    assert all(x["triton_replaced"] and x["stub_loss_logged"] for x in ns["stub_kills"]), ns["stub_kills"]
    assert not ns["left_processes"] and not ns["orphans"] and not ns["leaked_shm"], ns


def test_committed_soak_results_meet_the_fault_window_on_the_default_deployment() -> None:
    """The committed run (benchmarks/results/soak.json, what the README quotes), re-judged from its raw data: every
    kill's fault window is computed again from the times of its non-200 answers (not taken from the verdicts), and
    the default deployment's must be within the issues' 3 s with nothing lost; the back-off is not subtracted (the
    recorded window is the raw one); phase 5's met/not met count is the raw count."""
    p = json.loads((RESULTS / "soak.json").read_text())
    assert "deployment" in p and "no_standby" in p, "soak.json predates the default standby: rerun `unroll bench soak`"
    assert soak_stub.TARGET_503_S == p["target_503_s"] == ISSUE_TARGET_S
    d = p["deployment"]
    kills = [*p["stub_kills"], *p["rounds"]]
    assert len(p["stub_kills"]) == 2 * len(p["rounds"]) == 2 * p["kill"]["rounds"] >= 6, p["kill"]
    assert {x["model"] for x in p["stub_kills"]} == set(p["models"].values()), p["stub_kills"]
    for kill in kills:
        derived = window_from(kill["non200_s"])
        assert kill["window_s"] == pytest.approx(derived, abs=0.011), kill  # the raw window, backoff included
        assert derived <= ISSUE_TARGET_S and kill["lost"] == 0, kill
        assert kill["requests_after_recovery"] > 0, kill
    for phase in (p["stall"], p["deploy"]):  # the stop and the deployment, judged the same way
        assert window_from(phase["non200_s"]) <= ISSUE_TARGET_S and phase["lost"] == 0, phase
    assert p["deploy"]["deploy_rc"] == 0 and len({tuple(v) for v in p["deploy"]["versions"].values()}) == 1, p["deploy"]
    # what the default ran, and what each server held
    assert d["servers"] == len(d["memory_mb"]["ready"]) == (2 if d["standby"] else 1), d
    assert d["choice"].startswith("standby: on (auto)" if d["standby"] else "standby: off (auto)"), d
    # phase 5, --no-standby: shown against the same target, met or not, from the raw windows; nothing lost
    ns = p["no_standby"]
    nkills = [*ns["stub_kills"], *ns["rounds"]]
    assert len(nkills) == ns["kills"] >= 6 and len(ns["memory_mb"]) == 1, ns["kills"]
    assert ns["windows_met"] == sum(window_from(k["non200_s"]) <= ISSUE_TARGET_S for k in nkills), ns
    assert ns["lost"] == 0 == sum(k["lost"] for k in nkills), ns
    assert all(k["unavailable_503"] > 0 for k in nkills), "one server: every kill should have cost 503s"
    assert p["passed"] and not p["left_processes"] and not p["leaked_shm"] and not p["orphans"], p


def test_readme_soak_paragraphs_are_the_ones_generated_from_the_committed_results() -> None:
    """The README quotes the soak through :func:`soak.readme_paragraph` and :func:`soak.readme_standby_paragraph`
    (`unroll bench soak` writes both), not by hand."""
    p = json.loads((RESULTS / "soak.json").read_text())
    for begin, end, text in ((soak.README_BEGIN, soak.README_END, soak.readme_paragraph(p)),
                             (soak.STANDBY_BEGIN, soak.STANDBY_END, soak.readme_standby_paragraph(p))):
        for block in generated(begin, end):
            assert block == text
