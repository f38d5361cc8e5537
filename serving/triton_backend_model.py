"""Triton Python-backend model that runs an exported ONNX graph on the CPU (ONNX Runtime or OpenVINO).

:mod:`unroll.serving.repository` copies this file unchanged to ``<model>/1/model.py``; everything model-specific
comes from ``config.pbtxt`` parameters (``onnx_file``, ``cpu_runtime``, ``intra_op_num_threads``,
``intra_op_spinning``, ``input_defaults`` for optional inputs, and ``unroll.profile`` in the test-only GPU stand-in,
which refuses inputs outside the profile as TensorRT does). Tensors cross the stub zero-copy through DLPack,
because the wheel's stub predates NumPy 2's dtype ABI and its ``as_numpy()`` returns wrong data under NumPy 2. One
dynamic batch runs as one ``session.run`` per group of equal shapes; a failing group fails only its requests.
"""

from __future__ import annotations

import ctypes
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from unroll.card import CARD_KEY
from unroll.errors import UsageError
from unroll.serving.cpu_runtime import DEFAULT_RUNTIME, RuntimeUnavailable, open_session


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        cfg = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        onnx_path = Path(args["model_repository"]) / args["model_version"] / params.get("onnx_file", "model.onnx")
        if "intra_op_num_threads" not in params:
            raise pb_utils.TritonModelException("config.pbtxt needs parameters { key: \"intra_op_num_threads\" }")
        runtime = params.get("cpu_runtime", DEFAULT_RUNTIME)
        try:
            # intra_op_spinning "1": threads spin briefly before sleeping (serving/repository.py's measurement).
            self.session = open_session(onnx_path, runtime, int(params["intra_op_num_threads"]),
                                        spinning=params.get("intra_op_spinning", "0") == "1")
        except RuntimeUnavailable as e:  # e.g. the card names OpenVINO and it is not installed here
            raise pb_utils.TritonModelException(f"cpu_runtime {runtime!r}: {e}") from None
        self.batching = int(cfg.get("max_batch_size", 0)) > 0
        defaults = json.loads(params.get("input_defaults", "{}"))
        graph = self.session.inputs
        self.inputs = []  # (name, numpy dtype, graph shape without batch if static else None, default or None)
        for i in cfg["input"]:
            name = i["name"]
            dims = graph[name][1:] if self.batching else graph[name]
            shape = [int(d) for d in dims] if all(d is not None for d in dims) else None
            default = defaults.get(name)
            if i.get("optional") and default is None:
                raise pb_utils.TritonModelException(f"optional input {name!r} has no entry in input_defaults")
            if default is not None and shape is None:
                raise pb_utils.TritonModelException(f"input {name!r}: a default needs a static shape, not {dims}")
            self.inputs.append((name, pb_utils.triton_string_to_numpy(i["data_type"]), shape, default))
        self.outputs = []  # (name, numpy dtype, config dims when all static, else None)
        for o in cfg["output"]:
            dims = [int(d) for d in o["dims"]]
            self.outputs.append((o["name"], pb_utils.triton_string_to_numpy(o["data_type"]),
                                 dims if all(d >= 0 for d in dims) else None))
        self.output_names = [o[0] for o in self.outputs]
        # {name: (min shape, max shape)}, batch first, as unroll.serving.profile writes it (stand-in only)
        raw = json.loads(params.get("unroll.profile", "{}")).get("inputs", {})
        self.profile = {n: (tuple(r["min"]), tuple(r["max"])) for n, r in raw.items()}
        self._defaults: dict[tuple, np.ndarray] = {}  # (input name, shape) → filled default (see _default)
        # The card's smallest image side for the main input's dynamic H and W (the denoiser's reflect padding
        # needs 16 px): refused here as a bad request, naming the limit, rather than as a runtime's error.
        card = json.loads(params.get(CARD_KEY, "{}")).get("input", {})
        dims = card.get("shape", ())
        self.min_size = None
        if len(dims) == 3:
            self.min_size = (card["name"], [ax for ax in (-2, -1) if dims[ax] == -1], int(card.get("min_size", 1)))

    def _feed(self, request) -> dict[str, np.ndarray]:
        """One request's inputs (zero-copy), reshaped to the graph's shapes, defaults filled in."""
        feed: dict[str, np.ndarray] = {}
        missing = []
        for name, dtype, shape, default in self.inputs:
            t = pb_utils.get_input_tensor_by_name(request, name)
            if t is None:
                missing.append((name, dtype, shape, default))
                continue
            a = np.from_dlpack(t)  # zero-copy view of the request's buffer (as_numpy: wrong under NumPy 2)
            if shape is not None and list(a.shape[1:] if self.batching else a.shape) != shape:
                # config `reshape` (dims [1] → graph []), applied here too so either client form works
                a = a.reshape((a.shape[0], *shape) if self.batching else tuple(shape))
            feed[name] = a
        if missing:
            n = next(iter(feed.values())).shape[0] if self.batching and feed else None
            for name, dtype, shape, default in missing:
                if default is None:
                    raise BadInput(f"missing required input {name!r}")
                feed[name] = self._default(name, dtype, ((n,) if n is not None else ()) + tuple(shape or ()), default)
        if self.min_size is not None and self.min_size[0] in feed:
            name, axes, least = self.min_size
            a = feed[name]
            sides = [a.shape[ax] for ax in axes]  # the last two dims are the card's H and W
            if any(d < least for d in sides):
                raise BadInput(f"input {name!r}: {'×'.join(map(str, sides))} is smaller than the model's minimum "
                               f"image side {least} (its card's input.min_size)")
        for name, (lo, hi) in self.profile.items():
            a = feed.get(name)
            if a is not None and (a.ndim != len(lo) or
                                  any(not x <= d <= y for x, d, y in zip(lo, a.shape, hi, strict=True))):
                raise BadInput(f"input {name!r} of shape {list(a.shape)} lies outside the TensorRT optimization "
                                 f"profile (min {list(lo)}, max {list(hi)})")
        return feed

    def _default(self, name: str, dtype, shape: tuple, value) -> np.ndarray:
        """A filled default input, made once per shape (read-only: ONNX Runtime does not write its inputs)."""
        key = (name, shape)
        a = self._defaults.get(key)
        if a is None:
            a = self._defaults[key] = np.full(shape, value, dtype=dtype)
            a.flags.writeable = False
        return a

    def execute(self, requests: list) -> list:
        # The stub copies output tensors into shared memory only after execute() returns, and a
        # DLPack tensor does not own its NumPy array: keep this call's arrays alive until the next.
        self._keep: list[np.ndarray] = []
        responses: list = [None] * len(requests)
        groups: dict[tuple, list[tuple[int, dict[str, np.ndarray]]]] = defaultdict(list)
        for idx, request in enumerate(requests):
            try:
                feed = self._feed(request)
            except Exception as e:  # reported to this request's client
                responses[idx] = _error(e)
                continue
            key = tuple((k, v.shape[1:] if self.batching else v.shape, v.dtype.str) for k, v in sorted(feed.items()))
            groups[key if self.batching else (idx,)].append((idx, feed))
        for members in groups.values():
            try:
                if len(members) == 1:
                    results = [self._run(members[0][1])]
                else:  # one run for the whole group, split back per request
                    sizes = [next(iter(f.values())).shape[0] for _, f in members]
                    cat = {k: np.concatenate([f[k] for _, f in members]) for k in members[0][1]}
                    outs = self._run(cat)
                    cuts = np.cumsum(sizes)[:-1]
                    split = [np.split(o, cuts) for o in outs]
                    results = [[s[j] for s in split] for j in range(len(members))]
                for (idx, _), arrays in zip(members, results, strict=True):
                    tensors = []
                    for (name, dtype, dims), a in zip(self.outputs, arrays, strict=True):
                        a = self._client_shape(np.ascontiguousarray(a, dtype=dtype), dims)
                        self._keep.append(a)
                        tensors.append(_to_triton(name, a))
                    responses[idx] = pb_utils.InferenceResponse(output_tensors=tensors)
            except Exception as e:  # e.g. an image below the model's minimum size
                for idx, _ in members:
                    responses[idx] = _error(e)
        return responses

    def _run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        outs = self.session(feeds)
        return [outs[n] for n in self.output_names]

    def _client_shape(self, a: np.ndarray, dims: list[int] | None) -> np.ndarray:
        """Apply an output ``reshape`` (graph [B] → config dims [1]) so clients see the config's dims."""
        if dims is None or list(a.shape[1:] if self.batching else a.shape) == dims:
            return a
        return a.reshape((a.shape[0], *dims) if self.batching else tuple(dims))

    def finalize(self) -> None:
        self.session = None


