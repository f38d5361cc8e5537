"""The ``/v2`` front's server metadata, model configuration and statistics: what Triton's own HTTP API answers, read
through the gateway (which talks gRPC to Triton), so that ``perf_analyzer -i http`` and ``tritonclient.http`` drive
the gateway as they drive Triton (issue 57, item 6). The perf_analyzer run itself is in tests/test_profile_agreement.py.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient

from unroll.serving.gateway.v2_front import SERVED_EXTENSIONS
from unroll.serving.triton import TritonHandle

MODEL = "sdnet-mnist"


@pytest.fixture(scope="module")
def direct(demo_triton: TritonHandle) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(f"{demo_triton.host}:{demo_triton.http_port}")


def test_the_configuration_is_tritons_http_answer(demo_gateway: httpx.Client, demo_triton: TritonHandle,
                                                   direct: httpclient.InferenceServerClient) -> None:
    got = demo_gateway.get(f"/v2/models/{MODEL}/config")
    assert got.status_code == 200, got.text
    want = direct.get_model_config(MODEL, headers=demo_triton.headers)
    # What Triton's HTTP endpoint writes, key for key: numbers as numbers, enums by name, empty lists kept. (The
    # gateway's protobuf schema, from a newer tritonclient, may hold fields Triton 2.45 does not write: extra keys.)
    _within(want, got.json(), "config")
    assert isinstance(got.json()["max_batch_size"], int)


def _within(want: object, got: object, where: str) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict), where
        for key, value in want.items():
            assert key in got, f"{where}.{key}"
            _within(value, got[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            _within(w, g, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def test_statistics_count_an_inference_sent_through_the_front(demo_gateway: httpx.Client, demo_triton: TritonHandle,
                                                               direct: httpclient.InferenceServerClient) -> None:
    def count() -> int:
        got = demo_gateway.get(f"/v2/models/{MODEL}/versions/1/stats")
        assert got.status_code == 200, got.text
        (stats,) = got.json()["model_stats"]
        assert stats["name"] == MODEL and stats["version"] == "1"
        assert isinstance(stats["inference_stats"]["success"]["ns"], int)
        return stats["inference_count"]

    before = count()
    x = httpclient.InferInput("image", [1, 1, 28, 28], "FP32")
    x.set_data_from_numpy(np.zeros((1, 1, 28, 28), np.float32))
    body, n = httpclient.InferenceServerClient.generate_request_body([x])
    answer = demo_gateway.post(f"/v2/models/{MODEL}/infer", content=body,
                               headers={"Inference-Header-Content-Length": str(n)})
    assert answer.status_code == 200, answer.text
    assert count() == before + 1
    every = demo_gateway.get(f"/v2/models/{MODEL}/stats").json()
    _within(direct.get_inference_statistics(MODEL, headers=demo_triton.headers), every, "stats")


def test_server_metadata_names_only_what_the_front_serves(demo_gateway: httpx.Client, demo_triton: TritonHandle,
                                                          direct: httpclient.InferenceServerClient) -> None:
    got = demo_gateway.get("/v2").json()
    want = direct.get_server_metadata(headers=demo_triton.headers)
    assert got["version"] == want["version"]
    assert set(got["extensions"]) == SERVED_EXTENSIONS & set(want["extensions"])
    assert "system_shared_memory" in want["extensions"] and "system_shared_memory" not in got["extensions"]


def test_a_model_not_served_is_a_404_naming_it(demo_gateway: httpx.Client) -> None:
    for path in ("/v2/models/nope/config", "/v2/models/nope/stats", "/v2/models/nope/versions/1/stats"):
        got = demo_gateway.get(path)
        assert got.status_code == 404 and "nope" in got.text, (path, got.text)
