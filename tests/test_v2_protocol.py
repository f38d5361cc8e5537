"""The ``/v2`` front's reading of Triton's inference body: what tritonclient writes is read back exactly, and every
declared size that does not match the bytes sent is refused before an array is made (issue 38, item 5).

Bodies are written by ``tritonclient.http`` itself (``generate_request_body``), the client Triton-direct users
run, and read back by ``tritonclient.http.InferResult`` for the answers; the served path is tested through
``unroll serve`` in tests/test_supervisor.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.http as httpclient

from unroll.errors import ApiError
from unroll.serving.gateway import v2_protocol

LIMIT = 1 << 20


def _body(*inputs: httpclient.InferInput, outputs=None) -> tuple[bytes, str | None]:
    body, n = httpclient.InferenceServerClient.generate_request_body(list(inputs), outputs=outputs, request_id="r7")
    return body, None if n is None else str(n)


def _input(name: str, arr: np.ndarray, binary: bool = True) -> httpclient.InferInput:
    i = httpclient.InferInput(name, list(arr.shape), "UINT8" if arr.dtype == np.uint8 else "FP32")
    i.set_data_from_numpy(arr, binary_data=binary)
    return i


def _refused(body: bytes, n: str | None, status: int, *words: str) -> None:
    with pytest.raises(ApiError) as e:
        v2_protocol.parse(body, n, LIMIT)
    assert e.value.status == status, e.value.message
    for w in words:
        assert w in e.value.message, e.value.message


def test_what_tritonclient_writes_is_read_back_exactly() -> None:
    x = np.random.default_rng(0).random((2, 1, 28, 28), dtype=np.float32)
    raw = np.arange(300, dtype=np.uint8).reshape(1, 300)
    body, n = _body(_input("image", x), _input("image_bytes", raw, binary=False),
                    outputs=[httpclient.InferRequestedOutput("logits", class_count=3)])
    req = v2_protocol.parse(body, n, LIMIT)
    assert np.array_equal(req.inputs["image"], x) and np.array_equal(req.inputs["image_bytes"], raw)
    assert req.request_id == "r7"
    assert req.outputs == [v2_protocol.Requested("logits", True, 3)]
    body = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}], "outputs": []})
    assert v2_protocol.parse(body.encode(), None, LIMIT).outputs is None  # none named: all of them, as Triton


def test_the_answer_is_what_tritonclient_reads() -> None:
    logits = np.random.default_rng(1).random((2, 10), dtype=np.float32)
    classes = np.array([[b"0.9:3:three", b"0.1:5:five"]] * 2, dtype=object)
    body, headers = v2_protocol.encode("m", "2", "r7", {"logits": logits, "classes": classes, "json": logits[:, :2]},
                                       {"logits": True, "classes": True, "json": False})
    n = headers.get(v2_protocol.HEADER_LENGTH)
    res = httpclient.InferResult.from_response_body(body, header_length=int(n))
    assert np.array_equal(res.as_numpy("logits"), logits)
    assert res.as_numpy("classes").tolist() == classes.tolist()
    assert np.allclose(res.as_numpy("json"), logits[:, :2])
    assert res.get_response()["model_version"] == "2" and res.get_response()["id"] == "r7"


def _lying(shape: list[int], sent: bytes, size: int | None = None) -> tuple[bytes, str]:
    head = json.dumps({"inputs": [{"name": "image_bytes", "shape": shape, "datatype": "UINT8",
                                   "parameters": {"binary_data_size": len(sent) if size is None else size}}]})
    return head.encode() + sent, str(len(head))


@pytest.mark.parametrize("shape", [[1, 2**40], [1, 300 * 1000], [1, 299], [2**62, 2**62]])
def test_a_declared_shape_that_is_not_the_bytes_sent_is_refused(shape: list[int]) -> None:
    body, n = _lying(shape, bytes(300))
    status = 413 if np.prod(np.array(shape, dtype=object)) > LIMIT else 400
    _refused(body, n, status, "image_bytes", str(shape[-1]))


def test_sizes_that_do_not_add_up_to_the_body_are_refused() -> None:
    body, n = _lying([1, 400], bytes(300), size=400)  # claims more than follows
    _refused(body, n, 400, "runs past")
    body, n = _lying([1, 300], bytes(301))  # one byte nobody declared
    head = json.loads(body[:int(n)])
    head["inputs"][0]["parameters"]["binary_data_size"] = 300
    text = json.dumps(head).encode()
    _refused(text + bytes(301), str(len(text)), 400, "301")


@pytest.mark.parametrize("header, words", [
    ({"inputs": [{"name": "x", "shape": [2], "datatype": "BYTES", "data": ["a", "b"]}]}, ["BYTES"]),
    ({"inputs": [{"name": "x", "shape": [-1], "datatype": "FP32", "data": [1.0]}]}, ["non-negative"]),
    ({"inputs": [{"name": "x", "shape": [True], "datatype": "FP32", "data": [1.0]}]}, ["non-negative"]),
    ({"inputs": [{"name": "x", "shape": [1] * 9, "datatype": "FP32", "data": [1.0]}]}, ["at most 8"]),
    ({"inputs": [{"name": "x", "shape": [3], "datatype": "FP32", "data": [1.0, 2.0]}]}, ["3 elements", "2"]),
    ({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [[1.0], [2.0, 3.0]]}]}, ["regular"]),
    ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32"}]}, ["neither"]),
    ({"inputs": []}, ["non-empty"]),
    ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}] * 2}, ["twice"]),
    ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}],
      "outputs": [{"name": "y", "parameters": {"classification": 0}}]}, ["classification"]),
])
def test_malformed_headers_are_refused_by_name(header: dict, words: list[str]) -> None:
    _refused(json.dumps(header).encode(), None, 400, *words)


def test_a_header_that_is_not_json_or_a_length_that_lies_is_refused() -> None:
    _refused(b"[" * 100_000, None, 400, "not JSON")
    _refused(b'{"inputs": []}', "99", 400, "99")
    _refused(b'{"inputs": []}', "1e3", 400, "whole number")
    big = json.dumps({"inputs": [{"name": "x", "shape": [300_000], "datatype": "FP32", "data": [0.5] * 300_000}]})
    _refused(big.encode(), None, 413, "binary data")
