"""``unroll profile`` and its load engine against real servers (no mocks).

- The arrival schedules have the burstiness they claim: the coefficient of variation of inter-arrival times is ≈ 0
  for constant arrivals, within 10 % of 1 for Poisson and within 10 % of the stated value for gamma (pure schedule).
- A trace of send times is replayed whole, each send at its time; failed requests are counted by HTTP status and
  by cause (a refused connection).
- A real tritonserver serving a Python-backend model of capacity known by construction (one instance; answers
  leave at most one per 10 ms: 100 requests/s) is profiled with ``unroll profile --search``: the highest rate that
  meets ``p99<=50ms`` is within 10 % of 100 req/s, and the JSON/CSV hold the levels and Triton's statistics.
- The same server SIGSTOPped for 1 s in the middle of a level: the open-loop level (latency from each request's
  scheduled send time) shows p99 ≥ the pause, while a closed-loop level at the same mean rate does not (its one slow
  request hides in the tail: coordinated omission) — both measured in the one test.
- Bad use is one ``error:`` line on stderr, a non-zero exit and nothing written: an unreachable URL, a wrong API
  key (a real gateway in front of the server), a model not served (the error names the served ones), an objective
  missed at the lowest rate, a rate the client cannot send.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from unroll.benchmarks import loadgen, nvml
from unroll.benchmarks.profile import Level, parse_slo, pool
from unroll.benchmarks.profile_target import discover
from unroll.errors import BenchError
from unroll.serving.triton import TritonHandle, free_ports, start

SERVICE_MS = 10.0
CAPACITY = 1e3 / SERVICE_MS
UNROLL = str(Path(sys.executable).parent / "unroll")

PACED_MODEL_PY = """import json
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        self.service_s = float(params["service_ms"]["string_value"]) / 1e3
        self.clock = 0.0

    def execute(self, requests):
        out = []
        for _ in requests:
            now = time.monotonic()
            # the next answer leaves one service time after the previous one, or (idle) half of it after now: the
            # slack absorbs the server's own overhead between executions (up to half a service time, on a busy
            # machine too), so a backlog drains at exactly one request per service time
            self.clock = max(self.clock + self.service_s, now + 0.5 * self.service_s)
            time.sleep(max(0.0, self.clock - now))
            out.append(pb_utils.InferenceResponse([]))  # no output tensor: NumPy 2 and the 2.45 stub disagree
        return out
"""
PACED_CONFIG = """name: "paced"
backend: "python"
max_batch_size: 0
input [{{ name: "x" data_type: TYPE_FP32 dims: [4] }}]
output [{{ name: "y" data_type: TYPE_FP32 dims: [4] }}]
instance_group [{{ kind: KIND_CPU count: 1 }}]
parameters {{ key: "service_ms" value: {{ string_value: "{service_ms}" }} }}
"""


@pytest.fixture(scope="module")
def paced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonHandle]:
    """tritonserver on one model of known capacity (:data:`CAPACITY` requests/s), free ports, stopped at the end."""
    root = tmp_path_factory.mktemp("paced")
    (root / "repo" / "paced" / "1").mkdir(parents=True)
    (root / "repo" / "paced" / "1" / "model.py").write_text(PACED_MODEL_PY)
    (root / "repo" / "paced" / "config.pbtxt").write_text(PACED_CONFIG.format(service_ms=SERVICE_MS))
    with start(root / "repo", *free_ports(3), log_file=root / "triton.log", timeout_s=120,
               extra_args=["--exit-timeout-secs=2"]) as handle:
        yield handle


def _url(h: TritonHandle) -> str:
    return f"http://127.0.0.1:{h.http_port}"


def _idle(h: TritonHandle, timeout_s: float = 60.0) -> None:
    """Wait until the paced server answers one request within a few service times: a level an earlier test stopped
    (client-bound) leaves the requests it had sent queued in Triton, which would be the next test's latency."""
    d = discover("triton", _url(h), "paced")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = loadgen.run(d.url, d.payloads, loadgen.Load(concurrency=1), duration_s=0.2, warmup_s=0.0,
                        timeout_s=timeout_s)
        if r.latencies_ms and max(r.latencies_ms) < 5 * SERVICE_MS:
            return
    raise AssertionError(f"the paced server still had a queue after {timeout_s:g} s")