#: DLPack's name for a consumed capsule; module-level, since a capsule keeps the pointer, not a copy.
_USED_DLTENSOR = b"used_dltensor"
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.argtypes, _capsule_is_valid.restype = [ctypes.py_object, ctypes.c_char_p], ctypes.c_int
_capsule_set_name = ctypes.pythonapi.PyCapsule_SetName
_capsule_set_name.argtypes, _capsule_set_name.restype = [ctypes.py_object, ctypes.c_char_p], ctypes.c_int


def _to_triton(name: str, a: np.ndarray):
    """``pb_utils.Tensor`` viewing ``a`` (zero-copy), without the stub's bad capsule name reaching NumPy."""
    capsule = a.__dlpack__()
    tensor = pb_utils.Tensor.from_dlpack(name, capsule)
    if _capsule_is_valid(capsule, b"used_dlpack"):  # consumed by the stub, under its own name
        _capsule_set_name(capsule, _USED_DLTENSOR)
    return tensor


class BadInput(UsageError, ValueError):
    """A request the model cannot take (Triton's INVALID_ARG: HTTP 400), as opposed to a failure while running."""


def _error(e: Exception):
    code = pb_utils.TritonError.INVALID_ARG if isinstance(e, BadInput) else pb_utils.TritonError.INTERNAL
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(f"{type(e).__name__}: {e}", code))
