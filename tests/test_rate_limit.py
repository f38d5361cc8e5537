"""Per-client rate limit (``UNROLL_RATE_LIMIT``): token buckets in isolation (a clock the test moves), then the real
gateway in front of a real tritonserver: ``RateLimit-*`` headers on every ``/v1`` answer, a JSON 429 with
``Retry-After`` once a client's burst is spent, buckets per API key vs per address, the refusals in ``/metrics``."""

from __future__ import annotations

import httpx
import pytest

from unroll.errors import SettingsError
from unroll.serving.gateway.errors import ApiError
from unroll.serving.gateway.process import gateway_popen
from unroll.serving.gateway.rate_limit import Buckets, RateLimit
from unroll.serving.gateway.settings import Settings

MODEL = "sdnet-mnist"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_spec_forms_and_errors() -> None:
    assert RateLimit.parse("10/s,20") == RateLimit(10.0, 20)
    assert RateLimit.parse(" 2.5 , 4") == RateLimit(2.5, 4)
    assert RateLimit.parse("3") == RateLimit(3.0, 3) and RateLimit.parse("0.5").burst == 1
    for bad in ("", "0", "-1/s", "ten", "5/m"):
        with pytest.raises(ValueError, match="R/s,BURST"):
            RateLimit.parse(bad)
    with pytest.raises(ValueError, match="burst is at least 1"):
        RateLimit.parse("5,0")
    with pytest.raises(SettingsError, match="UNROLL_RATE_LIMIT"):
        Settings(rate_limit="fast")


def test_bucket_spends_its_burst_then_refills_at_the_rate() -> None:
    clock = Clock()
    b = Buckets(RateLimit(2.0, 3), clock=clock)
    assert [b.admit("a")["RateLimit-Remaining"] for _ in range(3)] == ["2", "1", "0"]
    with pytest.raises(ApiError) as refused:
        b.admit("a")
    assert refused.value.http_status == 429 and refused.value.headers["Retry-After"] == "1"
    assert refused.value.headers["RateLimit-Policy"] == "3;w=1.5"
    assert b.admit("b")["RateLimit-Remaining"] == "2"  # another client has its own bucket
    clock.t += 0.5  # one token back (2/s)
    assert b.admit("a")["RateLimit-Remaining"] == "0"
    clock.t += 10  # never more than the burst
    assert b.admit("a")["RateLimit-Remaining"] == "2"


def test_buckets_are_bounded() -> None:
    b = Buckets(RateLimit(1.0, 1), max_clients=3, clock=Clock())
    for i in range(10):
        b.take(f"client-{i}")
    assert len(b) == 3


@pytest.fixture(scope="module")
def gateway(demo_triton, tmp_path_factory: pytest.TempPathFactory):
    """A rate-limited, key-locked gateway in front of the session's tritonserver (the demo models)."""
    root = tmp_path_factory.mktemp("rate-limit")
    settings = Settings(triton_url=demo_triton.grpc_url, rate_limit="0.2/s,3", api_key="s3cret")
    with gateway_popen(settings, root / "gateway.log", ready_path="/healthz") as (base, _):
        yield base


def test_a_client_gets_its_burst_then_a_json_429(gateway: str) -> None:
    key = {"X-API-Key": "s3cret"}
    with httpx.Client(base_url=gateway, timeout=60) as c:
        remaining = []
        for _ in range(3):
            r = c.get("/v1/models", headers=key)
            assert r.status_code == 200, r.text
            assert r.headers["RateLimit-Limit"] == "3" and r.headers["RateLimit-Policy"] == "3;w=15"
            remaining.append(r.headers["RateLimit-Remaining"])
        assert remaining == ["2", "1", "0"]
        r = c.get("/v1/models", headers=key)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited", r.text
        assert "0.2 requests/s with bursts of 3" in r.json()["error"]["message"]
        assert 1 <= int(r.headers["Retry-After"]) <= 5 and r.headers["RateLimit-Remaining"] == "0"
        # a request without the key is another client (its address): refused for the key (401), not limited by it
        assert c.get("/v1/models").status_code == 401
        assert c.get("/healthz").status_code == 200 and "RateLimit-Limit" not in c.get("/healthz").headers
        text = c.get("/metrics").text
    assert "unroll_gateway_rate_limited_total 1.0" in text
    assert 'unroll_gateway_requests_total{method="GET",route="/v1/models",status="429"} 1.0' in text
