"""``POST /v1/denoise``: a PNG of the input's size and mode (per mode: the docs' table; TIFF or a NumPy array
when ``Accept`` asks), with tensor names, σ scale and minimum size from the card; σ given, or estimated with a
verdict on its reliability (:mod:`.sigma`).

Request flow: API key (401) → model (404) → σ (422) → ``Accept`` (406) → declared size (413) → concurrency slot
(429) → streamed body (413/415/400) → header checks, no pixel decoded (pixel limit, aspect ratio, ``min_size`` and,
for a GPU model, its TensorRT profile's H×W range: 400/413/415/422) → Triton (503/504/502). A model that takes encoded
images (``image_bytes``, :mod:`unroll.serving.imaging.wire`: the CPU configs) gets the upload's bytes and answers the
encoded result and the σ it used (its 4xx mapped back to the gateway's), unless the image is larger than one window
of the card's ``tiling``; for those and for the other models (GPU configs) the gateway decodes, sends float tensors
(windows as separate requests), one call per ``max_batch_size`` items (and never more than the TensorRT profile's max
batch), and encodes the result itself.

Colour follows the card's ``input.shape[0]``: a single-channel denoiser gets each colour channel of an RGB(A)
image as one batch item ``[C, 1, H, W]``; a 3-channel denoiser gets an RGB(A) image natively as ``[1, 3, H, W]``
(in the card's ``channel_order``), and a gray image repeated to three planes, the three outputs averaged back to
one gray plane (so the PNG keeps the input's size and mode either way; alpha is copied).

The same handler answers every task whose route answers an image (``unroll.tasks``: ``Route.answer == "image"``):
where the card has no ``sigma``, the image is the graph's only input and no ``X-Sigma-*`` headers are sent but
``X-Sigma-Residual``: the RMS of what the model removed, a noise estimate from the solver's residual, sent by every
image-to-image answer.
"""

from __future__ import annotations

import time
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from unroll.serving.gateway import tracing
from unroll.serving.gateway.catalog import Entry
from unroll.serving.gateway.errors import ApiError
from unroll.serving.gateway.image_graph import run_image_graph, tiler_for
from unroll.serving.gateway.iterations import DeadlineQuery, ItersQuery, iteration, serving_count
from unroll.serving.gateway.openapi import IMAGE_BODY, errors
from unroll.serving.gateway.state import Gateway, GatewayDep, keyed_router, route_task
from unroll.serving.gateway.triton_client import fit_shape
from unroll.serving.imaging import images, prepare, wire
from unroll.serving.imaging.sigma import QUERY_HELP, SigmaEstimate
from unroll.tasks import Task

#: The noise level the model removed (:func:`~unroll.serving.imaging.images.removed_noise_sigma`, 0–255 scale).
RESIDUAL_HEADER = "X-Sigma-Residual"


async def denoiser(request: Request, gw: GatewayDep, model: Annotated[str | None, Query(
        description="Denoiser to use (default: the first served; see GET /v1/models)",
        examples=["my-denoiser"])] = None) -> Entry:
    """The served model of the route's task that the request names (404 otherwise)."""
    return await gw.catalog.resolve(model, route_task(request))


DenoiserDep = Annotated[Entry, Depends(denoiser)]
_ACCEPT_HELP = (" `Accept: image/tiff` answers the same image as TIFF, `Accept: application/x-npy` as its NumPy array "
                "(.npy: [H, W] or [H, W, C], uint8, uint16 for 16-bit gray, palette indices for P); PNG by default "
                "and for `*/*`, `image/*`, `image/png`; anything else: 406.")


def routes(task: Task) -> APIRouter:
    """``task``'s ``/v1`` route answered with a PNG of the input's size: with the ``sigma`` parameter when the task's
    route takes the card's noise level (denoising), else an image-to-image graph with the image as its only input."""
    assert task.route is not None
    router = keyed_router()
    router.post(task.route.path, tags=["inference"], summary=task.route.summary, openapi_extra=IMAGE_BODY,
                response_class=Response,
                responses={200: {"content": {media: {} for media in wire.OUTPUT_FORMATS.values()},
                                 "description": images.DENOISE_OUTPUT + _ACCEPT_HELP},
                           406: {**errors(415)[415], "description": "`Accept` names no format this route answers"},
                           **errors(400, 404, 408, 413, 415, 422, 429, 502, 503, 504)})(
        denoise if task.route.sigma else image_to_image)
    return router


async def denoise(
    request: Request,
    gw: GatewayDep,
    entry: DenoiserDep,
    sigma: Annotated[float | None, Query(ge=0, le=255, allow_inf_nan=False,
                                         description=QUERY_HELP,
                                         examples=[25])] = None,
    iters: ItersQuery = None,
    deadline_ms: DeadlineQuery = None,
) -> Response:
    return await _answer(request, gw, entry, sigma, iters, deadline_ms)


async def image_to_image(request: Request, gw: GatewayDep, entry: DenoiserDep, iters: ItersQuery = None,
                         deadline_ms: DeadlineQuery = None) -> Response:
    return await _answer(request, gw, entry, None, iters, deadline_ms)


