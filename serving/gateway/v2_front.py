"""``/v2``: Triton's own HTTP inference protocol, answered by the gateway after every declared size is checked.

A Triton-direct client (``tritonclient.http`` pointed at the gateway's port, or ``curl`` with a JSON header and
binary tensors) gets what Triton's ``/v2/models/{model}[/versions/{v}]/infer`` gives — the same body, the binary
extension, Triton's ``classification`` extension — behind the gateway's API key, rate limit, body limit and
admission control, and only after :mod:`.v2_protocol` has checked each input: its declared shape's byte size equals
what it sent, its datatype, rank, fixed dimensions and batch size are the model's, and an image tensor stays within
the gateway's pixel limit. Triton 2.45 does none of this for a Python-backend model, whose process a lying shape
kills; Triton's own ports need a key only the serving user holds (``unroll serve``), so this is the way in for
everyone else. ``GET /v2/models/{model}`` gives the model's metadata (names, datatypes, shapes); ``GET /v2``,
``.../config`` and ``.../stats`` give Triton's server metadata, model configuration and statistics, which is what
``perf_analyzer -i http`` reads around its measurements, so it drives this front as it drives Triton.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from fastapi import Path, Request
from fastapi.responses import Response

from unroll.serving.gateway import v2_protocol
from unroll.serving.gateway.catalog import Entry
from unroll.serving.gateway.errors import ApiError
from unroll.serving.gateway.openapi import errors
from unroll.serving.gateway.state import Gateway, GatewayDep, keyed_router
from unroll.serving.gateway.triton_client import ModelInfo
from unroll.serving.imaging import wire

router = keyed_router("/v2")
SERVED_EXTENSIONS = frozenset({"classification", "binary_tensor_data", "model_configuration", "statistics"})

ModelName = Annotated[str, Path(description="A model Triton has loaded (any: `GET /v1/models` lists them)",
                                examples=["my-classifier"])]
_BODY = {"requestBody": {"required": True, "description": "Triton's v2 inference request: a JSON header, then the "
                         "binary tensors it declares (`Inference-Header-Content-Length` gives the header's length)",
                         "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                                     "application/json": {"schema": {"type": "object"}}}}}
_ERRORS = errors(400, 404, 408, 413, 429, 502, 503, 504)


def check_inputs(inputs: dict[str, Any], info: ModelInfo, entry: Entry, max_pixels: int) -> None:
    """Each input against the model: a name it takes, its datatype and rank, its fixed dimensions, one batch size
    within the model's limit, every required input present, and the card's image input within ``max_pixels``."""
    batch: int | None = None
    for name, arr in inputs.items():
        want = info.inputs.get(name)
        if want is None:
            raise ApiError(400, "invalid_tensor", f"{info.name} has no input {name!r}; it takes "
                           f"{', '.join(info.inputs)}")
        shape = arr.shape
        if v2_protocol.datatype(arr) != want.datatype or len(shape) != len(want.shape) or any(
                w >= 0 and d != w for d, w in zip(shape, want.shape, strict=True)):
            raise ApiError(400, "invalid_tensor", f"input {name!r}: {info.name} takes {want.datatype} "
                           f"{list(want.shape)} (-1: any size), not {v2_protocol.datatype(arr)} {list(shape)}")
        if info.batched:
            if batch is not None and shape[0] != batch:
                raise ApiError(400, "invalid_tensor", f"input {name!r}: batch {shape[0]}, other inputs {batch}")
            batch = shape[0]
    if batch is not None and not 1 <= batch <= info.batch_limit:
        raise ApiError(400, "invalid_tensor", f"batch size {batch}: {info.name} takes 1 to {info.batch_limit}")
    missing = [n for n, t in info.inputs.items() if not t.optional and n not in inputs]
    if missing:
        raise ApiError(400, "invalid_tensor", f"{info.name} needs input(s) {', '.join(missing)}")
    card = entry.card
    image = inputs.get(card.input.name) if card is not None else None
    if image is not None and image.ndim >= 2 and math.prod(image.shape[-2:]) > max_pixels:
        raise ApiError(413, "image_too_large", f"input {card.input.name!r}: {image.shape[-2]}×{image.shape[-1]} "
                       f"is over the {max_pixels}-pixel limit")


async def _infer(request: Request, gw: Gateway, model: str, version: str | None) -> Response:
    entry = await gw.catalog.loaded(model)
    info = entry.info
    assert info is not None  # Catalog.loaded returns entries with Triton's metadata
    if version is not None and entry.versions and version not in {v.version for v in entry.versions
                                                                  if v.state == "READY"}:
        raise ApiError(404, "unknown_version", f"{model} has no ready version {version!r}; ready: "
                       f"{', '.join(v.version for v in entry.versions if v.state == 'READY') or 'none'}")
    body = await gw.read_body(request)  # before the slot, as every upload (state.Gateway.read_image)
    req = v2_protocol.parse(body, request.headers.get(v2_protocol.HEADER_LENGTH), gw.settings.max_body_bytes)
    check_inputs(req.inputs, info, entry, gw.settings.max_pixels)
    wanted = req.outputs if req.outputs is not None else \
        [v2_protocol.Requested(n, req.binary_default) for n in info.outputs]
    unknown = [o.name for o in wanted if o.name not in info.outputs]
    if unknown:
        raise ApiError(400, "invalid_tensor", f"{model} has no output(s) {', '.join(unknown)}; it gives "
                       f"{', '.join(info.outputs)}")
    # The client asks classification of the first output it names (Triton's client sends it so): first here too.
    ordered = sorted(wanted, key=lambda o: o.class_count is None)
    async with gw.admission.slot(), wire.forward_errors():
        res = await gw.infer(entry, req.inputs, [o.name for o in ordered], ordered[0].class_count, version)
    out, headers = v2_protocol.encode(model, version, req.request_id, {o.name: res[o.name] for o in wanted},
                                      {o.name: o.binary for o in wanted})
    return Response(out, headers=headers)


@router.post("/models/{model}/infer", tags=["triton"], responses=_ERRORS, openapi_extra=_BODY,
             summary="Triton's v2 inference request, checked, then sent to Triton (the version its traffic split "
                     "draws)")
async def infer(request: Request, gw: GatewayDep, model: ModelName) -> Response:
    return await _infer(request, gw, model, None)


@router.post("/models/{model}/versions/{version}/infer", tags=["triton"], responses=_ERRORS, openapi_extra=_BODY,
             summary="Triton's v2 inference request to one version of the model, checked, then sent to Triton")
async def infer_version(request: Request, gw: GatewayDep, model: ModelName,
                        version: Annotated[str, Path(pattern=r"^[0-9]{1,9}$", examples=["1"])]) -> Response:
    return await _infer(request, gw, model, version)


@router.get("/models/{model}", tags=["triton"], responses=errors(404, 503, 504),
            summary="The model's metadata as Triton gives it: its inputs' and outputs' names, datatypes and shapes")
async def metadata(gw: GatewayDep, model: ModelName) -> dict[str, Any]:
    entry = await gw.catalog.loaded(model)
    info = entry.info
    assert info is not None

    def tensors(group: dict) -> list[dict[str, Any]]:
        return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in group.values()]

    return {"name": info.name, "versions": [v.version for v in entry.versions if v.state == "READY"],
            "platform": info.runtime or "", "inputs": tensors(info.inputs), "outputs": tensors(info.outputs)}


@router.get("", tags=["triton"], responses=errors(503, 504),
            summary="Triton's server metadata: its name, version and protocol extensions (clients such as "
                    "perf_analyzer read it first)")
async def server_metadata(gw: GatewayDep) -> dict[str, Any]:
    meta = await gw.triton.server_metadata()
    # Only the extensions this front answers: a client must not be told of shared memory or repository control.
    meta["extensions"] = [e for e in meta.get("extensions", []) if e in SERVED_EXTENSIONS]
    return meta


@router.get("/models/{model}/config", tags=["triton"], responses=errors(404, 503, 504),
            summary="The model's configuration as Triton's HTTP API gives it (what perf_analyzer reads first)")
async def config(gw: GatewayDep, model: ModelName) -> dict[str, Any]:
    await gw.catalog.loaded(model)
    return await gw.triton.model_config_json(model)


@router.get("/models/{model}/stats", tags=["triton"], responses=errors(404, 503, 504),
            summary="Triton's inference statistics of the model, every version (what perf_analyzer reads around "
                    "each measurement window for its server-side split)")
async def stats(gw: GatewayDep, model: ModelName) -> dict[str, Any]:
    await gw.catalog.loaded(model)
    return await gw.triton.model_statistics(model)


@router.get("/models/{model}/versions/{version}/stats", tags=["triton"], responses=errors(404, 503, 504),
            summary="Triton's inference statistics of one version of the model")
async def version_stats(gw: GatewayDep, model: ModelName,
                        version: Annotated[str, Path(pattern=r"^[0-9]{1,9}$", examples=["1"])]) -> dict[str, Any]:
    await gw.catalog.loaded(model)
    return await gw.triton.model_statistics(model, version)
