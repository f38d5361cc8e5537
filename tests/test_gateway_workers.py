"""The gateway as several worker processes behind one port (``--workers 2``), in front of a real tritonserver.

Checked from outside: requests are served by more than one worker (``unroll_gateway_worker_requests{pid}``,
whose pids are the parent's children), ``/metrics`` counts every request whichever worker answered it, a
SIGKILLed worker is replaced while the others keep serving (and its requests stay counted), and SIGTERM to the
parent stops every worker and removes the metrics directory.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from unroll.benchmarks.common import metric_sum as metric
from unroll.serving.gateway.process import gateway_popen
from unroll.serving.gateway.settings import Settings
from unroll.serving.gateway.workers import MAX_DEFAULT_WORKERS, WORKERS_ENV, check_workers, default_workers
from unroll.serving.triton import free_ports, proc_stats

CLASSIFIER = "sdnet-mnist"
WORKERS = 2
CLASSIFY = "/v1/classify"


def children(pid: int) -> set[int]:
    """Live (not zombie) child processes of ``pid``, from /proc."""
    return {ps.pid for ps in proc_stats() if ps.ppid == pid and ps.state != "Z"}


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def worker_pids(pid: int) -> set[int]:
    """The gateway workers among ``pid``'s children (multiprocessing's spawned processes, not its resource tracker
    nor tritonserver)."""
    return {c for c in children(pid) if "spawn_main" in cmdline(c)}


def per_worker(text: str) -> dict[int, float]:
    return {int(pid): float(v) for pid, v in re.findall(r'^unroll_gateway_worker_requests\{pid="(\d+)"\} (\S+)$',
                                                        text, re.M)}


@pytest.fixture(scope="module")
def digit_png() -> bytes:
    from unroll.data import mnist_split

    x = mnist_split()[2][0, 0]
    buf = io.BytesIO()
    Image.fromarray((np.clip(x, 0, 1) * 255).round().astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def triton_grpc(demo_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from unroll.serving.repository import write_repository
    from unroll.serving.triton import start

    repo = tmp_path_factory.mktemp("repo")
    write_repository("cpu", [CLASSIFIER, f"{CLASSIFIER}-autolam"], repo, onnx_dir=demo_onnx_dir)
    handle = start(repo, *free_ports(3), log_file=tmp_path_factory.mktemp("triton") / "triton.log", timeout_s=180,
                   extra_args=["--exit-timeout-secs=2"])
    try:
        yield handle.grpc_url
    finally:
        handle.stop()


@pytest.fixture(scope="module")
def gateway(triton_grpc: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, subprocess.Popen]]:
    log = tmp_path_factory.mktemp("gw") / "gateway.log"
    with gateway_popen(Settings(triton_url=triton_grpc), log, timeout_s=120, workers=WORKERS) as (base, proc):
        yield base, proc


def classify_many(base: str, digit_png: bytes, n: int, concurrency: int = 16) -> list[int]:
    """``n`` classifications, each on a new connection (so the kernel may hand it to any worker); their statuses."""
    def one(_: int) -> tuple[int, str]:
        with httpx.Client(base_url=base, timeout=60) as c:
            r = c.post(CLASSIFY, params={"model": CLASSIFIER}, content=digit_png, headers={"Content-Type": "image/png"})
            return r.status_code, r.text[:300]

    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(one, range(n)))
    failed = [a for a in answers if a[0] != 200]
    assert not failed, f"{len(failed)} of {n} failed, e.g. {failed[:3]}"
    return [a[0] for a in answers]


def scrape(base: str) -> str:
    return httpx.get(base + "/metrics", timeout=30).text


def wait_for(cond, timeout_s: float, what: str):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := cond():
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} did not happen within {timeout_s:g} s")


@pytest.mark.triton
@pytest.mark.slow
def test_requests_spread_over_workers_and_metrics_add_up(gateway: tuple[str, subprocess.Popen],
                                                         digit_png: bytes) -> None:
    base, proc = gateway
    workers = wait_for(lambda: worker_pids(proc.pid) if len(worker_pids(proc.pid)) >= WORKERS else None, 60,
                       f"{WORKERS} workers")
    first = scrape(base)
    before = metric(first, "unroll_gateway_requests_total", route=CLASSIFY, status="200")
    items_before = metric(first, "unroll_gateway_batch_items_sum", model=CLASSIFIER)
    # Batches until a second worker has served (a worker still starting on a loaded machine accepts nothing yet)
    n, deadline = 0, time.monotonic() + 90
    while True:
        assert classify_many(base, digit_png, 100) == [200] * 100
        n += 100
        text = scrape(base)
        if len([v for v in per_worker(text).values() if v > 0]) >= 2 or time.monotonic() > deadline:
            break
    assert metric(text, "unroll_gateway_requests_total", route=CLASSIFY, status="200") == before + n
    assert metric(text, "unroll_gateway_request_duration_seconds_count", route=CLASSIFY) == before + n
    # every request reached Triton once, alone or coalesced with others (serving/gateway/batching.py)
    assert metric(text, "unroll_gateway_batch_items_sum", model=CLASSIFIER) == items_before + n
    counts = per_worker(text)
    assert set(counts) <= workers, (counts, workers)  # only live workers are listed
    assert len([p for p, v in counts.items() if v > 0]) >= 2, counts  # more than one process served
    assert metric(text, "unroll_gateway_requests_in_flight") == 1.0  # the scrape itself, summed over workers
    assert "process_cpu_seconds_total" not in text  # per-process collectors are left out with several workers


@pytest.mark.triton
@pytest.mark.slow
def test_killed_worker_is_replaced_and_counts_survive(gateway: tuple[str, subprocess.Popen], digit_png: bytes) -> None:
    base, proc = gateway
    old = wait_for(lambda: worker_pids(proc.pid) if len(worker_pids(proc.pid)) >= WORKERS else None, 60, "workers")
    assert classify_many(base, digit_png, 40) == [200] * 40
    before = scrape(base)
    total = metric(before, "unroll_gateway_requests_total", route=CLASSIFY, status="200")
    victim = max(per_worker(before).items(), key=lambda kv: kv[1])[0]  # the worker with the most requests
    os.kill(victim, signal.SIGKILL)
    # The port keeps answering while the victim is down (the other worker accepts every new connection).
    assert classify_many(base, digit_png, 20, concurrency=4) == [200] * 20
    def replaced() -> set[int] | None:
        now = worker_pids(proc.pid)
        return now - old if len(now) >= WORKERS and victim not in now else None

    new = wait_for(replaced, 60, "a replacement worker")
    assert len(new) == 1 and proc.poll() is None
    wait_for(lambda: httpx.get(base + "/healthz", timeout=10).status_code == 200, 30, "healthz")
    assert classify_many(base, digit_png, 60) == [200] * 60
    text = scrape(base)
    # The killed worker's requests are still counted, and it is no longer listed as a live worker.
    assert metric(text, "unroll_gateway_requests_total", route=CLASSIFY, status="200") == total + 80
    assert victim not in per_worker(text)


@pytest.mark.triton
@pytest.mark.slow
def test_sigterm_stops_every_worker(triton_grpc: str, tmp_path: Path, digit_png: bytes) -> None:
    with gateway_popen(Settings(triton_url=triton_grpc), tmp_path / "gateway.log", timeout_s=120,
                       workers=WORKERS) as (base, proc):
        workers = wait_for(lambda: worker_pids(proc.pid) if len(worker_pids(proc.pid)) >= WORKERS else None, 60,
                           "workers")
        assert classify_many(base, digit_png, 8) == [200] * 8
        env = Path(f"/proc/{next(iter(workers))}/environ").read_bytes().split(b"\0")
        metrics_dir = next(e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"PROMETHEUS_MULTIPROC_DIR="))
        assert Path(metrics_dir).is_dir()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        for pid in workers:
            assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
        assert not Path(metrics_dir).exists()
        with pytest.raises(httpx.ConnectError):
            httpx.get(base + "/healthz", timeout=5)


def test_worker_count_comes_from_the_option_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WORKERS_ENV, raising=False)
    assert 1 <= default_workers() <= max(1, min(MAX_DEFAULT_WORKERS, (os.cpu_count() or 1) // 2))
    monkeypatch.setenv(WORKERS_ENV, "3")
    assert default_workers() == 3
    for bad in ("0", "-1", "two"):
        monkeypatch.setenv(WORKERS_ENV, bad)
        with pytest.raises(ValueError, match=WORKERS_ENV):
            default_workers()
    assert check_workers("2") == 2


def test_gateway_refuses_a_bad_worker_count() -> None:
    import sys

    r = subprocess.run([sys.executable, "-m", "unroll.serving.gateway", "--workers", "0"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and WORKERS_ENV in r.stderr


@pytest.mark.triton
@pytest.mark.slow
def test_serve_with_workers_serves_and_sigterm_stops_workers_and_triton(demo_onnx_dir: Path, tmp_path: Path,
                                                                        digit_png: bytes) -> None:
    """``unroll serve --workers 2``: Triton under its supervisor plus two gateway workers; SIGTERM stops them all."""
    import sys
    import threading

    port, http, grpc, metrics = free_ports(4)
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNROLL_")}
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-m", "unroll.app.serve", "--models", CLASSIFIER, "--workers", str(WORKERS),
           "--port", str(port), "--triton-http-port", str(http), "--triton-grpc-port", str(grpc),
           "--triton-metrics-port", str(metrics), "--repo", str(tmp_path / "repo"), "--onnx-dir", str(demo_onnx_dir),
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "unroll gateway ready" in line:
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert ready.wait(240) and proc.poll() is None, "".join(lines)[-3000:]
        base = f"http://127.0.0.1:{port}"
        assert classify_many(base, digit_png, 40) == [200] * 40
        workers = wait_for(lambda: w if len(w := worker_pids(proc.pid)) >= WORKERS else None, 60, "two workers")
        assert len(workers) == WORKERS, workers
        kids = children(proc.pid)
        assert any("tritonserver" in cmdline(k) for k in kids), [cmdline(k) for k in kids]
        text = scrape(base)
        assert metric(text, "unroll_gateway_requests_total", route=CLASSIFY, status="200") == 40
        # the solver's residual under `unroll serve` (its card declares ood): a digit is in distribution, a photo
        # is not, and abstain=true withholds its labels
        from skimage import data as skdata

        buf = io.BytesIO()
        Image.fromarray(skdata.astronaut()).save(buf, format="PNG")
        for image, inside in ((digit_png, True), (buf.getvalue(), False)):
            r = httpx.post(base + CLASSIFY, params={"model": CLASSIFIER, "abstain": "true"}, content=image,
                           headers={"Content-Type": "image/png"}, timeout=60)
            body = r.json()
            assert r.status_code == 200 and body["in_distribution"] is inside, body
            assert r.headers["X-In-Distribution"] == str(inside).lower()
            assert body.get("abstained", False) is not inside and bool(body["predictions"]) is inside, body
        everyone = {p: cmdline(p) for p in kids | {g for k in kids for g in children(k)}}  # Triton's stubs too
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, "".join(lines)[-3000:]

        def left() -> dict[int, str]:
            return {p: c for p, c in everyone.items() if Path(f"/proc/{p}").exists()
                    and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"}

        # Orphans finish on their own (multiprocessing's resource tracker exits once its pipe closes): allow them a
        # moment, then none may be left.
        try:
            wait_for(lambda: not left(), 30, "every worker, Triton and its stubs exiting")
        except AssertionError:
            raise AssertionError(f"still running after SIGTERM: {left()}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_metrics_dirs_of_dead_runs_are_removed(tmp_path: Path) -> None:
    from unroll.serving.gateway.workers import remove_stale_metrics_dirs

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"unroll-gateway-metrics-{dead.pid}-abc"
    live = tmp_path / f"unroll-gateway-metrics-{os.getpid()}-def"
    for d in (stale, live):
        d.mkdir()
        (d / "counter_1.db").write_bytes(b"x")
    assert remove_stale_metrics_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists()