def _profile(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([UNROLL, "profile", *args, "--no-progress"], capture_output=True, text=True,
                          timeout=timeout_s)


def _one_error_line(p: subprocess.CompletedProcess, *words: str) -> str:
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode != 0, (p.stdout, p.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert "Traceback" not in p.stderr + p.stdout
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def test_arrival_schedules_have_the_stated_coefficient_of_variation() -> None:
    span = 60.0
    constant = loadgen.schedule(loadgen.Load(rate=500, arrivals="constant"), span)
    poisson = loadgen.schedule(loadgen.Load(rate=500, arrivals="poisson"), span, seed=1)
    gamma = loadgen.schedule(loadgen.Load(rate=500, arrivals="gamma", cv=2.5), span, seed=2)
    assert loadgen.coefficient_of_variation(constant) < 1e-6
    assert abs(loadgen.coefficient_of_variation(poisson) - 1.0) < 0.1
    assert abs(loadgen.coefficient_of_variation(gamma) - 2.5) < 0.25
    for t in (constant, poisson, gamma):  # the stated mean rate, over the whole span
        assert abs(len(t) / span - 500) < 500 * 0.05 and t[0] >= 0 and t[-1] < span and np.all(np.diff(t) >= 0)


def test_slo_parsing() -> None:
    slo = parse_slo("p99<=20ms, p50<5ms,errors<=1%")
    assert slo is not None and str(slo) == "p99<=20ms,p50<5ms,errors<=1%"
    assert slo.good_ms == 20.0 and slo.limits[2].value == pytest.approx(0.01)
    assert parse_slo("p95<=0.5s").limits[0].value == 500.0  # type: ignore[union-attr]


@pytest.mark.triton
def test_a_trace_is_replayed_on_its_own_schedule(paced: TritonHandle, tmp_path: Path) -> None:
    times = np.cumsum(np.random.default_rng(3).exponential(1 / 40, 80))
    (tmp_path / "trace.txt").write_text("# send times, s\n" + "\n".join(f"{t + 100:.6f}" for t in times) + "\n")
    trace = loadgen.read_trace(tmp_path / "trace.txt")
    assert trace[0] == 0.0 and len(trace) == 80
    d = discover("triton", _url(paced), "paced")
    r = loadgen.run(d.url, d.payloads, loadgen.Load(arrivals="trace", trace=trace), duration_s=0.5, warmup_s=0.2)
    counted = [t for t in trace if t >= 0.2]
    assert r.sent == r.ok == len(counted) and r.client_bound is None  # the whole trace, not cut at --duration
    np.testing.assert_allclose(r.send_times, counted, atol=0.02)  # each send within 20 ms of its time


@pytest.mark.triton
def test_errors_are_counted_by_status_and_cause(paced: TritonHandle) -> None:
    bad = [loadgen.Payload("/v2/models/nope/infer", b"{}", {"Content-Type": "application/json"})]
    r = loadgen.run(_url(paced), bad, loadgen.Load(rate=50, arrivals="constant"), duration_s=0.5, warmup_s=0.1)
    assert r.ok == 0 and sum(r.errors.values()) == r.sent > 10 and list(r.errors)[0].startswith("HTTP 4"), r.errors
    nobody = f"http://127.0.0.1:{free_ports(1)[0]}"
    r = loadgen.run(nobody, bad, loadgen.Load(concurrency=2), duration_s=0.3, warmup_s=0.0, requests=20)
    assert r.errors == {"connect": 20} and r.error_rate == 1.0


@pytest.mark.triton
@pytest.mark.slow
def test_search_finds_the_known_capacity_within_10_percent(paced: TritonHandle, tmp_path: Path) -> None:
    out = tmp_path / "out"
    p = _profile("paced", "--url", _url(paced), "--target", "triton", "--search", "--slo", "p99<=50ms",
                 "--arrivals", "constant", "--start-rate", "30", "--resolution", "0.04", "--duration", "2",
                 "--warmup", "0.5", "--late-tolerance-ms", "30", "--out", str(out))  # other work may share the box
    assert p.returncode == 0, p.stderr
    result = json.loads((out / "paced-profile.json").read_text())
    found = result["search"]["highest_rate_met_rps"]
    assert abs(found - CAPACITY) <= 0.1 * CAPACITY, (found, [(lv["offered_rps"], lv["p99_ms"])
                                                            for lv in result["levels"]])
    assert result["schema_version"] == 1 and result["machine"]["cpu"]
    assert result["search"]["first_failed_rps"] > found and result["search"]["first_failed_why"]
    met = [lv for lv in result["levels"] if lv["slo_met"]]
    assert all(lv["client_bound"] is None for lv in result["levels"])
    # Triton's own split over each level: every request ran alone (batch size 1), the infer step takes ~service
    for lv in met:
        assert lv["triton"]["batch_sizes"] == {"1": lv["triton"]["executions"]}
        assert lv["triton"]["requests"] >= lv["sent"]
        assert 0.4 * SERVICE_MS <= lv["triton"]["compute_infer_ms"] <= 1.5 * SERVICE_MS
    rows = (out / "paced-profile.csv").read_text().splitlines()
    assert len(rows) == 1 + len(result["levels"]) and rows[0].startswith("load,")


@pytest.mark.triton
@pytest.mark.slow
def test_a_pause_shows_as_a_queue_in_open_loop_and_hides_in_closed_loop(paced: TritonHandle) -> None:
    _idle(paced)
    d = discover("triton", _url(paced), "paced")
    rate, pause_s = 0.9 * CAPACITY, 1.0

    def level(load: loadgen.Load) -> loadgen.LevelResult:
        def pause() -> None:
            time.sleep(0.5 + 1.5)  # warm-up, then 1.5 s into the measured window
            os.kill(paced.pid, signal.SIGSTOP)
            try:
                time.sleep(pause_s)
            finally:
                os.kill(paced.pid, signal.SIGCONT)

        t = threading.Thread(target=pause)
        t.start()
        try:
            # Sends late by less than a fifth of the pause can neither make nor hide a queue of the pause's length
            # (latency counts from the scheduled time); the answers that all arrive at SIGCONT delay a few sends.
            return loadgen.run(d.url, d.payloads, load, duration_s=4.0, warmup_s=0.5, timeout_s=10,
                               late_tolerance_ms=1e3 * pause_s / 5)
        finally:
            t.join()

    open_loop = level(loadgen.Load(rate=rate, arrivals="constant"))
    closed = level(loadgen.Load(concurrency=1, rate=rate))  # paced closed loop: the same mean rate when unstalled
    assert not open_loop.errors and not closed.errors, (open_loop.errors, closed.errors)
    assert open_loop.client_bound is None, open_loop.client_bound
    assert open_loop.percentile(99) >= 1e3 * pause_s, open_loop.percentile(99)
    assert max(closed.latencies_ms) >= 1e3 * pause_s  # the stall happened to the closed loop too …
    assert closed.percentile(99) < 0.5e3 * pause_s, closed.percentile(99)  # … and its p99 does not show it
    assert closed.ok < open_loop.ok  # it stopped sending during the pause


@pytest.mark.triton
@pytest.mark.slow
def test_bad_use_is_one_line_a_nonzero_exit_and_nothing_written(paced: TritonHandle, tmp_path: Path) -> None:

    out = tmp_path / "out"
    common = ("--duration", "1", "--warmup", "0.2", "--out", str(out))
    nobody = f"http://127.0.0.1:{free_ports(1)[0]}"
    _one_error_line(_profile("paced", "--url", nobody, "--rate-range", "10", *common), "cannot reach", nobody)
    _one_error_line(_profile("nope", "--url", _url(paced), "--target", "triton", "--rate-range", "10", *common),
                    "'nope'", "it serves: paced")
    _one_error_line(_profile("paced", "--url", _url(paced), "--target", "triton", "--rate-range", "10,20",
                             "--slo", "p99<=1ms", *common), "missed already at the lowest", "p99")
    _one_error_line(_profile("paced", "--url", _url(paced), "--target", "triton", "--rate-range", "5000",
                             "--arrivals", "constant", *common), "cannot send 5000 req/s")
    assert not out.exists() and not list(Path.cwd().glob("profile-paced-*"))


@pytest.mark.triton
@pytest.mark.slow
def test_a_gateway_with_a_key_is_profiled_through_v1_and_v2_and_refuses_a_wrong_key_or_model(
        demo_triton: TritonHandle, tmp_path: Path) -> None:
    from unroll.serving.gateway.process import gateway_process
    from unroll.serving.gateway.settings import Settings

    out = tmp_path / "out"
    common = ("--duration", "1.5", "--warmup", "0.3", "--late-tolerance-ms", "50", "--out", str(out))
    with gateway_process(Settings(triton_url=demo_triton.grpc_url, api_key="the-right-key"),
                         tmp_path / "gateway.log") as gateway:
        _one_error_line(_profile("sdnet-mnist", "--url", gateway, "--key", "a-wrong-key", "--rate-range", "10",
                                 *common), "refused the API key (401)")
        _one_error_line(_profile("nope", "--url", gateway, "--key", "the-right-key", "--rate-range", "10", *common),
                        "does not serve 'nope'", "sdnet-mnist", "csc-denoiser")
        assert not out.exists()
        for target in ("v1", "v2"):
            # v1 reads Triton's statistics from Triton's own port, v2 through the gateway's /v2 front (the default)
            stats = ("--triton-url", f"http://127.0.0.1:{demo_triton.http_port}") if target == "v1" else ()
            p = _profile("sdnet-mnist", "--url", gateway, "--key", "the-right-key", "--target", target,
                         "--rate-range", "20", "--arrivals", "poisson", "--size", "28", *stats, *common)
            assert p.returncode == 0, p.stderr
            result = json.loads((out / "sdnet-mnist-profile.json").read_text())
            (lv,) = result["levels"]
            assert lv["ok"] == lv["sent"] > 10 and not lv["errors"], lv
            assert lv["triton"]["requests"] >= lv["sent"]  # every request reached Triton (and was counted there)
            # The gateway's own counters over the level: the profiled route, its Triton calls.
            (route,) = [r for r in lv["gateway"]["routes"].values() if r["requests"] >= lv["sent"]]
            assert set(route["by_status"]) == {"200"} and route["mean_ms"] > 0, lv["gateway"]
            assert lv["gateway"]["triton_calls"] >= lv["sent"], lv["gateway"]
            # The local gateway process's CPU per request (Triton here is the session's, not this gateway's child).
            assert lv["service_cpu"]["processes"] == {"gateway": 1} and lv["service_cpu"]["cpu_ms_per_request"][
                "gateway"] > 0, lv["service_cpu"]
            assert result["settings"]["observers"]["gpu"] == (nvml.absent() or "read")
            names = [m["name"] for m in result["deployment"]["v1_models"]["models"]]
            assert "sdnet-mnist" in names and result["deployment"]["target"] == target


def test_a_level_of_repeated_runs_is_judged_on_its_intervals_unfavourable_end() -> None:
    load = loadgen.Load(rate=10)
    runs = []
    for ms in (8.0, 9.0, 10.0):
        r = loadgen.LevelResult(load=load, duration_s=10.0, sent=100, ok=100, latencies_ms=[ms] * 100)
        runs.append(r)
    pooled = pool(runs)
    assert pooled.sent == 300 and pooled.duration_s == 30.0 and pooled.throughput == 10.0
    assert Level(pooled, parse_slo("p99<=11ms")).met  # one pooled figure would pass: p99 = 10 ms …
    lv = Level(pooled, parse_slo("p99<=11ms"), runs=runs)
    mean, half = lv.interval(parse_slo("p99<=11ms").limits[0])
    assert mean == pytest.approx(9.0) and half == pytest.approx(4.303 / 3 ** 0.5, rel=1e-3)
    assert not lv.met and "upper end is over 11 ms" in lv.failures[0], lv.failures  # … its interval's end does not
    assert Level(pooled, parse_slo("p99<=12ms"), runs=runs).met
    assert [r["p99_ms"] for r in lv.row()["runs"]] == [8.0, 9.0, 10.0]


@pytest.mark.triton
@pytest.mark.slow
def test_triton_direct_over_grpc_with_repeated_runs_and_their_intervals_compared(paced: TritonHandle,
                                                                                 tmp_path: Path) -> None:
    _idle(paced)
    out = tmp_path / "out"
    p = _profile("paced", "--url", f"grpc://127.0.0.1:{paced.grpc_port}", "--target", "triton", "--rate-range", "40",
                 "--runs", "3", "--duration", "1", "--warmup", "0.3", "--late-tolerance-ms", "50",
                 "--slo", "p99<=500ms", "--out", str(out))
    assert p.returncode == 0, p.stderr
    result = json.loads((out / "paced-profile.json").read_text())
    assert "over gRPC" in result["deployment"]["inputs"] and result["settings"]["runs"] == 3
    (lv,) = result["levels"]
    assert len(lv["runs"]) == 3 and sum(r["sent"] for r in lv["runs"]) == lv["sent"] and not lv["errors"], lv
    assert lv["slo_met"], lv["slo_failures"]
    assert lv["triton"]["requests"] >= lv["runs"][-1]["sent"]  # Triton's statistics, read over gRPC
    c = subprocess.run([UNROLL, "profile", "compare", str(out / "paced-profile.json"), str(out / "paced-profile.json"),
                        "--out", str(tmp_path / "cmp")], capture_output=True, text=True, timeout=120)
    assert c.returncode == 0, c.stderr
    md = (tmp_path / "cmp" / "profile-compare.md").read_text()
    assert "95% CI" in md and "(n=3)" in md, md


def test_v1_sends_the_cards_test_images_where_this_package_has_them(demo_gateway) -> None:
    base = str(demo_gateway.base_url).rstrip("/")
    d = discover("v1", base, "sdnet-mnist")
    assert "test image(s) of the card's mnist-test (28×28 PNG)" in d.inputs, d.inputs
    cropped = discover("v1", base, "csc-denoiser", size=256)
    assert "denoise-test (256×256 PNG)" in cropped.inputs, cropped.inputs
    generated = discover("v1", base, "sdnet-mnist", inputs="generated", size=28)
    assert generated.inputs.endswith("generated 28×28 PNG(s)"), generated.inputs
    with pytest.raises(BenchError, match="needs --target v1"):
        discover("v2", base, "sdnet-mnist", inputs="card")
