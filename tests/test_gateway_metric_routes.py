"""The gateway's Prometheus route label for mounted apps: the docs' static files count under ``/docs/static``.

A real gateway process (no Triton needed: the docs and their assets are served by the gateway itself).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx

from unroll.serving.gateway.openapi import DOCS_STATIC
from unroll.serving.gateway.process import gateway_process
from unroll.serving.gateway.settings import Settings
from unroll.serving.triton import free_ports


def test_docs_static_files_are_counted_under_their_mount(tmp_path: Path) -> None:
    settings = Settings(triton_url=f"127.0.0.1:{free_ports(1)[0]}")  # nothing listens there: docs need no Triton
    with gateway_process(settings, tmp_path / "gateway.log", ready_path="/healthz", timeout_s=60) as base, \
            httpx.Client(base_url=base, timeout=30) as client:
        page = client.get("/docs")
        assert page.status_code == 200
        assets = re.findall(rf'"({re.escape(DOCS_STATIC)}/[^"]+)"', page.text)
        assert assets, page.text
        for asset in assets:  # what a browser opening /docs fetches
            assert client.get(asset).status_code == 200, asset
        assert client.get(f"{DOCS_STATIC}/no-such-file.js").status_code == 404
        assert client.get("/no/such/path").status_code == 404
        expected = [
            f'unroll_gateway_requests_total{{method="GET",route="{DOCS_STATIC}",status="200"}} {float(len(assets))}',
            f'unroll_gateway_requests_total{{method="GET",route="{DOCS_STATIC}",status="404"}} 1.0',
            'unroll_gateway_requests_total{method="GET",route="unmatched",status="404"} 1.0']
        deadline = time.monotonic() + 5  # a response can reach the client just before its count is recorded (CI)
        while True:
            text = client.get("/metrics").text
            if all(e in text for e in expected) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    counts = {m["route"]: m for m in re.finditer(
        r'unroll_gateway_requests_total\{method="GET",route="(?P<route>[^"]*)",status="(?P<status>\d+)"\} '
        r"(?P<n>[\d.]+)", text)}
    lines = [m.group(0) for m in counts.values()]
    assert f'unroll_gateway_requests_total{{method="GET",route="{DOCS_STATIC}",status="200"}} {float(len(assets))}' \
        in text, lines
    assert f'unroll_gateway_requests_total{{method="GET",route="{DOCS_STATIC}",status="404"}} 1.0' in text, lines
    assert 'unroll_gateway_requests_total{method="GET",route="unmatched",status="404"} 1.0' in text, lines
    assert not any(route.startswith(DOCS_STATIC + "/") for route in counts), "raw asset paths as labels"
