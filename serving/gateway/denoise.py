"""``POST /v1/denoise``: a PNG of the input's size and mode (per mode: the README's table), with tensor names,
σ scale and minimum size from the card; σ given, or estimated with a verdict on its reliability (:mod:`.sigma`).

Request flow: API key (401) → model (404) → σ (422) → declared size (413) → concurrency slot (429) →
streamed body (413/415/400) → decode (pixel limit, aspect ratio and, for a GPU model, its TensorRT profile's H×W range
from the header: 413/422), size check against ``card.input.min_size`` (400/413/422) → Triton (503/504/502), one call
per ``max_batch_size`` items (and never more than the TensorRT profile's max batch).

Colour follows the card's ``input.shape[0]``: a single-channel denoiser gets each colour channel of an RGB(A)
image as one batch item ``[C, 1, H, W]``; a 3-channel denoiser gets an RGB(A) image natively as ``[1, 3, H, W]``
(in the card's ``channel_order``), and a gray image repeated to three planes, the three outputs averaged back to
one gray plane (so the PNG keeps the input's size and mode either way; alpha is copied).

The same handler answers every task whose route answers an image (``unroll.tasks``: ``Route.answer == "image"``):
where the card has no ``sigma``, the image is the graph's only input and no ``X-Sigma-*`` headers are sent.
"""

from __future__ import annotations

import time
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from unroll.card import InputCard
from unroll.serving.gateway.body import check_declared_length
from unroll.serving.gateway.catalog import Entry
from unroll.serving.gateway.errors import ApiError
from unroll.serving.gateway.image_graph import run_image_graph
from unroll.serving.gateway.openapi import IMAGE_BODY, errors
from unroll.serving.gateway.state import Gateway, GatewayDep, route_task, v1_router
from unroll.serving.gateway.triton_client import fit_shape
from unroll.serving.imaging import images
from unroll.serving.imaging.sigma import QUERY_HELP, SigmaEstimate
from unroll.serving.imaging.sigma import estimate as estimate_sigma
from unroll.tasks import Task


async def denoiser(request: Request, gw: GatewayDep, model: Annotated[str | None, Query(
        description="Denoiser to use (default: the first served; see GET /v1/models)",
        examples=["my-denoiser"])] = None) -> Entry:
    """The served model of the route's task that the request names (404 otherwise)."""
    return await gw.catalog.resolve(model, route_task(request))


DenoiserDep = Annotated[Entry, Depends(denoiser)]


