"""Triton's v2 (KServe) HTTP inference body, read and written with every declared size checked against the bytes sent.

The gateway's ``/v2`` front (:mod:`.v2_front`) speaks the protocol Triton-direct clients already use
(``tritonclient.http``, ``curl`` with a JSON header and the binary-tensor extension), but nothing reaches Triton
before each input's declared shape × datatype size equals the bytes it sent (``binary_data_size``) or the JSON
values it listed, and the sizes add up to the body. Triton 2.45 hands a declared shape to a Python-backend model
unchecked, so ``[1, 2**40]`` with a few hundred bytes kills the model's process; here it is a 400 naming the input.
No library parses this body on the server side without a server of its own (tritonclient writes requests and
reads responses), hence this module; BYTES tensors use tritonclient's own (de)serialisers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor, triton_to_np_dtype

from unroll.errors import ApiError

#: The header that splits a body into its JSON part and the binary tensors after it (Triton's binary extension).
HEADER_LENGTH = "Inference-Header-Content-Length"
#: Datatypes an input may have here: fixed-size ones, whose byte size follows from the shape (``BYTES`` does not,
#: ``BF16`` has no NumPy type the gateway's client sends).
FIXED_SIZE = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
              "FP64")
#: Most dimensions one tensor may declare.
MAX_RANK = 8
#: Largest JSON header: parsed JSON numbers take 10-30× their text in Python objects, so tensors beyond a small
#: image travel as binary data (what tritonclient sends by default), which costs nothing over its bytes.
MAX_HEADER_BYTES = 1 << 20


def _bad(message: str) -> ApiError:
    return ApiError(400, "bad_request", message)


def _invalid(message: str) -> ApiError:
    return ApiError(400, "invalid_tensor", message)


@dataclass(frozen=True)
class Requested:
    """One output a request asks for: as binary or JSON, and ``classification`` (Triton's top-k extension)."""

    name: str
    binary: bool
    class_count: int | None = None


@dataclass
class InferRequest:
    """A checked request: its inputs as arrays of their declared shapes, what it wants back, its id."""

    inputs: dict[str, np.ndarray]
    outputs: list[Requested] | None  # None: every output of the model
    binary_default: bool
    request_id: str | None = None


def _shape(raw: Any, name: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or len(raw) > MAX_RANK or \
            not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in raw):
        raise _invalid(f"input {name!r}: shape must be a list of at most {MAX_RANK} non-negative integers "
                       f"(got {json.dumps(raw)[:120]})")
    return tuple(raw)


def _parameters(obj: dict[str, Any], where: str) -> dict[str, Any]:
    params = obj.get("parameters", {})
    if not isinstance(params, dict):
        raise _bad(f"{where}: parameters must be a JSON object")
    return params


def _binary_size(params: dict[str, Any], name: str) -> int | None:
    size = params.get("binary_data_size")
    if size is None:
        return None
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise _invalid(f"input {name!r}: binary_data_size must be a non-negative integer (got {size!r})")
    return size


def _input(raw: Any, blobs: memoryview, offset: int, limit: int) -> tuple[str, np.ndarray, int]:
    """One input of the header: its name, its array, and where the next binary tensor starts."""
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise _bad("each input must be a JSON object with a string name")
    name = raw["name"]
    datatype = raw.get("datatype")
    if datatype not in FIXED_SIZE:
        raise _invalid(f"input {name!r}: datatype {datatype!r} is not taken here; one of {', '.join(FIXED_SIZE)}")
    shape = _shape(raw.get("shape"), name)
    dtype = np.dtype(triton_to_np_dtype(datatype))
    count = math.prod(shape)  # Python integers: no overflow however large the declared shape
    declared = count * dtype.itemsize
    if declared > limit:
        raise ApiError(413, "payload_too_large", f"input {name!r}: shape {list(shape)} {datatype} is {declared} "
                       f"bytes, over the {limit}-byte request limit")
    size = _binary_size(_parameters(raw, f"input {name!r}"), name)
    if size is not None:
        if "data" in raw:
            raise _bad(f"input {name!r}: both binary_data_size and JSON data given; send one")
        if size != declared:
            raise _invalid(f"input {name!r}: shape {list(shape)} {datatype} is {declared} bytes but "
                           f"binary_data_size says {size}")
        if offset + size > len(blobs):
            raise _invalid(f"input {name!r}: binary_data_size {size} runs past the body's end ({len(blobs) - offset} "
                           "bytes left after the JSON header and the tensors before it)")
        arr = np.frombuffer(blobs[offset:offset + size], dtype=dtype).reshape(shape)
        return name, arr, offset + size
    if "data" not in raw:
        raise _bad(f"input {name!r}: neither JSON data nor binary_data_size")
    try:
        arr = np.asarray(raw["data"], dtype=dtype)
    except (ValueError, TypeError, OverflowError) as e:
        raise _invalid(f"input {name!r}: JSON data is not a regular array of {datatype} ({e})") from None
    if arr.size != count:
        raise _invalid(f"input {name!r}: shape {list(shape)} has {count} elements but JSON data has {arr.size}")
    return name, arr.reshape(shape), offset


def _outputs(raw: Any, binary_default: bool) -> list[Requested] | None:
    if raw is None or raw == []:  # none named: every output, as Triton answers
        return None
    if not isinstance(raw, list):
        raise _bad("outputs must be a JSON list")
    wanted = []
    for out in raw:
        if not isinstance(out, dict) or not isinstance(out.get("name"), str):
            raise _bad("each output must be a JSON object with a string name")
        params = _parameters(out, f"output {out['name']!r}")
        binary = params.get("binary_data", binary_default)
        k = params.get("classification")
        if not isinstance(binary, bool) or (k is not None and (not isinstance(k, int) or isinstance(k, bool)
                                                                 or k < 1)):
            raise _bad(f"output {out['name']!r}: binary_data must be true/false and classification a positive "
                       "integer")
        wanted.append(Requested(out["name"], binary, k))
    if sum(o.class_count is not None for o in wanted) > 1:
        raise _bad("classification may be asked of one output only")
    return wanted


def parse(body: bytes, header_length: str | None, limit: int) -> InferRequest:
    """The request in ``body`` (its JSON header the first ``header_length`` bytes, or all of it), every input
    checked: a known fixed-size datatype, a shape whose byte size equals what was sent and stays within ``limit``,
    and binary tensors that fill the rest of the body exactly. 400/413 naming the input otherwise."""
    if header_length is None:
        split = len(body)
    else:
        if not header_length.isascii() or not header_length.isdigit():
            raise _bad(f"{HEADER_LENGTH} is not a whole number: {header_length[:40]!r}")
        split = int(header_length)
        if split > len(body):
            raise _bad(f"{HEADER_LENGTH} is {split} but the body has {len(body)} bytes")
    if split > MAX_HEADER_BYTES:
        raise ApiError(413, "payload_too_large", f"the JSON header is {split} bytes, over {MAX_HEADER_BYTES}: send "
                       "large tensors as binary data (binary_data_size and Inference-Header-Content-Length)")
    try:
        header = json.loads(bytes(body[:split]))
    except (ValueError, RecursionError) as e:
        raise _bad(f"the inference header is not JSON ({str(e)[:120]})") from None
    if not isinstance(header, dict) or not isinstance(header.get("inputs"), list) or not header["inputs"]:
        raise _bad("the inference header must be a JSON object with a non-empty inputs list")
    params = _parameters(header, "the request")
    binary_default = params.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise _bad("parameters.binary_data_output must be true or false")
    blobs, offset, inputs = memoryview(body)[split:], 0, {}
    for raw in header["inputs"]:
        name, arr, offset = _input(raw, blobs, offset, limit)
        if name in inputs:
            raise _invalid(f"input {name!r} is given twice")
        inputs[name] = arr
    if offset != len(blobs):
        raise _invalid(f"the binary tensors declare {offset} bytes but {len(blobs)} follow the JSON header")
    rid = header.get("id")
    if rid is not None and not isinstance(rid, str):
        raise _bad("id must be a string")
    return InferRequest(inputs, _outputs(header.get("outputs"), binary_default), binary_default, rid)


def datatype(arr: np.ndarray) -> str:
    """The v2 datatype of ``arr`` (``BYTES`` for strings, e.g. the classification extension's answers)."""
    if arr.dtype == np.object_ or arr.dtype.kind in "SU":
        return "BYTES"
    return np_to_triton_dtype(arr.dtype)


def encode(model: str, version: str | None, request_id: str | None, results: dict[str, np.ndarray],
           binary: dict[str, bool]) -> tuple[bytes, dict[str, str]]:
    """A v2 response body for ``results`` (each output binary or JSON as ``binary`` says), and its headers."""
    outputs, blobs = [], []
    for name, arr in results.items():
        out: dict[str, Any] = {"name": name, "datatype": datatype(arr), "shape": list(arr.shape)}
        if binary[name]:
            raw = serialize_byte_tensor(arr).item() if out["datatype"] == "BYTES" else \
                np.ascontiguousarray(arr).tobytes()
            out["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        elif out["datatype"] == "BYTES":
            out["data"] = [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in arr.ravel()]
        else:
            out["data"] = arr.ravel().tolist()
        outputs.append(out)
    head: dict[str, Any] = {"model_name": model}
    if version:
        head["model_version"] = version
    if request_id is not None:
        head["id"] = request_id
    head["outputs"] = outputs
    text = json.dumps(head, separators=(",", ":")).encode()
    if not blobs:
        return text, {"Content-Type": "application/json"}
    return b"".join([text, *blobs]), {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(text))}
