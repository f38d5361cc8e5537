"""From an uploaded image to a model's tensors and back: the one implementation the gateway and the Triton model share.

The gateway (``serving/gateway/classify.py``, ``denoise.py``) and the Python-backend model
(:mod:`unroll.serving.triton_backend_model`, for the encoded-image protocol of :mod:`.wire`) both call these, so an
image decoded, fitted, denoised and encoded in Triton gives the bytes the gateway gave. Every refusal is an
:class:`~unroll.errors.ApiError` with the gateway's status and code (the model carries it as
:func:`.wire.format_error`).
"""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image

from unroll.card import InputCard
from unroll.errors import ApiError
from unroll.serving.imaging import images
from unroll.serving.imaging.sigma import SigmaEstimate
from unroll.serving.imaging.sigma import estimate as estimate_sigma


def check_invert(card: InputCard, invert: images.Invert | None) -> images.Invert:
    """``invert`` for this model: the default is ``auto`` where the card declares a polarity, else ``false``;
    ``auto`` for a card without one is a client error (there is nothing to decide from)."""
    if invert is None:
        return "auto" if card.polarity is not None else "false"
    if invert not in ("auto", "true", "false"):
        raise ApiError(422, "invalid_parameter", f"invert: expected auto, true or false (got {invert!r})")
    if invert == "auto" and card.polarity is None:
        raise ApiError(422, "invalid_parameter", "invert=auto: the model's card declares no polarity "
                                                 "(input.polarity); pass invert=true or invert=false")
    return invert


def check_header(data: bytes, max_pixels: int, max_aspect_ratio: float = math.inf,
                 profile_hw: images.HWRange | None = None, model: str = "the model",
                 min_side: int | None = None) -> tuple[int, int]:
    """The checks the gateway makes on an upload's header without decoding a pixel (the same refusals as
    :func:`images.decode`'s first half, then the TensorRT profile's H×W and ``min_side``, on the size as displayed);
    returns that ``(W, H)``. Whatever needs the pixels (a truncated file) is left to the decoder."""
    img = images.open_header(data, max_pixels, max_aspect_ratio)
    w, h = images.displayed_size(img)
    images.check_profile_size(w, h, profile_hw, model)
    if min_side is not None:
        check_min_side(w, h, min_side)
    return w, h


def check_min_side(w: int, h: int, min_side: int) -> None:
    if min(h, w) < min_side:
        raise ApiError(422, "image_too_small", f"image is {w}×{h}; the denoiser needs both sides ≥ {min_side} pixels")


def denoiser_planes(data: bytes, max_pixels: int, sigma: float | None, min_side: int,
                    max_aspect_ratio: float = math.inf, profile_hw: images.HWRange | None = None,
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
    check_min_side(w, h, min_side)
    if sigma_max is None:  # a graph without a noise-level input
        return planes, None
    if sigma is not None:
        return planes, SigmaEstimate(float(sigma) / 255.0)
    return planes, estimate_sigma(planes.data, sigma_max / 255.0)


def to_batch(planes: np.ndarray, card: InputCard) -> np.ndarray:
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


def from_batch(out: np.ndarray, channels: int, card: InputCard) -> np.ndarray:
    """The inverse of :func:`to_batch`: back to ``[C, H, W]`` in RGB order (a repeated gray image's outputs averaged
    back to one plane, so a gray image comes back gray)."""
    if out.shape[1] == 1:
        return out[:, 0]
    if channels == 1:
        return out[0].mean(axis=0, keepdims=True)
    return out[0, ::-1] if card.channel_order == "bgr" else out[0]


def result_image(out: np.ndarray, planes: images.Planes, card: InputCard) -> Image.Image:
    """The graph's output ``[N, C', H, W]`` (graph scale) back to an image in the input's size and mode."""
    den = from_batch(images.from_graph(out, card), planes.data.shape[0], card)
    del out
    return images.from_planes(den, planes)


def encode_result(out: np.ndarray, planes: images.Planes, card: InputCard, fmt: str = "png") -> bytes:
    """The graph's output encoded as ``fmt`` (:data:`.wire.OUTPUT_FORMATS`) in the input's mode (off the event
    loop: full-size array work)."""
    return encode(result_image(out, planes, card), fmt)


def encode(img: Image.Image, fmt: str = "png") -> bytes:
    """``png`` (:func:`images.encode_png`), ``tiff`` (uncompressed, with the ICC profile and EXIF the PNG would
    carry) or ``npy`` (the image's array: ``[H, W]`` or ``[H, W, C]``, uint8, or uint16 for 16-bit gray; a palette
    image's indices; a bilevel image as 0/255)."""
    if fmt == "png":
        return images.encode_png(img)
    buf = io.BytesIO()
    if fmt == "tiff":
        extra = {k: img.info[k] for k in ("icc_profile", "exif") if img.info.get(k)}
        img.save(buf, format="TIFF", **extra)
    elif fmt == "npy":
        a = np.asarray(img)
        np.save(buf, a.astype(np.uint8) * 255 if a.dtype == bool else a, allow_pickle=False)
    else:
        raise ApiError(422, "invalid_parameter", f"format: expected png, tiff or npy (got {fmt!r})")
    return buf.getvalue()


def protocol_kind(card) -> str | None:
    """Which encoded-image protocol (:mod:`.wire`) a model with this card serves: ``"predictions"`` (a classifier:
    logits, ``invert``), ``"image"`` (an image-to-image graph such as a denoiser: ``encoded``, σ where the card has
    one), or ``None`` (its task has no gateway route, or its input is not an image)."""
    from unroll import tasks

    if card.task not in tasks.names() or card.input.colour not in ("gray", "rgb") or len(card.input.shape) != 3:
        return None
    route = tasks.get(card.task).route
    return None if route is None else route.answer
