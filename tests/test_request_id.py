"""Request ids through the real gateway (a uvicorn process) in front of a real tritonserver: every response carries
``X-Request-Id`` (the client's when sane, else generated), error answers too, and the gateway's log lines written
while serving a request name it — as text or as JSON lines (``--log-format json``)."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from served import png

from unroll.data import mnist_split
from unroll.serving.gateway.process import gateway_popen
from unroll.serving.gateway.request_id import accepted, log_config, log_format
from unroll.serving.gateway.settings import Settings

MODEL = "sdnet-mnist"
HEX = re.compile("[0-9a-f]{32}")


def test_only_sane_ids_are_taken_from_the_client() -> None:
    assert accepted("req-42_a.b:c") == "req-42_a.b:c"
    for bad in ("", "x" * 129, "a b", "a\nb", "ünï", "a,b", None):
        assert accepted(bad) is None, bad
    assert log_format("JSON") == "json" and log_config("warning")["root"]["level"] == "WARNING"
    with pytest.raises(ValueError, match="text or json"):
        log_format("xml")


@pytest.fixture(scope="module")
def served(demo_triton, tmp_path_factory: pytest.TempPathFactory):
    """A gateway logging JSON lines at info, access log on, in front of the session's tritonserver (the demo
    models)."""
    root = tmp_path_factory.mktemp("request-id")
    log = root / "gateway.log"
    with gateway_popen(Settings(triton_url=demo_triton.grpc_url), log, ready_path="/healthz",
                       args=("--log-level", "info", "--log-format", "json", "--access-log")) as (base, _):
        with httpx.Client(base_url=base, timeout=60) as client:
            yield client, log


def _digit() -> bytes:
    _, _, x, _ = mnist_split()
    return png((x[0, 0] * 255).round().astype("uint8"))


def test_every_answer_carries_an_id_and_the_log_lines_name_it(served) -> None:
    client, log = served
    first = client.post(f"/v1/classify?model={MODEL}", content=_digit(), headers={"Content-Type": "image/png"})
    assert first.status_code == 200, first.text
    generated = first.headers["X-Request-Id"]
    assert HEX.fullmatch(generated)
    given = client.post(f"/v1/classify?model={MODEL}", content=_digit(),
                        headers={"Content-Type": "image/png", "X-Request-Id": "client-7.a:b"})
    assert given.headers["X-Request-Id"] == "client-7.a:b"
    forged = client.post(f"/v1/classify?model={MODEL}", content=_digit(),
                         headers={"Content-Type": "image/png", "X-Request-Id": "x" * 200})
    assert HEX.fullmatch(forged.headers["X-Request-Id"])  # replaced, not echoed
    missing = client.post("/v1/classify?model=no-such-model", content=_digit(), headers={"Content-Type": "image/png"})
    assert missing.status_code == 404 and HEX.fullmatch(missing.headers["X-Request-Id"])
    bad = client.post(f"/v1/classify?model={MODEL}&iters=3", content=_digit(), headers={"Content-Type": "image/png"})
    assert bad.status_code == 422 and HEX.fullmatch(bad.headers["X-Request-Id"])

    lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
    records = [json.loads(ln) for ln in lines]  # every line is one JSON object (uvicorn's own included)
    logged = [r for r in records if "logger" in r]
    access = [r for r in records if "logger" not in r and "path" in r]
    assert any(r["logger"] == "uvicorn.error" and "Uvicorn running" in r["message"] for r in logged), logged[:5]
    assert all({"time", "level", "logger", "message", "request_id"} <= set(r) for r in logged)
    # the catalog is discovered inside the first request that needs it: its line names that request
    discovered = [r for r in logged if "Triton serves" in r["message"]]
    assert discovered and discovered[0]["request_id"] == generated, discovered
    by_id = {r["request_id"]: r for r in access}
    assert by_id[generated]["status"] == 200 and by_id["client-7.a:b"]["status"] == 200
    assert by_id[missing.headers["X-Request-Id"]]["status"] == 404