async def _answer(request: Request, gw: Gateway, entry: Entry, sigma: float | None, iters: str | None,
                  deadline_ms: str | None = None) -> Response:
    """The image through ``entry``'s graph (``iters=K``'s where the card serves several counts), in the input's
    size and mode, encoded as ``Accept`` asks (PNG unless told); σ (given or estimated) where the card has a
    noise-level input."""
    t0 = time.perf_counter()
    model, it = entry.name, iteration(gw, entry, iters, deadline_ms, t0)
    card, info = entry.card, entry.info
    assert card is not None and info is not None  # served entries have both (catalog)
    fmt = wire.media_format(request.headers.get("accept"))
    if fmt is None:
        raise ApiError(406, "not_acceptable", f"Accept {request.headers.get('accept')!r}: this route answers "
                                              f"{', '.join(wire.OUTPUT_FORMATS.values())}")
    settings = gw.settings
    with tracing.span("receive"):
        data = await gw.read_image(request)  # before the slot: a slow upload never holds an inference slot
    given = SigmaEstimate(float(sigma) / 255.0) if sigma is not None and card.sigma is not None else None
    hw = info.profile.hw(card.input.name) if info.profile is not None else None
    if hw is not None and card.tiling is not None:  # larger images are cut to the profile: only its minimum
        hw = (hw[0], (2 ** 31, 2 ** 31))
    with tracing.span("decode"):  # the header's checks (the pixels are decoded by the model, or in _decoded)
        w, h = prepare.check_header(data, settings.max_pixels, settings.max_aspect_ratio, hw, entry.name,
                                    card.input.min_size)
    async with serving_count(gw, it, w * h / 1e6, "megapixel") as count, tracing.queued(gw.admission.slot()):
        entry = count.entry  # the graph: iters=K's, or the controller's under a deadline (same input, same card)
        card, info = entry.card, entry.info
        assert card is not None and info is not None
        # An image whose windows (per channel) fit in one execution goes to a model that decodes as its bytes: the
        # model tiles it as the gateway would. A larger one is cut into windows here, each call its own Triton
        # request, so that it shares the model instance with other requests a batch of windows at a time instead of
        # holding it for the whole image (image_graph).
        tiler = tiler_for(entry, h, w)
        if wire.IMAGE_BYTES in info.inputs and (tiler is None or len(tiler.windows()) <= info.batch_limit):
            inputs = {wire.IMAGE_BYTES: wire.image_row(data, info.batched),
                      wire.FORMAT: wire.per_item(wire.code_of(wire.FORMAT_CODES, fmt), np.int32, info.batched)}
            if given is not None:
                level = given.value * 255.0 / card.sigma.scale
                inputs[card.sigma.input] = wire.per_item(level, np.float32, info.batched)
            async with wire.forward_errors():
                res = await gw.infer(entry, inputs, [wire.ENCODED, wire.IMAGE_INFO])
            with tracing.span("encode"):  # the model encoded it: the file is cut from its answer
                meta = wire.read_info(res[wire.IMAGE_INFO][0])
                body = wire.encoded_file(res[wire.ENCODED][0], meta)
            used, removed = given, meta.get("sigma_residual")
            if card.sigma is not None and given is None:  # estimated by the model, with the rules that fired
                rules = tuple(r for r in (meta.get("sigma_rule") or "").split(",") if r)
                used = SigmaEstimate(float(meta["sigma_used"]) / 255.0, rules)
        else:
            body, used, removed = await _decoded(gw, entry, data, given, hw, fmt)
    latency = round((time.perf_counter() - t0) * 1000.0, 2)
    headers = {}
    if card.sigma is not None:
        assert used is not None
        headers = {"X-Sigma-Used": f"{used.value * 255.0:.3f}",
                   "X-Sigma-Estimated": "false" if sigma is not None else "true",
                   "X-Sigma-Reliable": "true" if used.reliable else "false"}
        if used.rule is not None:
            headers["X-Sigma-Rule"] = used.rule
    if removed is not None:  # what the model took away, as a noise level: beside the σ it was given or estimated
        headers[RESIDUAL_HEADER] = f"{float(removed):.3f}"
    headers.update(count.headers())
    return Response(body, media_type=wire.OUTPUT_FORMATS[fmt], headers={**headers, "X-Latency-Ms": str(latency),
                                                                         "X-Model": model})


async def _decoded(gw: Gateway, entry: Entry, data: bytes, given: SigmaEstimate | None,
                   hw: images.HWRange | None, fmt: str) -> tuple[bytes, SigmaEstimate | None, float]:
    """The image decoded here and sent as float tensors (a model without ``image_bytes``, e.g. a GPU config): the
    encoded result, the σ used and the noise level the model removed (:func:`images.removed_noise_sigma`)."""
    card, info, settings = entry.card, entry.info, gw.settings
    assert card is not None and info is not None
    with tracing.span("decode"):
        planes, used = await run_in_threadpool(
            prepare.denoiser_planes, data, settings.max_pixels, None if given is None else given.value * 255.0,
            card.input.min_size, settings.max_aspect_ratio, hw, entry.name,
            card.sigma.max if card.sigma is not None else None)
    batch = images.to_graph(prepare.to_batch(planes.data, card.input), card.input)
    if card.sigma is not None:
        assert used is not None
        sig = fit_shape(np.full(len(batch), used.value * 255.0 / card.sigma.scale, np.float32),
                        info.inputs[card.sigma.input])

        async def infer(x: np.ndarray, level: np.ndarray) -> np.ndarray:
            res = await gw.infer(entry, {card.input.name: x, card.sigma.input: level}, [card.output])
            return res[card.output]
    else:  # the image is the graph's only input
        sig = np.zeros(len(batch), np.float32)

        async def infer(x: np.ndarray, _: np.ndarray) -> np.ndarray:
            return (await gw.infer(entry, {card.input.name: x}, [card.output]))[card.output]

    out = await run_image_graph(entry, batch, sig, infer)  # whole, or in windows (card.tiling)
    removed = await run_in_threadpool(images.removed_noise_sigma, batch, out, card.input)  # a pass over every pixel
    del batch
    with tracing.span("encode"):
        return await run_in_threadpool(prepare.encode_result, out, planes, card.input, fmt), used, removed
