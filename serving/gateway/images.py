"""Image decoding and conversion with Pillow: bytes → model tensors → PNG, with the limits checked first.

Rules (documented in the README and the OpenAPI description):

* Accepted formats: PNG, JPEG, WebP, TIFF, BMP (Pillow is restricted to these, so no other decoder ever
  runs on client bytes). Multi-frame files (TIFF, animated WebP) use their first frame.
* The pixel count comes from the header and is checked *before* any pixel is decoded; Pillow's own
  decompression-bomb guard (``Image.MAX_IMAGE_PIXELS``) is set to the same limit as a second line.
* Classification, driven by the model's card (``card.input``): EXIF orientation applied; alpha flattened
  onto **black**; colour converted to the card's (``gray``: RGB → luma, ITU-R 601-2 as Pillow's ``L``;
  ``rgb``: three planes, a gray image repeated); fitted to the card's fixed H×W by its ``resize`` policy
  (``pad-square``: padded with black to a centred square, then resized; ``stretch``: resized; Lanczos,
  clipped to [0, 1]); scaled to the card's value range and normalised per channel, ``(x - mean) / std``.
  Images are never inverted automatically (digit classifiers trained white on black need such input).
* Denoising: the stored pixel grid is kept (no EXIF rotation, no resize). Gray, RGB, gray+alpha and
  RGBA keep their mode (for a single-channel denoiser each colour channel is one item of a batch
  ``[C,1,H,W]``; alpha is copied); 16-bit gray stays 16-bit. PNG cannot hold palette, 1-bit, CMYK, YCbCr,
  LAB or HSV images: those come back as RGB(A) or 8-bit gray. Float images are refused (415). Metadata is not copied.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError
from unroll.serving.gateway.errors import ApiError

from unroll.card import InputCard

#: Content type → Pillow format; these and nothing else are decoded.
CONTENT_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP",
                 "image/tiff": "TIFF", "image/bmp": "BMP", "image/x-ms-bmp": "BMP"}
FORMATS = ("PNG", "JPEG", "WEBP", "TIFF", "BMP")
_TO_RGB = {"CMYK", "YCbCr", "LAB", "HSV", "RGBX"}
_16BIT = {"I;16", "I;16L", "I;16B", "I;16N"}
#: Magic bytes of common image formats that are deliberately not decoded (→ 415 rather than "not an image").
_UNSUPPORTED_MAGIC = {b"GIF87a": "GIF", b"GIF89a": "GIF", b"\x00\x00\x00\x0cjP  ": "JPEG 2000", b"%PDF": "PDF",
                      b"\x00\x00\x01\x00": "ICO", b"8BPS": "PSD", b"%!PS": "PostScript"}


def set_pillow_limit(max_pixels: int) -> None:
    """Make Pillow's decompression-bomb guard agree with the gateway's pixel limit (process-wide).

    Pillow raises above 2× the limit and only warns between 1× and 2×; :func:`decode` refuses
    everything above 1× itself right after reading the header, so the warning is silenced.
    """
    Image.MAX_IMAGE_PIXELS = max_pixels
    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


def decode(data: bytes, max_pixels: int) -> Image.Image:
    """Decode an uploaded image, refusing bombs before decoding and mapping every failure to a 4xx."""
    if not data:
        raise ApiError(400, "invalid_image", "empty body: send an image (PNG, JPEG, WebP, TIFF or BMP)")
    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as e:
        raise ApiError(413, "image_too_large", f"image rejected as a decompression bomb: {e}") from None
    except UnidentifiedImageError:
        for magic, fmt in _UNSUPPORTED_MAGIC.items():
            if data.startswith(magic):
                raise ApiError(415, "unsupported_media_type",
                               f"{fmt} is not accepted; send PNG, JPEG, WebP, TIFF or BMP") from None
        raise ApiError(400, "invalid_image", "not a PNG, JPEG, WebP, TIFF or BMP image") from None
    except Exception as e:  # any decoder failure on client bytes is the client's problem, not a 500
        raise ApiError(400, "invalid_image", f"cannot read image header: {type(e).__name__}: {e}") from None
    w, h = img.size
    if w * h > max_pixels:
        raise ApiError(413, "image_too_large", f"image is {w}×{h} = {w * h} pixels; the limit is {max_pixels}")
    if w < 1 or h < 1:
        raise ApiError(400, "invalid_image", f"image has no pixels ({w}×{h})")
    try:
        img.load()
    except Image.DecompressionBombError as e:
        raise ApiError(413, "image_too_large", f"image rejected as a decompression bomb: {e}") from None
    except MemoryError:
        raise ApiError(413, "image_too_large", "image too large to decode") from None
    except Exception as e:
        raise ApiError(400, "invalid_image", f"truncated or corrupt image: {type(e).__name__}: {e}") from None
    return img


@dataclass
class Planes:
    """An image as float channels in [0, 1] plus what is needed to write it back in its own mode."""

    data: np.ndarray  # [C, H, W] float32, the colour (or gray) channels
    alpha: np.ndarray | None  # [H, W] uint8, copied through untouched
    mode: str  # PNG mode to write: L, LA, RGB, RGBA or I;16

    @property
    def bits(self) -> int:
        return 16 if self.mode == "I;16" else 8


def to_planes(img: Image.Image) -> Planes:
    """Split any supported mode into float channels (+ alpha); refuse modes PNG cannot round-trip."""
    mode = img.mode
    if mode == "1":
        img, mode = img.convert("L"), "L"
    elif mode in ("P", "PA"):
        has_alpha = mode == "PA" or "transparency" in img.info
        img = img.convert("RGBA" if has_alpha else "RGB")
        mode = img.mode
    elif mode in _TO_RGB:
        img, mode = img.convert("RGB"), "RGB"
    elif mode in ("La", "RGBa"):
        img = img.convert(mode.upper())
        mode = img.mode
    if mode in _16BIT:
        arr = np.asarray(img, dtype=np.float32) / 65535.0
        return Planes(arr[None], None, "I;16")
    if mode == "I":
        raw = np.asarray(img)
        if raw.size and (raw.min() < 0 or raw.max() > 65535):
            raise ApiError(415, "unsupported_image_mode",
                           "32-bit integer image with values outside 0..65535 (only 8- and 16-bit are supported)")
        return Planes((raw.astype(np.float32) / 65535.0)[None], None, "I;16")
    if mode not in ("L", "LA", "RGB", "RGBA"):
        raise ApiError(415, "unsupported_image_mode",
                       f"image mode {img.mode!r} is not supported (8/16-bit gray, RGB(A), palette, CMYK are)")
    arr = np.asarray(img)
    if arr.ndim == 2:
        arr = arr[..., None]
    alpha = arr[..., -1].copy() if mode in ("LA", "RGBA") else None
    color = arr[..., :-1] if alpha is not None else arr
    return Planes(np.ascontiguousarray(color.transpose(2, 0, 1), dtype=np.float32) / 255.0, alpha, mode)


def from_planes(data: np.ndarray, like: Planes) -> Image.Image:
    """Float channels ``[C,H,W]`` → a PIL image in ``like``'s mode (rounded, clipped, alpha re-attached)."""
    top = 65535 if like.bits == 16 else 255
    q = np.rint(np.clip(data, 0.0, 1.0) * top).astype(np.uint16 if like.bits == 16 else np.uint8)
    if like.mode == "I;16":
        return Image.fromarray(q[0])
    bands = [Image.fromarray(c) for c in q]
    if like.alpha is not None:
        bands.append(Image.fromarray(like.alpha))
    return Image.merge(like.mode, bands)


