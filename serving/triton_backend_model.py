"""Triton Python-backend model that runs an exported model on the CPU (ONNX Runtime, OpenVINO or AOTInductor), or its
PyTorch module on the CPU or the instance's GPU (the ``torch`` runtime).

:mod:`unroll.serving.repository` copies this file unchanged to ``<model>/1/model.py``; everything model-specific
comes from ``config.pbtxt`` parameters (``onnx_file``, ``cpu_runtime``, ``intra_op_num_threads``,
``intra_op_spinning``, ``static_shapes``, ``inference_precision``, ``aoti_package``, ``input_defaults`` for
optional inputs, ``unroll.card``, ``unroll.max_pixels`` /
``unroll.max_aspect_ratio`` for encoded images, and ``unroll.profile`` in the test-only GPU stand-in, which refuses
inputs outside the profile as TensorRT does). Tensors cross the stub zero-copy through DLPack, because the wheel's
stub predates NumPy 2's dtype ABI and its ``as_numpy()`` returns wrong data under NumPy 2 (``BYTES`` tensors too,
both ways, and DLPack has no ``BYTES``: hence the protocol below is ``UINT8``/``INT32``). One dynamic batch runs as
one ``session.run`` per group of equal shapes; a failing group fails only its requests.

**The torch runtime** (``cpu_runtime`` ``torch``, :mod:`unroll.serving.torch_runtime`): float tensors stay PyTorch
tensors end to end, by DLPack both ways — ``torch.from_dlpack`` of each input (on the GPU where Triton hands it
there: GPU configs set ``FORCE_CPU_ONLY_INPUT_TENSORS`` "no"), joined on the device, run, and answered with
``pb_utils.Tensor.from_dlpack`` of the output on the device: no host round trip in this model for tensors already on
the device (the other runtimes keep the NumPy path above). CUDA graphs are captured at load for the batch sizes this
config's dynamic batcher forms (``max_batch_size``, ``dynamic_batching.preferred_batch_size``); smaller batches are
padded up to the nearest captured size and their outputs sliced (the module's doc). ``inference_precision``
``fp16`` / ``bf16``: half precision only behind the card's fp16 gate, decided at load on the instance's device; a
refusal serves FP32 and the reason is logged (Triton's log, ``verbose`` not needed).

**Encoded images** (:mod:`unroll.serving.imaging.wire`; written into the CPU configs of every classifier and
image-to-image model, e.g. denoisers, by ``unroll repo``). Besides its float input (now optional), such a model takes
``image_bytes`` (``TYPE_UINT8``, dims ``[-1]``, batched like the model): one encoded PNG/JPEG/WebP/TIFF/BMP file per
batch item (several files of different lengths: rows zero-padded at the end; Triton batches requests of equal shapes
only, so clients pad to a few lengths, :func:`unroll.serving.imaging.wire.padded_length`). A request carries exactly
one of the two (``INVALID_ARG`` naming both otherwise); float-tensor clients are unchanged. The image is decoded and
fitted to the card here, exactly as the gateway does (:mod:`unroll.serving.imaging.prepare`), within the same pixel
limit, aspect-ratio limit and decompression-bomb limit (config ``unroll.max_pixels``, ``unroll.max_aspect_ratio``;
defaults the gateway's), the card's ``min_size`` and a TensorRT profile's H×W where one is served.

- Classifier: optional ``invert`` (``TYPE_INT32`` ``[1]``: -1 auto, 0 false, 1 true; default auto where the card
  declares ``input.polarity``, else false) and λ through its optional λ input. Outputs: the logits (Triton's
  classification extension works as before) and ``image_info`` (``TYPE_UINT8`` ``[256]``: UTF-8 JSON padded with
  spaces, ``{"inverted":false}``). The images of a whole dynamic batch are decoded, fitted and run as one
  ``session.run`` per group of equal shapes.
- Image-to-image (denoiser): σ through its σ input (the card's scale, as for tensors) or, when absent, estimated from
  the image (:mod:`unroll.serving.imaging.sigma`, clipped to the card's ``sigma.max``); images larger than the
  card's ``tiling`` window run in overlapping windows, ``max_batch_size`` per ``session.run``. Optional ``format``
  (``TYPE_INT32`` ``[1]``: 0 png (default), 1 tiff, 2 npy). Outputs: ``encoded`` (``TYPE_UINT8`` ``[-1]``: the
  result file at the input's size and mode, as the gateway's PNG; npy: the image's uint8/uint16 array) and
  ``image_info`` (JSON: ``encoded_bytes``, the file's length in its zero-padded row; ``sigma_used`` on the 0–255
  scale, ``sigma_estimated``, ``sigma_reliable``, ``sigma_rule`` or null where the card has σ; ``sigma_residual``,
  the RMS of what the model removed on the same scale: a residual-based noise estimate). The float output is not
  sent for encoded images.

Only requested outputs are built and handed to Triton (``requested_output_names``; Triton names every output when
a client names none): a client that asks for ``logits`` alone does not pay for the solver output's hand-over. A
float-tensor request gets the graph outputs it asks for and, where it asks for it (or for every output),
``image_info`` ``{}`` per item; ``encoded`` only comes from images.
A client error on this path is ``INVALID_ARG`` with a message that starts ``[STATUS CODE]``, the HTTP status and
code the gateway answers (e.g. ``[413 image_too_large] …``; :func:`unroll.serving.imaging.wire.format_error`); a bad
image fails only its own request.
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from unroll.card import CARD_KEY, InputCard, LamCard, SigmaCard, TileCard
from unroll.errors import ApiError, BadInput, ImageRejected, RuntimeUnavailable
from unroll.serving import batch_rows
from unroll.serving.imaging import images, prepare, wire
from unroll.serving.runtimes import DEFAULT_RUNTIME, open_session
from unroll.tiling import Tiler, run_tiled


def _device(args: dict) -> str:
    """The instance's device: ``cuda:N`` for a ``KIND_GPU`` instance (the ``torch`` runtime), else ``cpu``."""
    if args.get("model_instance_kind") == "GPU":
        return f"cuda:{args.get('model_instance_device_id', '0')}"
    return "cpu"


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        cfg = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        self.name = cfg.get("name", "the model")
        onnx_path = Path(args["model_repository"]) / args["model_version"] / params.get("onnx_file", "model.onnx")
        if "intra_op_num_threads" not in params:
            raise pb_utils.TritonModelException("config.pbtxt needs parameters { key: \"intra_op_num_threads\" }")
        runtime = params.get("cpu_runtime", DEFAULT_RUNTIME)
        if runtime == "aotinductor":
            onnx_path = onnx_path.with_name(params.get("aoti_package", "model.pt2"))
        self.max_batch = int(cfg.get("max_batch_size", 0))
        self.batching = self.max_batch > 0
        #: The torch runtime's tensors cross by DLPack as PyTorch tensors (module doc); the others' as NumPy arrays.
        self.dlpack = runtime == "torch"
        precision = params.get("inference_precision", "f32")
        extra = {}
        if self.dlpack:
            from unroll.serving.torch_runtime import capture_sizes

            preferred = cfg.get("dynamic_batching", {}).get("preferred_batch_size", [])
            extra = {"fp16": precision == "fp16",
                     "batch_sizes": capture_sizes(self.max_batch, [int(b) for b in preferred])}
        try:
            # intra_op_spinning "1": threads spin briefly before sleeping (serving/repository.py's measurement).
            self.session = open_session(onnx_path, runtime, int(params["intra_op_num_threads"]),
                                        spinning=params.get("intra_op_spinning", "0") == "1",
                                        static_shapes=params.get("static_shapes", "0") == "1",
                                        bf16=precision == "bf16", device=_device(args), **extra)
        except RuntimeUnavailable as e:  # e.g. the card names OpenVINO and it is not installed here
            raise pb_utils.TritonModelException(f"cpu_runtime {runtime!r}: {e}") from None
        note = getattr(self.session, "precision_note", None)
        if note is not None:  # the torch runtime's half-precision verdict (passed, or why FP32 serves)
            passed = self.session.precision != "fp32"
            (pb_utils.Logger.log_info if passed else pb_utils.Logger.log_warn)(f"{self.name}: {note}")
        names = {i["name"] for i in cfg["input"]}
        # the encoded-image protocol (module docstring): its inputs are no graph inputs; which half of it the
        # config has says the kind (the task, which `unroll repo` looked up, may be unknown in this process)
        self.kind = None if wire.IMAGE_BYTES not in names else "image" if wire.FORMAT in names else "predictions"
        self.card = _card(params[CARD_KEY]) if self.kind is not None else None
        either = set()  # optional without a default: the alternative is an encoded image
        if self.kind is not None:
            assert self.card is not None
            either = {self.card.input.name} | ({self.card.sigma.input} if self.card.sigma is not None else set())
            self.max_pixels = int(params.get(wire.MAX_PIXELS_KEY, wire.DEFAULT_MAX_PIXELS))
            self.max_aspect_ratio = float(params.get(wire.MAX_ASPECT_RATIO_KEY, wire.DEFAULT_MAX_ASPECT_RATIO))
            images.set_pillow_limit(self.max_pixels)
        defaults = json.loads(params.get("input_defaults", "{}"))
        graph = self.session.inputs
        self.inputs = []  # (name, numpy dtype, graph shape without batch if static else None, default or None)
        for i in cfg["input"]:
            name = i["name"]
            if self.kind is not None and name in wire.INPUTS:
                continue
            dims = graph[name][1:] if self.batching else graph[name]
            shape = [int(d) for d in dims] if all(d is not None for d in dims) else None
            default = defaults.get(name)
            if i.get("optional") and default is None and name not in either:
                raise pb_utils.TritonModelException(f"optional input {name!r} has no entry in input_defaults")
            if default is not None and shape is None:
                raise pb_utils.TritonModelException(f"input {name!r}: a default needs a static shape, not {dims}")
            self.inputs.append((name, pb_utils.triton_string_to_numpy(i["data_type"]), shape, default))
        self.outputs = []  # (name, numpy dtype, config dims when all static, else None)
        for o in cfg["output"]:
            if self.kind is not None and o["name"] in wire.OUTPUTS:
                continue
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
            a = self._from_triton(t)  # zero-copy view of the request's buffer (as_numpy: wrong under NumPy 2)
            if shape is not None and list(a.shape[1:] if self.batching else a.shape) != shape:
                # config `reshape` (dims [1] → graph []), applied here too so either client form works
                a = a.reshape((a.shape[0], *shape) if self.batching else tuple(shape))
            feed[name] = a
        if missing:
            n = next(iter(feed.values())).shape[0] if self.batching and feed else None
            for name, dtype, shape, default in missing:
                if default is None:
                    if self.kind is not None and self.card is not None and name == self.card.input.name:
                        raise BadInput(_neither(self.card))
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
        """A filled default input, made once per shape (read-only: ONNX Runtime does not write its inputs; a tensor
        on the torch runtime's path)."""
        key = (name, shape)
        a = self._defaults.get(key)
        if a is None:
            a = np.full(shape, value, dtype=dtype)
            if self.dlpack:
                import torch

                a = torch.from_numpy(a)
            else:
                a.flags.writeable = False
            self._defaults[key] = a
        return a

    def _from_triton(self, t):
        """An input tensor, zero-copy: a PyTorch tensor where it lies (the torch runtime), else a NumPy array."""
        if self.dlpack:
            import torch

            return torch.from_dlpack(t)
        return np.from_dlpack(t)

    def execute(self, requests: list) -> list:
        # The stub copies output tensors into shared memory only after execute() returns, and a
        # DLPack tensor does not own its NumPy array: keep this call's arrays alive until the next.
        self._keep: list[np.ndarray] = []
        responses: list = [None] * len(requests)
        feeds: dict[int, dict[str, np.ndarray]] = {}  # float-tensor requests: run below, equal shapes together
        pictures: dict[int, _Pictures] = {}  # requests with encoded images (classifiers: run below, grouped)
        for idx, request in enumerate(requests):
            try:
                if self.kind is not None and pb_utils.get_input_tensor_by_name(request, wire.IMAGE_BYTES) is not None:
                    if self.kind == "image":
                        responses[idx] = self._image_to_image(request)
                    else:
                        pictures[idx] = self._pictures(request)
                    continue
                feed = self._feed(request)
            except Exception as e:  # reported to this request's client
                responses[idx] = _error(e)
                continue
            feeds[idx] = feed
        # a model without batching runs each request alone (its tensors have no batch axis to join on)
        keys = None if self.batching else list(feeds)
        run = self._run_tensors if self.dlpack else self._run
        for idx, arrays in zip(feeds, batch_rows.run_grouped(list(feeds.values()), run, keys), strict=True):
            try:
                if isinstance(arrays, Exception):  # e.g. an image below the model's minimum size
                    raise arrays
                wanted = set(requests[idx].requested_output_names())  # every output where the client named none
                tensors = self._tensors(arrays, wanted)
                if self.kind is not None and wire.IMAGE_INFO in wanted:
                    # float tensors in: no image was decoded, nothing to report (every item "{}"), so that
                    # clients asking for every output (perf_analyzer) get each one
                    tensors.append(self._rows(wire.IMAGE_INFO, [wire.info_json({})] * len(arrays[0]), b" "))
                responses[idx] = pb_utils.InferenceResponse(output_tensors=tensors)
            except Exception as e:
                responses[idx] = _error(e)
        if pictures:
            self._classify_pictures(pictures, responses)
        return responses

    def _tensors(self, arrays: list[np.ndarray], wanted=None) -> list:
        """Output tensors of the graph's outputs (those in ``wanted`` when given), in the config's dims."""
        tensors = []
        for (name, dtype, dims), a in zip(self.outputs, arrays, strict=True):
            if wanted is not None and name not in wanted:
                continue
            if isinstance(a, np.ndarray):
                a = self._client_shape(np.ascontiguousarray(a, dtype=dtype), dims)
                tensors.append(_to_triton(name, a))
            else:  # a PyTorch tensor (the torch runtime, FP32 like the config's outputs), left on its device
                a = self._client_shape(a, dims).contiguous()
                tensors.append(pb_utils.Tensor.from_dlpack(name, a))
            self._keep.append(a)
        return tensors

    def _run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        outs = self.session(feeds)
        return [outs[n] for n in self.output_names]

    def _run_tensors(self, feeds: dict) -> list:
        """:meth:`_run` on PyTorch tensors, answering tensors on the device (the torch runtime's DLPack path)."""
        outs = self.session.tensors(feeds)
        return [outs[n] for n in self.output_names]

    def _client_shape(self, a: np.ndarray, dims: list[int] | None) -> np.ndarray:
        """Apply an output ``reshape`` (graph [B] → config dims [1]) so clients see the config's dims."""
        if dims is None or list(a.shape[1:] if self.batching else a.shape) == dims:
            return a
        return a.reshape((a.shape[0], *dims) if self.batching else tuple(dims))

    # ------------------------------------------------------------------ encoded images (module docstring)

    def _encoded(self, request) -> list[bytes]:
        """The request's encoded images, one per batch item; refused when the float input comes too."""
        assert self.card is not None
        if pb_utils.get_input_tensor_by_name(request, self.card.input.name) is not None:
            raise ImageRejected(400, "invalid_input", _neither(self.card, both=True))
        raw = _host(pb_utils.get_input_tensor_by_name(request, wire.IMAGE_BYTES))
        return [r.tobytes() for r in raw.reshape(len(raw) if self.batching else 1, -1)]

    def _per_item(self, request, name: str, n: int, codes: dict[int, str] | None = None) -> list | None:
        """Optional per-item input ``name`` as ``n`` values (one given value applies to every item), or ``None``;
        ``codes`` names an INT32 input's values."""
        t = pb_utils.get_input_tensor_by_name(request, name)
        if t is None:
            return None
        vals = _host(t).reshape(-1).tolist()
        if codes is not None:
            bad = [v for v in vals if v not in codes]
            if bad:
                raise ImageRejected(422, "invalid_parameter", f"{name}: {bad[0]} is none of "
                                    + ", ".join(f"{k} ({v})" for k, v in codes.items()))
            vals = [codes[v] for v in vals]
        if len(vals) == 1:
            return vals * n
        if len(vals) != n:
            raise ImageRejected(422, "invalid_parameter", f"{name}: {len(vals)} values for {n} images")
        return vals

    def _hw(self) -> images.HWRange | None:
        """The H×W range of the served TensorRT profile (the stand-in's), ``None`` on the CPU."""
        assert self.card is not None
        r = self.profile.get(self.card.input.name)
        if r is None or any(d >= 0 for d in self.card.input.shape[1:]):
            return None
        lo, hi = r
        return (int(lo[-2]), int(lo[-1])), (int(hi[-2]), int(hi[-1]))

    def _pictures(self, request) -> _Pictures:
        """A classifier request's images decoded and fitted to the card (one failure fails the request)."""
        card = self.card
        assert card is not None
        data = self._encoded(request)
        n = len(data)
        invert = self._per_item(request, wire.INVERT, n, wire.INVERT_CODES) or [None] * n
        lam = None
        if card.lam is not None:
            lam = self._per_item(request, card.lam.input, n)
            if lam is None:
                lam = [float(card.lam.default)] * n
        items = []
        for j, blob in enumerate(data):
            try:
                inv = prepare.check_invert(card.input, invert[j])
                img = images.decode(blob, self.max_pixels, self.max_aspect_ratio)
                fitted = images.classifier_input(img, card.input, inv, self._hw(), self.name)
            except ApiError as e:
                raise _rejected(e, j, n) from None
            feed = {card.input.name: fitted.x}
            if lam is not None:
                feed[card.lam.input] = np.array([lam[j]], np.float32)
            items.append((feed, fitted.inverted))
        return _Pictures(items, set(request.requested_output_names()))

    def _classify_pictures(self, pictures: dict[int, _Pictures], responses: list) -> None:
        """Every image of these requests through the graph, one run per group of equal shapes."""
        owners = [(idx, j) for idx, p in pictures.items() for j in range(len(p.items))]
        results = dict(zip(owners, batch_rows.run_grouped([pictures[i].items[j][0] for i, j in owners], self._run),
                           strict=True))
        for idx, p in pictures.items():
            rows = [results[(idx, j)] for j in range(len(p.items))]
            failed = next((r for r in rows if isinstance(r, Exception)), None)
            if failed is not None:
                responses[idx] = _error(failed)
                continue
            arrays = [np.concatenate([r[k] for r in rows]) for k in range(len(self.outputs))]
            tensors = self._tensors(arrays, p.wanted)
            if wire.IMAGE_INFO in p.wanted:
                tensors.append(self._rows(wire.IMAGE_INFO, [wire.info_json({"inverted": bool(inv)})
                                                            for _, inv in p.items], b" "))
            responses[idx] = pb_utils.InferenceResponse(output_tensors=tensors)

    def _image_to_image(self, request):
        """A denoiser request's images, each decoded, run (in windows where large) and encoded."""
        card = self.card
        assert card is not None
        data = self._encoded(request)
        n = len(data)
        wanted = set(request.requested_output_names())
        formats = self._per_item(request, wire.FORMAT, n, wire.FORMAT_CODES) or [wire.DEFAULT_FORMAT] * n
        sigmas = self._per_item(request, card.sigma.input, n) if card.sigma is not None else None
        encoded, infos = [], []
        hw = self._hw()
        if hw is not None and card.tiling is not None:  # larger images are cut to the profile: only its minimum
            hw = (hw[0], (2 ** 31, 2 ** 31))
        for j, blob in enumerate(data):
            try:
                fmt = formats[j]
                if fmt not in wire.OUTPUT_FORMATS:
                    raise ApiError(422, "invalid_parameter", f"format: expected png, tiff or npy (got {fmt!r})")
                given = None if sigmas is None else float(sigmas[j]) * card.sigma.scale
                if given is not None and not (np.isfinite(given) and given >= 0):
                    raise ApiError(422, "invalid_parameter", f"sigma: must be a finite number ≥ 0 (got {given})")
                planes, used = prepare.denoiser_planes(
                    blob, self.max_pixels, given, card.input.min_size, self.max_aspect_ratio, hw, self.name,
                    card.sigma.max if card.sigma is not None else None)
                batch = images.to_graph(prepare.to_batch(planes.data, card.input), card.input)
            except ApiError as e:
                raise _rejected(e, j, n) from None
            extra = {}
            info: dict = {}
            if card.sigma is not None:
                assert used is not None
                sigma255 = used.value * 255.0
                extra[card.sigma.input] = np.full(len(batch), sigma255 / card.sigma.scale, np.float32)
                info = {"sigma_used": sigma255, "sigma_estimated": given is None, "sigma_reliable": used.reliable,
                        "sigma_rule": used.rule}
            if wire.ENCODED in wanted:
                out = self._whole_or_tiled(batch, extra)
                info["sigma_residual"] = images.removed_noise_sigma(batch, out, card.input)
                del batch
                encoded.append(prepare.encode_result(out, planes, card.input, fmt))
                info["encoded_bytes"] = len(encoded[-1])
            infos.append(wire.info_json(info))
        tensors = []
        if wire.ENCODED in wanted:
            tensors.append(self._rows(wire.ENCODED, encoded, b"\0"))
        if wire.IMAGE_INFO in wanted:
            tensors.append(self._rows(wire.IMAGE_INFO, infos, b" "))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _whole_or_tiled(self, batch: np.ndarray, extra: dict[str, np.ndarray]) -> np.ndarray:
        """``batch`` ``[N, C, H, W]`` through the graph, ``max_batch_size`` items (or windows, for an image larger
        than the card's ``tiling`` window) per run: the gateway's :mod:`~unroll.serving.gateway.image_graph`."""
        card = self.card
        assert card is not None
        step = max(self.max_batch, 1)
        hw = self._hw()
        max_side = min(hw[1]) if hw is not None else None

        def run(x: np.ndarray, ex: dict[str, np.ndarray]) -> np.ndarray:
            return self.session({card.input.name: x, **ex})[card.output]

        if card.tiling is not None and Tiler(batch.shape[2], batch.shape[3], card.tiling, max_side).needed:
            return run_tiled(batch, extra, run, card.tiling, step, max_side)
        out = np.empty_like(batch)
        for i in range(0, len(batch), step):
            out[i:i + step] = run(batch[i:i + step], {k: v[i:i + step] for k, v in extra.items()})
        return out

    def _rows(self, name: str, values: list[bytes], pad: bytes):
        """A ``UINT8`` output, one padded row per item (:func:`.wire.rows`)."""
        a = wire.rows(values, pad)
        if not self.batching:
            a = a.reshape(-1)
        self._keep.append(a)
        return _to_triton(name, a)

    def finalize(self) -> None:
        self.session = None


