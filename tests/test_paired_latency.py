"""The latency measurements `unroll bench ood` builds on: request pairs find a known added delay between two real
HTTP servers, one endpoint's latencies alone find it too, an endpoint that does not answer 200 is refused, and the
intervals (a median's from order statistics, a mean's from Student's t) cover as often as they say."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from unroll.benchmarks import paired_latency
from unroll.errors import BenchError


@contextmanager
def _server(delay_s: float, status: int = 200) -> Iterator[str]:
    """A real HTTP/1.1 server on a free port that reads the POST, waits ``delay_s`` and answers ``status``."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # kept-alive, as Triton and the gateway
        disable_nagle_algorithm = True  # headers and body go in two writes: no delayed-ACK stall between them

        def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            if delay_s:
                end = time.perf_counter() + delay_s
                while time.perf_counter() < end:  # a busy wait: sleep's granularity would blur the delay
                    pass
            body = b'{"ok": true}'
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/infer?model=x"
    finally:
        server.shutdown()
        server.server_close()


def _endpoint(url: str) -> paired_latency.Endpoint:
    return paired_latency.Endpoint(url, b"digit", {"Content-Type": "application/octet-stream"})


def test_pairs_find_the_delay_one_server_adds() -> None:
    with _server(0.0) as fast, _server(0.002) as slow:
        r = paired_latency.added(_endpoint(fast), _endpoint(slow), seconds=1.0, warmup=5)
    assert r["pairs"] >= 50
    assert 1.7 < r["added_ms"] < 3.0, r  # the 2 ms the slow one spends, give or take the machine
    assert r["added_ci_ms"][0] > 1.0, r  # the interval excludes no delay at all
    with _server(0.0) as a, _server(0.0) as b:  # the same server twice: nothing added, within the interval
        same = paired_latency.added(_endpoint(a), _endpoint(b), seconds=1.0, warmup=5)
    assert abs(same["added_ms"]) < 0.3, same


def test_an_answer_other_than_200_stops_the_measurement() -> None:
    with _server(0.0) as good, _server(0.0, status=503) as bad:
        with pytest.raises(BenchError, match="503"):
            paired_latency.added(_endpoint(good), _endpoint(bad), seconds=0.5, warmup=1)


def test_the_medians_interval_covers_it_as_often_as_it_says_and_narrows_with_more_values() -> None:
    covered = [lo <= 0.0 <= hi for lo, hi in (paired_latency.median_ci(np.random.default_rng(seed).normal(size=400))
                                             for seed in range(300))]
    assert 0.91 <= np.mean(covered) <= 0.99  # a 95 % interval for a median of 0
    rng = np.random.default_rng(0)
    lo, hi = paired_latency.median_ci(rng.normal(size=30))
    lo2, hi2 = paired_latency.median_ci(rng.normal(size=3000))
    assert hi2 - lo2 < (hi - lo) / 4
    assert paired_latency.median_ci(np.array([1.0, 2.0, 3.0])) == (1.0, 3.0)  # too few for ranks: the range


def test_one_endpoints_latencies_show_its_delay() -> None:
    with _server(0.0) as fast, _server(0.002) as slow:
        quick = paired_latency.latencies(_endpoint(fast), 0.5, warmup=5)
        late = paired_latency.latencies(_endpoint(slow), 0.5, warmup=5)
    assert len(quick) > len(late) >= 50
    assert 1.7 < float(np.median(late) - np.median(quick)) < 3.0


def test_the_means_interval_covers_it_as_often_as_it_says_with_few_values() -> None:
    """Six values a draw, as the served cost's cycles: a normal interval (z) would cover too seldom."""
    draws = [np.random.default_rng(seed).normal(3.0, 2.0, size=6) for seed in range(400)]
    covered = [lo <= 3.0 <= hi for lo, hi in map(paired_latency.mean_ci, draws)]
    assert 0.92 <= np.mean(covered) <= 0.98
    z = [abs(d.mean() - 3.0) <= 1.96 * d.std(ddof=1) / np.sqrt(6) for d in draws]
    assert np.mean(z) < np.mean(covered)
    with pytest.raises(BenchError, match="at least 2"):
        paired_latency.mean_ci(np.array([1.0]))