def encode_png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=3)  # level 3: ~2× faster than 6, a few % larger
    return buf.getvalue()


def classifier_input(img: Image.Image, card: InputCard) -> np.ndarray:
    """``[1, C, H, W]`` float32 for a classifier, following the rules in the module docstring and its card.

    Alpha is flattened onto black; colour is converted to the card's (``gray`` → luma, ``rgb`` → three planes,
    a gray image repeated); the image is fitted to the card's fixed H×W by its ``resize`` policy (``pad-square``,
    ``stretch``; ``none`` needs the exact size, a dynamic input keeps the image's); then scaled to the card's
    value range and normalised per channel with its ``mean`` / ``std``.
    """
    img = ImageOps.exif_transpose(img)
    planes = to_planes(img)
    x = planes.data
    if planes.alpha is not None:
        x = x * (planes.alpha.astype(np.float32) / 255.0)
    x = _colour(x, card.colour)
    size = card.fixed_hw
    if size is not None and x.shape[1:] != size:
        x = np.stack([_fit(c, size, card.resize) for c in x])
    return to_graph(x[None], card)


def to_graph(x: np.ndarray, card: InputCard) -> np.ndarray:
    """``[N, C, H, W]`` in [0, 1] → the card's value range, normalised per channel: ``(x - mean) / std``."""
    lo, hi = card.value_range
    mean, std = _stats(card)
    return np.ascontiguousarray((lo + x * (hi - lo) - mean) / std, dtype=np.float32)


def from_graph(y: np.ndarray, card: InputCard) -> np.ndarray:
    """The inverse of :func:`to_graph`, for a graph whose output is an image like its input (denoisers)."""
    lo, hi = card.value_range
    mean, std = _stats(card)
    return ((y * std + mean) - lo) / (hi - lo)


def _stats(card: InputCard) -> tuple[np.ndarray, np.ndarray]:
    return (np.asarray(card.mean, np.float32).reshape(-1, 1, 1),  # broadcasts over [N, C, H, W] and [C, H, W]
            np.asarray(card.std, np.float32).reshape(-1, 1, 1))


def _colour(x: np.ndarray, colour: str | None) -> np.ndarray:
    """``[C, H, W]`` planes in the card's colour: luma (ITU-R 601-2, as Pillow's ``L``) or RGB."""
    if colour == "gray":
        return x if len(x) == 1 else (0.299 * x[0] + 0.587 * x[1] + 0.114 * x[2])[None]
    if colour == "rgb":
        return x if len(x) == 3 else np.repeat(x, 3, axis=0)
    raise ApiError(422, "unsupported_model_input", f"the model's input is not an image (card colour {colour!r})")


def _fit(plane: np.ndarray, size: tuple[int, int], resize: str) -> np.ndarray:
    """One ``[H, W]`` plane fitted to ``size``: centred black padding to a square first for ``pad-square``."""
    th, tw = size
    if resize == "none":
        h, w = plane.shape
        raise ApiError(422, "invalid_image_size", f"image is {w}×{h}; the model takes exactly {tw}×{th} "
                                                  "(its card allows no resizing)")
    if resize == "pad-square":
        h, w = plane.shape
        side = max(h, w)
        square = np.zeros((side, side), np.float32)
        top, left = (side - h) // 2, (side - w) // 2
        square[top:top + h, left:left + w] = plane
        plane = square
    out = np.asarray(Image.fromarray(plane.astype(np.float32)).resize((tw, th), Image.Resampling.LANCZOS))
    return np.clip(out, 0.0, 1.0)


def estimate_sigma(planes: Planes) -> float:
    """Noise σ on the [0, 1] scale: wavelet-MAD estimate (Donoho), averaged over the colour channels."""
    from skimage.restoration import estimate_sigma as _est

    return float(_est(planes.data, channel_axis=0, average_sigmas=True))