class _Card:
    """What the encoded-image path reads of the model's card (``unroll.card``), each part validated on its own."""

    def __init__(self, raw: dict) -> None:
        self.input = InputCard.model_validate(raw["input"])
        self.output: str = raw["output"]
        self.lam = LamCard.model_validate(raw["lam"]) if raw.get("lam") else None
        self.sigma = SigmaCard.model_validate(raw["sigma"]) if raw.get("sigma") else None
        self.tiling = TileCard.model_validate(raw["tiling"]) if raw.get("tiling") else None


def _card(text: str) -> _Card:
    try:
        return _Card(json.loads(text))
    except Exception as e:
        raise pb_utils.TritonModelException(f"config parameter {CARD_KEY}: {type(e).__name__}: {e}") from None


class _Pictures:
    """A classifier request's fitted images: ``items`` ``[(graph feed of batch 1, inverted)]``, outputs wanted."""

    def __init__(self, items: list[tuple[dict[str, np.ndarray], bool]], wanted: set[str]) -> None:
        self.items, self.wanted = items, wanted


def _neither(card: _Card, both: bool = False) -> str:
    return (f"send exactly one of {wire.IMAGE_BYTES!r} (encoded image files, UINT8) and {card.input.name!r} "
            f"(float32 tensors){': this request has both' if both else ''}")


