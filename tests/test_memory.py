"""The README's whole-service memory bound, measured: 20 concurrent maximum-size denoise requests through a real
``unroll serve`` (gateway, tritonserver, Python-backend processes) peak within 4 GiB of PSS, all answered 200, and
the service returns to within 500 MiB of its idle footprint (``unroll bench memory``)."""

from __future__ import annotations

import pytest

from unroll.benchmarks import memory


def test_service_sums_the_whole_process_tree() -> None:
    import os

    here = memory.service_bytes(os.getpid())
    assert here["gateway"] > 0 and here["total"] == here["gateway"] + here["tritonserver"] + here["backends"]


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.timeout(1200)
def test_twenty_maximum_size_denoise_requests_stay_within_the_stated_bound() -> None:
    r = memory.run(20, out=None, log=lambda m: None)
    assert r["statuses"] == {"200": 20}, (r["statuses"], r["refusals"])
    assert r["peak_bytes"]["total"] <= memory.PEAK_LIMIT_BYTES, r["peak_bytes"]
    assert r["after_bytes"]["total"] - r["idle_bytes"]["total"] <= memory.RETURN_LIMIT_BYTES, (
        r["idle_bytes"], r["after_bytes"])
