"""Anytime serving (serving/gateway/anytime.py): under an objective, a request that pins no ``iters`` gets the largest
count predicted to answer in time; without one, the trained count, as before.

Real parts: a user's classifier whose cost is its solver's (tests/anytime_model.py) exported with every served
count, a real tritonserver on ONNX Runtime, real gateway processes, open-loop Poisson load from the project's engine.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from served import png

from unroll.benchmarks import loadgen
from unroll.benchmarks.serve_triton import triton_server
from unroll.card import IterCard
from unroll.errors import SettingsError
from unroll.serving.gateway.anytime import Family, _Flight
from unroll.serving.gateway.process import gateway_process
from unroll.serving.gateway.settings import Settings

sys.path.insert(0, str(Path(__file__).parent))
import anytime_model  # noqa: E402  (the test's own model: tests/ is not a package)

NAME = "solver-classifier"
COUNTS = (*anytime_model.SERVED, anytime_model.TRAINED)


# ---------------------------------------------------------------------------------------------- the estimator alone


def test_the_estimator_picks_the_largest_count_that_fits_and_learns_from_answers() -> None:
    fam = Family(COUNTS, anytime_model.TRAINED)
    assert fam.pick(1.0, 10.0) == 8  # nothing learned: the trained count
    for k, ms in ((1, 2.0), (2, 3.0), (4, 5.0), (8, 9.0)):
        fam.cost_ms[k] = ms
    # HEADROOM (0.7) of the time left: 9 ms fits in 13, not in 10
    assert fam.pick(1.0, 13.0) == 8 and fam.pick(1.0, 10.0) == 4 and fam.pick(1.0, 1.0) == 1
    a, b = _Flight(8, 1.0, 9.0, 0.0), _Flight(8, 1.0, 9.0, 0.0)
    assert fam.start(a) == 0.0 and fam.start(b) == 9.0
    assert fam.predict_ms(1, 1.0) == pytest.approx(18.0 + 2.0)
    assert fam.pick(1.0, 15.0) == 1  # 18 ms ahead, drained at 1 ms per ms: nothing fits, the lowest
    # both answered 9 ms after they started: 18 ms of work in 9 ms busy, the backend answers two at once
    fam.finish(a, 0.0, 0.009, True)
    fam.finish(b, 9.0, 0.009, True)
    assert fam.parallel == pytest.approx(18.0 / 9.0) and fam.cost_ms[8] == pytest.approx(9.0)
    c, d = _Flight(8, 1.0, 9.0, 1.0), _Flight(8, 1.0, 9.0, 1.0)
    fam.start(c), fam.start(d)
    fam.finish(c, 0.0, 1.009, True)
    fam.finish(d, 9.0, 1.009, True)  # the idle second between the pairs is not busy time: the rate stays 2
    assert fam.parallel == pytest.approx(36.0 / 18.0), list(fam.drained)
    assert not fam.flights
    e = _Flight(4, 1.0, 5.0, 2.0)
    fam.start(e)
    fam.finish(e, 0.0, 2.007, True)  # alone: 4's service time is now measured, the median of what it took
    assert fam.cost_ms[4] == pytest.approx(7.0)
    for t in (0.1, 0.2, 0.3):  # a cold start's outlier (the first answer took 100 ms) does not stay the estimate
        fam.start(f := _Flight(2, 1.0, 3.0, t))
        fam.finish(f, 0.0, t + (0.1 if t == 0.1 else 0.003), True)
    assert fam.cost_ms[2] == pytest.approx(3.0)
    # predictions that came out short (an answer took twice its predicted latency) raise the next ones
    before = fam.predict_ms(8, 1.0)
    fam.start(g := _Flight(8, 1.0, 9.0, 3.0, latency_ms=9.0))
    fam.finish(g, 9.0, 3.018, True)
    assert fam.bias == pytest.approx(0.8 + 0.2 * 2.0) and fam.predict_ms(8, 1.0) == pytest.approx(1.2 * before)


def test_a_count_never_answered_is_scaled_from_the_nearest_learned_one() -> None:
    fam = Family(COUNTS, 8)
    fam.cost_ms[8] = 18.0
    assert fam.cost(4) == pytest.approx(18.0 * 5 / 9) and fam.cost(1) == pytest.approx(18.0 * 2 / 9)


def test_a_bad_objective_is_a_settings_error_naming_it() -> None:
    with pytest.raises(SettingsError, match="UNROLL_SLO"):
        Settings(slo="p99 under 50")
    with pytest.raises(SettingsError, match="bounds no latency"):
        Settings(slo="errors<=1%")
    assert Settings(slo="p50<=5ms,p99<=0.05s").deadline_ms == 50.0 and Settings().deadline_ms is None


# ---------------------------------------------------------------------------------------------- served for real


@pytest.fixture(scope="module")
def solver_repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The classifier exported at every served count (verified against PyTorch) and its Triton repository:
    (repository, ONNX folder)."""
    from unroll.export.onnx_export import export
    from unroll.export.user_model import card_from_options
    from unroll.serving.repository import write_repository

    root = tmp_path_factory.mktemp("anytime")
    card = card_from_options(NAME, "classification", (1, anytime_model.SIDE, anytime_model.SIDE),
                             {"input": {"resize": "stretch"}, "data": {"test": None}})
    card = card.model_copy(update={"iters": IterCard(served=anytime_model.SERVED)})
    result = export(anytime_model.factory(), card, None, root / "onnx")
    graphs = [NAME, *(c.onnx_path.stem for c in result.companions)]
    assert sorted(graphs) == sorted([NAME, *(f"{NAME}-iters{k}" for k in anytime_model.SERVED)]), graphs
    write_repository("cpu", graphs, root / "repo", onnx_dir=root / "onnx", threads=1)
    return root / "repo", root / "onnx"