def _rejected(e: ApiError, j: int, n: int) -> ImageRejected:
    where = f" (image {j} of {n})" if n > 1 else ""
    return ImageRejected(e.http_status, e.code, f"{e}{where}")


#: DLPack's name for a consumed capsule; module-level, since a capsule keeps the pointer, not a copy.
_USED_DLTENSOR = b"used_dltensor"
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.argtypes, _capsule_is_valid.restype = [ctypes.py_object, ctypes.c_char_p], ctypes.c_int
_capsule_set_name = ctypes.pythonapi.PyCapsule_SetName
_capsule_set_name.argtypes, _capsule_set_name.restype = [ctypes.py_object, ctypes.c_char_p], ctypes.c_int


def _host(t) -> np.ndarray:
    """An input as a NumPy array: zero-copy on the host, copied from the GPU where Triton handed it there (a GPU
    config's inputs stay where they lie)."""
    if t.is_cpu():
        return np.from_dlpack(t)
    import torch  # (only the torch runtime's GPU configs receive tensors on the GPU)

    return torch.from_dlpack(t).cpu().numpy()


def _to_triton(name: str, a: np.ndarray):
    """``pb_utils.Tensor`` viewing ``a`` (zero-copy), without the stub's bad capsule name reaching NumPy."""
    capsule = a.__dlpack__()
    tensor = pb_utils.Tensor.from_dlpack(name, capsule)
    if _capsule_is_valid(capsule, b"used_dlpack"):  # consumed by the stub, under its own name
        _capsule_set_name(capsule, _USED_DLTENSOR)
    return tensor


def _error(e: Exception):
    code = pb_utils.TritonError.INVALID_ARG if isinstance(e, BadInput) else pb_utils.TritonError.INTERNAL
    text = str(e) if isinstance(e, ImageRejected) else f"{type(e).__name__}: {e}"
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(text, code))