def routes(task: Task) -> APIRouter:
    """``task``'s ``/v1`` route answered with a PNG of the input's size: with the ``sigma`` parameter when the task's
    route takes the card's noise level (denoising), else an image-to-image graph with the image as its only input."""
    assert task.route is not None
    router = v1_router()
    router.post(task.route.path, tags=["inference"], summary=task.route.summary, openapi_extra=IMAGE_BODY,
                response_class=Response,
                responses={200: {"content": {"image/png": {}}, "description": images.DENOISE_OUTPUT},
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
) -> Response:
    return await _answer(request, gw, entry, sigma)


async def image_to_image(request: Request, gw: GatewayDep, entry: DenoiserDep) -> Response:
    return await _answer(request, gw, entry, None)


async def _answer(request: Request, gw: Gateway, entry: Entry, sigma: float | None) -> Response:
    """The image through ``entry``'s graph, as a PNG of its size and mode; σ (given or estimated) where the card
    has a noise-level input."""
    t0 = time.perf_counter()
    card, info = entry.card, entry.info
    assert card is not None and info is not None  # served entries have both (catalog)
    settings = gw.settings
    check_declared_length(request, settings.max_body_bytes)
    data = await gw.read_image(request)  # before the slot: a slow upload never holds an inference slot
    async with gw.admission.slot():
        hw = info.profile.hw(card.input.name) if info.profile is not None else None
        if hw is not None and card.tiling is not None:  # larger images are cut to the profile: only its minimum
            hw = (hw[0], (2 ** 31, 2 ** 31))
        planes, used = await run_in_threadpool(_planes, data, settings.max_pixels, sigma, card.input.min_size,
                                               settings.max_aspect_ratio, hw, entry.name,
                                               card.sigma.max if card.sigma is not None else None)
        batch = images.to_graph(_batch(planes.data, card.input), card.input)
        if card.sigma is not None:
            sigma255 = used.value * 255.0
            sig = fit_shape(np.full(len(batch), sigma255 / card.sigma.scale, np.float32),
                            info.inputs[card.sigma.input])

            async def infer(x: np.ndarray, level: np.ndarray) -> np.ndarray:
                res = await gw.backend.infer(entry.name, {card.input.name: x, card.sigma.input: level}, [card.output])
                return res[card.output]
        else:  # the image is the graph's only input
            sig = np.zeros(len(batch), np.float32)

            async def infer(x: np.ndarray, _: np.ndarray) -> np.ndarray:
                return (await gw.backend.infer(entry.name, {card.input.name: x}, [card.output]))[card.output]

        out = await run_image_graph(entry, batch, sig, infer)  # whole, or in windows (card.tiling)
        del batch
        png = await run_in_threadpool(_png, out, planes, card.input)
    latency = round((time.perf_counter() - t0) * 1000.0, 2)
    headers = {}
    if card.sigma is not None:
        headers = {"X-Sigma-Used": f"{sigma255:.3f}", "X-Sigma-Estimated": "false" if sigma is not None else "true",
                   "X-Sigma-Reliable": "true" if used.reliable else "false"}
        if used.rule is not None:
            headers["X-Sigma-Rule"] = used.rule
    return Response(png, media_type="image/png", headers={**headers, "X-Latency-Ms": str(latency),
                                                          "X-Model": entry.name})


def _planes(data: bytes, max_pixels: int, sigma: float | None, min_side: int,
            max_aspect_ratio: float = float("inf"), profile_hw: images.HWRange | None = None,
            model: str = "the denoiser", sigma_max: float | None = 50.0
            ) -> tuple[images.Planes, SigmaEstimate | None]:
    """Decoded planes (upright) and σ on the [0, 1] scale: given (reliable), or estimated from the image and clipped
    to ``sigma_max`` (0–255 scale, the card's ``sigma.max``) with the rules that made it unreliable
    (:mod:`~unroll.serving.imaging.sigma`); σ is ``None`` when ``sigma_max`` is (a graph without a σ input). An image
    outside the TensorRT profile of a GPU model (``profile_hw``) is refused from its header, before any pixel is
    decoded."""
    def fits(w: int, h: int) -> None:
        images.check_profile_size(w, h, profile_hw, model)

    planes = images.to_planes(images.decode(data, max_pixels, max_aspect_ratio, fits))
    h, w = planes.data.shape[1:]
    if min(h, w) < min_side:
        raise ApiError(422, "image_too_small", f"image is {w}×{h}; the denoiser needs both sides ≥ {min_side} pixels")
    if sigma_max is None:  # a graph without a noise-level input
        return planes, None
    if sigma is not None:
        return planes, SigmaEstimate(float(sigma) / 255.0)
    return planes, estimate_sigma(planes.data, sigma_max / 255.0)


def _png(out: np.ndarray, planes: images.Planes, card: InputCard) -> bytes:
    """The graph's output back to a PNG in the input's mode (off the event loop: full-size array work)."""
    den = _unbatch(images.from_graph(out, card), planes.data.shape[0], card)
    del out
    return images.encode_png(images.from_planes(den, planes))


def _batch(planes: np.ndarray, card: InputCard) -> np.ndarray:
    """``[C, H, W]`` image planes (RGB order) → the graph's ``[N, C', H, W]``: a single-channel denoiser takes
    the colour channels as a batch; a colour one takes the image natively as one item ``[1, 3, H, W]`` in its
    ``channel_order`` (a gray image repeated to the three planes)."""
    c, want = planes.shape[0], card.shape[0]
    if want == 1:
        return planes[:, None]
    if c == 1:
        return np.repeat(planes, want, axis=0)[None]
    if c == want:
        return (planes[::-1] if card.channel_order == "bgr" else planes)[None]
    raise ApiError(422, "unsupported_image_mode", f"a {c}-channel image cannot be fed to a {want}-channel denoiser")


def _unbatch(out: np.ndarray, channels: int, card: InputCard) -> np.ndarray:
    """The inverse of :func:`_batch`: back to ``[C, H, W]`` in RGB order (a repeated gray image's outputs averaged
    back to one plane, so a gray image comes back gray)."""
    if out.shape[1] == 1:
        return out[:, 0]
    if channels == 1:
        return out[0].mean(axis=0, keepdims=True)
    return out[0, ::-1] if card.channel_order == "bgr" else out[0]