@pytest.fixture(scope="module")
def triton(solver_repo: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with triton_server(solver_repo[0], tmp_path_factory.mktemp("anytime-triton") / "triton.log") as (_, grpc):
        yield grpc.removeprefix("grpc://")


def _pixels(i: int) -> np.ndarray:
    """Test image ``i``: gray noise of the model's size, from a seed."""
    return np.random.default_rng(i).integers(0, 256, (anytime_model.SIDE, anytime_model.SIDE), dtype=np.uint8)


def _image(i: int) -> bytes:
    return png(_pixels(i))


def _service_ms(gateway: str, k: int, n: int = 20) -> float:
    """Median latency of ``n`` requests sent one at a time at count ``k``, as the gateway reports it."""
    with httpx.Client(base_url=gateway, timeout=30) as c:
        ms = [float(c.post(f"/v1/classify?model={NAME}&iters={k}", content=_image(j),
                           headers={"Content-Type": "image/png"}).headers["X-Latency-Ms"]) for j in range(n)]
    return float(np.median(ms))


def _counter(gateway: str, metric: str, labels: tuple[str, ...]) -> dict[tuple[str, ...], float]:
    """A counter's values from the gateway's /metrics, keyed by the values of ``labels`` in that order."""
    text = httpx.get(f"{gateway}/metrics", timeout=10).text
    out = {}
    for m in re.finditer(rf"^{metric}_total\{{([^}}]*)\}} ([0-9.e+]+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out[tuple(found[k] for k in labels)] = float(m.group(2))
    return out


def _served(gateway: str) -> dict[tuple[str, ...], float]:
    """Answers per (model, count, who set it), requests pinning a count left out."""
    got = _counter(gateway, "unroll_gateway_iters_served", ("model", "iters", "set_by"))
    return {key: v for key, v in got.items() if key[2] != "pinned"}


def _overload(gateway: str, rate: float, duration_s: float = 4.0, query: str = "") -> loadgen.LevelResult:
    payloads = [loadgen.Payload(f"/v1/classify?model={NAME}{query}", _image(i), {"Content-Type": "image/png"})
                for i in range(8)]
    return loadgen.run(gateway, payloads, loadgen.Load(rate=rate, arrivals="poisson"), duration_s=duration_s,
                       warmup_s=0.5, timeout_s=60)


def test_above_capacity_an_objective_gets_lower_counts_and_meets_it_and_without_one_it_queues(
        triton: str, tmp_path: Path) -> None:
    with gateway_process(Settings(triton_url=triton), tmp_path / "plain.log") as plain:
        trained, lowest = _service_ms(plain, 8), _service_ms(plain, 1)
        assert trained > 2.5 * lowest, (trained, lowest)  # the count decides the cost (else nothing to buy)
        deadline = 4.0 * trained
        rate = 1.6 * 1e3 / trained  # above the trained count's capacity, within the lowest count's
        queued = _overload(plain, rate)
        served = _served(plain)
    assert queued.percentile(99) > deadline, (queued.percentile(99), deadline)  # the queue grows, as today
    assert set(served) == {(NAME, "8", "default")}, served
    with gateway_process(Settings(triton_url=triton, slo=f"p99<={deadline:.0f}ms"), tmp_path / "slo.log") as held:
        _service_ms(held, 8, n=10)  # the trained count learned on an idle server (as a deployment's first minutes)
        level = _overload(held, rate)
        served = _served(held)
        misses = _counter(held, "unroll_gateway_objective_misses", ("model",)).get((NAME,), 0.0)
        listing = httpx.get(f"{held}/v1/models", timeout=10).json()
    good = sum(1 for x in level.latencies_ms if x <= deadline) / level.sent
    assert level.ok == level.sent and good >= 0.97, (good, level.percentile(99), deadline, served)
    lower = sum(v for (m, k, by), v in served.items() if by == "controller" and int(k) < 8)
    assert lower > 0.3 * level.sent, served
    answered = sum(served.values())
    assert misses <= 0.03 * answered + 1, (misses, answered)
    (entry,) = [m for m in listing["models"] if m["name"] == NAME]
    anytime = entry["anytime"]
    assert anytime["objective"] == f"p99<={deadline:.0f}ms" and anytime["deadline_ms"] == pytest.approx(
        round(deadline))
    learned = {r["iters"]: r["service_ms"] for r in anytime["counts"]}
    assert set(learned) == set(COUNTS) and learned[8] is not None and anytime["service_ms_per"] == "request"


def test_a_pinned_count_is_honoured_under_load_and_every_answer_names_the_graph_that_served_it(
        triton: str, solver_repo: tuple[Path, Path], tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    sessions = {k: ort.InferenceSession(str(solver_repo[1] / (NAME if k == 8 else f"{NAME}-iters{k}")) + ".onnx")
                for k in COUNTS}
    with gateway_process(Settings(triton_url=triton, slo="p99<=30ms"), tmp_path / "g.log") as gateway:
        client = httpx.Client(base_url=gateway, timeout=60)

        def send(i: int) -> httpx.Response:
            q = "&iters=8" if i % 3 == 0 else ""
            return client.post(f"/v1/classify?model={NAME}&top_k=10{q}", content=_image(i % 8),
                               headers={"Content-Type": "image/png"})

        with ThreadPoolExecutor(12) as pool:  # a burst: the controller lowers the counts it may choose
            answers = list(pool.map(send, range(120)))
    seen = set()
    for i, r in enumerate(answers):
        assert r.status_code == 200, r.text
        k, by = int(r.headers["X-Iters"]), r.headers["X-Iters-Set-By"]
        assert (k, by) == (r.json()["iters"], r.json()["iters_set_by"])
        if i % 3 == 0:
            assert (k, by) == (8, "pinned")
        else:
            assert by == "controller"
        seen.add(k)
        # the answer is that count's graph's: its top-10 scores are the softmax of that graph's logits
        x = _fitted(i % 8)
        logits = sessions[k].run(None, {sessions[k].get_inputs()[0].name: x})[0][0]
        p = np.exp(logits - logits.max())
        p /= p.sum()
        got = {int(e["index"]): e["score"] for e in r.json()["predictions"]}
        assert max(abs(got[j] - p[j]) for j in range(10)) < 1e-4, (k, got, p)
    assert len(seen) > 1, seen  # the burst did move the chosen counts


def _fitted(i: int) -> np.ndarray:
    """Image ``i`` as the gateway feeds the graph: gray, [0, 1], already 64×64 (``stretch`` keeps it)."""
    return (_pixels(i).astype(np.float32) / 255.0)[None, None]


def test_without_an_objective_nothing_changes_and_a_deadline_is_refused_where_nothing_can_be_traded(
        triton: str, demo_gateway: httpx.Client, tmp_path: Path) -> None:
    with gateway_process(Settings(triton_url=triton), tmp_path / "g.log") as gateway:
        r = httpx.post(f"{gateway}/v1/classify?model={NAME}", content=_image(0),
                       headers={"Content-Type": "image/png"}, timeout=30)
        assert r.status_code == 200 and (r.headers["X-Iters"], r.headers["X-Iters-Set-By"]) == ("8", "default")
        for bad in ("0", "-3", "soon", "inf", "nan"):
            r = httpx.post(f"{gateway}/v1/classify?model={NAME}&deadline_ms={bad}", content=_image(0),
                           headers={"Content-Type": "image/png"}, timeout=30)
            assert r.status_code == 422 and "deadline_ms" in r.json()["error"]["message"], (bad, r.text)
        r = httpx.post(f"{gateway}/v1/classify?model={NAME}&deadline_ms=1000", content=_image(0),
                       headers={"Content-Type": "image/png"}, timeout=30)
        assert r.status_code == 200 and r.headers["X-Iters-Set-By"] == "controller" and r.headers["X-Iters"] == "8"
    noisy = np.random.default_rng(0).integers(0, 256, (32, 32), dtype=np.uint8)
    r = demo_gateway.post("/v1/denoise?model=csc-denoiser&sigma=25&deadline_ms=50", content=png(noisy),
                          headers={"Content-Type": "image/png"})
    assert r.status_code == 422 and "no cheaper answer" in r.json()["error"]["message"], r.text


@pytest.mark.triton
@pytest.mark.slow
def test_under_unroll_serve_with_two_workers_the_objective_is_held_and_every_answer_says_its_count(
        solver_repo: tuple[Path, Path], tmp_path: Path) -> None:
    """The feature as a user runs it: `unroll serve --slo` on non-default ports with two gateway workers, each
    seeing only its own share of the queue."""
    from unroll.benchmarks.soak import start_serve, stop_serve

    s = ort.InferenceSession(str(solver_repo[1] / f"{NAME}.onnx"))
    x = _fitted(0)
    ms = []
    for _ in range(20):
        t = time.perf_counter()
        s.run(None, {s.get_inputs()[0].name: x})
        ms.append(1e3 * (time.perf_counter() - t))
    deadline = max(40.0, 5.0 * (float(np.median(ms)) + 2.0))  # the graph's own time plus the gateway's, 5×
    serve = start_serve(tmp_path, [NAME], log=lambda m: None, onnx_dir=solver_repo[1],
                        args=("--workers", "2", "--slo", f"p99<={deadline:.0f}ms"))
    try:
        listing = httpx.get(f"{serve.base}/v1/models", timeout=10).json()
        (entry,) = [m for m in listing["models"] if m["name"] == NAME]
        assert entry["anytime"]["objective"] == f"p99<={deadline:.0f}ms", entry["anytime"]
        trained = _service_ms(serve.base, 8)  # pinned: learns nothing for the controller's own choice yet
        _service_ms(serve.base, 1, n=4)
        for _ in range(4):  # requests that pin nothing, one at a time: each worker learns the trained count
            r = httpx.post(f"{serve.base}/v1/classify?model={NAME}", content=_image(1),
                           headers={"Content-Type": "image/png"}, timeout=30)
            assert (r.headers["X-Iters"], r.headers["X-Iters-Set-By"]) == ("8", "controller"), r.headers
        rate = 1.3 * 1e3 / trained  # above the trained count's capacity; the lowest count still keeps up
        level = _overload(serve.base, rate)
        served = _served(serve.base)  # the workers' counters, added up
        pinned = _overload(serve.base, rate, query="&iters=8")  # the same load at the trained count: a queue
    finally:
        stop_serve(serve)
    good, good_pinned = (sum(1 for v in lv.latencies_ms if v <= deadline) / lv.sent for lv in (level, pinned))
    # Two workers each see half the queue: the objective is held less tightly than by one (the first test), and
    # still with at least 5× fewer misses than the trained count queueing at the same rate.
    assert level.ok == level.sent and (1 - good) <= 0.2 * (1 - good_pinned), (
        good, good_pinned, level.percentile(99), deadline, served)
    lower = sum(v for (m, k, by), v in served.items() if by == "controller" and int(k) < 8)
    assert lower > 0.3 * level.sent, served
