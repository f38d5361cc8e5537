"""Image decoding and conversion with Pillow: bytes → model tensors → PNG, with the limits checked first.

Only PNG, JPEG, WebP, TIFF and BMP are decoded (no other decoder runs on client bytes). The pixel count and aspect
ratio come from the header and are checked before any pixel is decoded, and every array allocated here is bounded
by the pixel limit or the model's input size, never by the longer side squared (:func:`work_bytes_bound`). What a
classifier's card asks (colour, polarity, resize policy, normalisation) and the mode each denoised PNG comes back
in are the docs' REST API rules, tested row by row by ``tests/test_denoise_contract.py``.
"""

from __future__ import annotations

import io
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from unroll.card import InputCard
from unroll.errors import ApiError
from unroll.serving.imaging import palette as palettes
from unroll.serving.imaging import sigma as sigmas

#: What ``POST /v1/denoise`` returns (its OpenAPI description; docs/rest-api.md has it as a table).
DENOISE_OUTPUT = (
    "The denoised image as PNG, at the input's size as displayed, in the input's mode where PNG has one: 1, L, LA, "
    "RGB, RGBA and 16-bit gray (I;16) are kept; a palette image (P) comes back as P with the input's palette and "
    "transparency (each pixel the nearest palette colour among entries of its own alpha); PA → RGBA; CMYK, LAB and "
    "JPEG's YCbCr → RGB; 32-bit integer gray (values 0..65535) → I;16; 16-bit colour PNGs are read as 8-bit RGB(A); "
    "float images are refused (415). Upright: the EXIF orientation is applied and the Orientation tag not written, "
    "so it displays like the input in any viewer. The input's EXIF (JPEG, PNG, WebP; without Orientation) and ICC "
    "profile (not for CMYK or LAB) are copied; alpha is copied exactly; other metadata is not. Headers: "
    "X-Sigma-Used (0–255 scale), X-Sigma-Estimated, X-Sigma-Reliable, X-Sigma-Rule (only when not reliable; see "
    "the `sigma` parameter), X-Sigma-Residual (the RMS of what the model removed, on the same scale: a "
    "residual-based noise estimate beside the one used), X-Latency-Ms, X-Model."
)
#: zlib level of the PNGs written (denoised answers): measured by ``unroll bench png-level`` (encode CPU time against
#: size on real photos, ``benchmarks/results/png_level.md``), whose choice ``tests/test_png_level.py`` holds this to.
PNG_LEVEL = 1
#: Content type → Pillow format; these and nothing else are decoded.
CONTENT_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP",
                 "image/tiff": "TIFF", "image/bmp": "BMP", "image/x-ms-bmp": "BMP"}
FORMATS = ("PNG", "JPEG", "WEBP", "TIFF", "BMP")
_TO_RGB = {"CMYK", "YCbCr", "LAB", "HSV", "RGBX"}
_16BIT = {"I;16", "I;16L", "I;16B", "I;16N"}
#: Modes whose ICC profile describes a colour space the RGB output is not in (Pillow converts without it).
_NO_ICC = {"CMYK", "LAB", "HSV"}
_ORIENTATION = 0x0112
#: Magic bytes of common image formats that are deliberately not decoded (→ 415 rather than "not an image").
_UNSUPPORTED_MAGIC = {b"GIF87a": "GIF", b"GIF89a": "GIF", b"\x00\x00\x00\x0cjP  ": "JPEG 2000", b"%PDF": "PDF",
                      b"\x00\x00\x01\x00": "ICO", b"8BPS": "PSD", b"%!PS": "PostScript"}
#: Resampling weights are evaluated this many at a time (bounded temporaries however long a side is).
_CHUNK = 16384
#: ITU-R 601-2 luma weights (Pillow's ``L``).
_LUMA = (0.299, 0.587, 0.114)

Invert = Literal["auto", "true", "false"]


def set_pillow_limit(max_pixels: int) -> None:
    """Make Pillow's decompression-bomb guard agree with the gateway's pixel limit (process-wide).

    Pillow raises above 2× the limit and only warns between 1× and 2×; :func:`decode` refuses
    everything above 1× itself right after reading the header, so the warning is silenced.
    """
    Image.MAX_IMAGE_PIXELS = max_pixels
    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


def _bomb(e: Exception, max_pixels: int) -> ApiError:
    """Pillow's bomb refusal quotes its own threshold (2× ``MAX_IMAGE_PIXELS``); the client needs ours."""
    m = re.search(r"\((\d+) pixels\)", str(e))
    claimed = f"its header claims {int(m.group(1))} pixels" if m else "its header claims over twice the limit"
    return ApiError(413, "image_too_large",
                    f"image rejected as a decompression bomb: {claimed}; the limit is {max_pixels} pixels")


def _num(v: float) -> str:
    """``50000``, ``2.5``, ``33.33``: a ratio as people write it (no exponent)."""
    return f"{v:.2f}".rstrip("0").rstrip(".")


def decode(data: bytes, max_pixels: int, max_aspect_ratio: float = math.inf,
           check: Callable[[int, int], None] | None = None) -> Image.Image:
    """Decode an uploaded image, refusing bombs and absurd shapes before decoding; every failure is a 4xx.

    ``check(width, height)``, when given, runs on the header's size before any pixel is decoded (e.g.
    :func:`check_profile_size`) and refuses by raising :class:`ApiError`.
    """
    img = open_header(data, max_pixels, max_aspect_ratio)
    if check is not None:
        check(*displayed_size(img))
    try:
        img.load()
    except Image.DecompressionBombError as e:
        raise _bomb(e, max_pixels) from None
    except MemoryError:
        raise ApiError(413, "image_too_large", "image too large to decode") from None
    except Exception as e:
        raise ApiError(400, "invalid_image", f"truncated or corrupt image: {type(e).__name__}: {e}") from None
    return img


def open_header(data: bytes, max_pixels: int, max_aspect_ratio: float = math.inf) -> Image.Image:
    """The image with only its header read, refused (:class:`ApiError`) when it is not one of :data:`FORMATS`,
    claims over ``max_pixels`` pixels (a decompression bomb) or an aspect ratio over ``max_aspect_ratio``."""
    if not data:
        raise ApiError(400, "invalid_image", "empty body: send an image (PNG, JPEG, WebP, TIFF or BMP)")
    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as e:
        raise _bomb(e, max_pixels) from None
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
    ratio = max(w, h) / min(w, h)
    if ratio > max_aspect_ratio:
        raise ApiError(422, "aspect_ratio_too_large", f"image is {w}×{h}, an aspect ratio of {_num(ratio)}:1; "
                                                      f"the limit is {_num(max_aspect_ratio)}:1")
    return img


def displayed_size(img: Image.Image) -> tuple[int, int]:
    """``(W, H)`` as a viewer shows the image: swapped when its EXIF orientation (5–8) turns it by 90°. Read from
    the header only: a PNG whose header has no EXIF keeps its stored size (Pillow would decode the pixels to look
    for an eXIf chunk after them)."""
    if img.format == "PNG" and "exif" not in img.info:
        return img.size
    try:
        turned = img.getexif().get(_ORIENTATION) in (5, 6, 7, 8)
    except Exception:  # a corrupt EXIF block: no orientation (the pipelines treat it the same way)
        turned = False
    return (img.height, img.width) if turned else img.size


#: Images up to this many pixels (header) into a model input up to this many are prepared on the event loop.
INLINE_PIXELS = 64 * 64


def is_small(data: bytes, card: InputCard) -> bool:
    """Whether the upload's header says ≤ :data:`INLINE_PIXELS` pixels and the card's fixed input is no larger:
    cheap enough to decode and fit without leaving the event loop. Unreadable headers say no (the threadpool
    path reports them)."""
    fixed = card.fixed_hw
    if fixed is None or fixed[0] * fixed[1] > INLINE_PIXELS:
        return False
    try:
        w, h = Image.open(io.BytesIO(data), formats=FORMATS).size
    except Exception:
        return False
    return w * h <= INLINE_PIXELS


#: ``((min_h, min_w), (max_h, max_w))``: the image sizes a GPU model's TensorRT profile covers.
HWRange = tuple[tuple[int, int], tuple[int, int]]


def check_profile_size(w: int, h: int, hw: HWRange | None, model: str) -> None:
    """An image's size against the TensorRT optimization profile a GPU model is served with (``unroll.profile``).

    The engine covers no H or W outside the profile, so a larger image is refused here with 413 naming the
    profile's largest H×W (Triton would fail it with an opaque error), a smaller one with 422. ``hw=None`` (a
    CPU model, or a fixed-size input that is resized anyway): no check.
    """
    if hw is None:
        return
    (min_h, min_w), (max_h, max_w) = hw
    if h > max_h or w > max_w:
        raise ApiError(413, "image_too_large",
                       f"image is {w}×{h} (W×H); {model} runs a TensorRT engine whose optimization profile takes "
                       f"at most H×W = {max_h}×{max_w}: send a smaller image (or tiles of it), or widen the card's "
                       "trt_profile and rebuild the engine")
    if h < min_h or w < min_w:
        raise ApiError(422, "image_too_small",
                       f"image is {w}×{h} (W×H); {model} runs a TensorRT engine whose optimization profile takes "
                       f"at least H×W = {min_h}×{min_w}")


@dataclass
class Planes:
    """An image as float channels in [0, 1] plus what is needed to write it back in its own mode."""

    data: np.ndarray  # [C, H, W] float32, the colour (or gray) channels
    alpha: np.ndarray | None  # [H, W] uint8, copied through untouched
    mode: str  # PNG mode to write: 1, L, LA, P, RGB, RGBA or I;16
    palette: palettes.Palette | None = None  # mode P: the input's palette (the colours are mapped back onto it)
    icc_profile: bytes | None = None  # the input's, unless its colour space was converted (CMYK, LAB, HSV)
    exif: bytes | None = None  # the input's EXIF without its Orientation tag (the pixels are upright)

    @property
    def bits(self) -> int:
        return 16 if self.mode == "I;16" else 8


@dataclass
class Pixels:
    """An image's stored values in a PNG-writable mode, unscaled: what both pipelines start from."""

    color: np.ndarray  # [H, W, C] uint8, uint16 or int32 (a view: no copy beyond Pillow's export)
    alpha: np.ndarray | None  # [H, W] uint8
    mode: str  # L, LA, RGB, RGBA or I;16
    top: float  # the value that means full brightness (255 or 65535)


def pixels(img: Image.Image) -> Pixels:
    """Bring any supported mode to L/LA/RGB/RGBA/16-bit gray and export it once; refuse what PNG cannot hold."""
    mode = img.mode
    if mode == "1":
        img, mode = img.convert("L"), "L"
    elif mode in ("P", "PA"):
        has_alpha = (mode == "PA" or "transparency" in img.info
                     or (img.palette is not None and img.palette.mode == "RGBA"))
        img = img.convert("RGBA" if has_alpha else "RGB")
        mode = img.mode
    elif mode in _TO_RGB:
        img, mode = img.convert("RGB"), "RGB"
    elif mode in ("La", "RGBa"):
        img = img.convert(mode.upper())
        mode = img.mode
    if mode in _16BIT:
        return Pixels(np.asarray(img)[..., None], None, "I;16", 65535.0)
    if mode == "I":
        raw = np.asarray(img)
        if raw.size and (raw.min() < 0 or raw.max() > 65535):
            raise ApiError(415, "unsupported_image_mode",
                           "32-bit integer image with values outside 0..65535 (only 8- and 16-bit are supported)")
        return Pixels(raw[..., None], None, "I;16", 65535.0)
    if mode not in ("L", "LA", "RGB", "RGBA"):
        raise ApiError(415, "unsupported_image_mode",
                       f"image mode {img.mode!r} is not supported (8/16-bit gray, RGB(A), palette, CMYK are)")
    arr = np.asarray(img)
    if arr.ndim == 2:
        arr = arr[..., None]
    alpha = arr[..., -1] if mode in ("LA", "RGBA") else None
    return Pixels(arr[..., :-1] if alpha is not None else arr, alpha, mode, 255.0)


def to_planes(img: Image.Image) -> Planes:
    """Any supported mode, turned upright by its EXIF orientation, as float channels (+ alpha) and what is needed to
    write the result back in the input's mode (the docs' table); modes PNG cannot hold map to the
    nearest it can, float images are refused (415)."""
    exif = _upright(img)
    mode = img.mode
    pal = palettes.of(img) if mode == "P" else None
    icc = None if mode in _NO_ICC else img.info.get("icc_profile") or None
    px = pixels(img)
    data = np.empty((px.color.shape[2], *px.color.shape[:2]), np.float32)
    for c in range(len(data)):  # one channel at a time: no [H, W, C] float temporary
        np.divide(px.color[..., c], np.float32(px.top), out=data[c], dtype=np.float32)
    out_mode = "1" if mode == "1" else "P" if pal is not None else px.mode
    return Planes(data, None if px.alpha is None else px.alpha.copy(), out_mode, pal, icc, exif)


def _upright(img: Image.Image) -> bytes | None:
    """Apply ``img``'s EXIF orientation in place (as a viewer would) and return its EXIF block (JPEG, PNG, WebP)
    without the Orientation tag, ``None`` when there is nothing else. A TIFF's tags describe its own file layout
    and are not copied; a corrupt EXIF block is ignored (no rotation, no EXIF copied)."""
    try:
        ImageOps.exif_transpose(img, in_place=True)  # also drops the tag from the image's EXIF and XMP
        raw = img.info.get("exif")
        if not raw:
            return None
        exif = Image.Exif()
        exif.load(raw)
        exif.pop(_ORIENTATION, None)
        return exif.tobytes() if len(exif) else None
    except Exception:
        return None


def from_planes(data: np.ndarray, like: Planes) -> Image.Image:
    """Float channels ``[C,H,W]`` → a PIL image in ``like``'s mode (rounded, clipped, alpha re-attached)."""
    top = 65535 if like.bits == 16 else 255
    q = np.clip(data, 0.0, 1.0)  # one full-size float copy, scaled and rounded in place
    q *= np.float32(top)
    q = np.rint(q, out=q).astype(np.uint16 if like.bits == 16 else np.uint8)
    if like.mode in ("I;16", "L") and like.alpha is None:
        out = Image.fromarray(q[0])
    elif like.mode == "1":
        out = Image.fromarray(q[0] >= 128)  # bilevel again: thresholded at mid-grey (no dithering)
    elif like.mode == "P" and like.palette is not None:
        out = palettes.quantize(q, like.alpha, like.palette)
    else:
        bands = [Image.fromarray(c) for c in q]
        if like.alpha is not None:
            bands.append(Image.fromarray(like.alpha))
        out = Image.merge(like.mode, bands)
    if like.icc_profile:
        out.info["icc_profile"] = like.icc_profile
    if like.exif:
        out.info["exif"] = like.exif
    return out


def encode_png(img: Image.Image) -> bytes:
    """PNG bytes with the image's ICC profile (iCCP), EXIF (eXIf) and palette transparency (tRNS), if it has them."""
    buf = io.BytesIO()
    extra = {k: img.info[k] for k in ("icc_profile", "exif") if img.info.get(k)}
    img.save(buf, format="PNG", compress_level=PNG_LEVEL, **extra)
    return buf.getvalue()


@dataclass
class Fitted:
    """A classifier's input and what was decided on the way (reported to the client)."""

    x: np.ndarray  # [1, C, H, W] float32, ready for the graph
    inverted: bool


def classifier_input(img: Image.Image, card: InputCard, invert: Invert = "false",
                     profile_hw: HWRange | None = None, model: str = "the model") -> Fitted:
    """``[1, C, H, W]`` float32 for a classifier, following its card.

    Alpha is flattened onto black; colour is converted to the card's (``gray`` → luma, ``rgb`` → three planes in
    its ``channel_order``, a gray image repeated); inverted per ``invert``; fitted to the card's fixed H×W by its
    ``resize`` policy and ``interpolation`` (``pad-square``, ``stretch``, ``shorter-side-crop``; ``none`` needs
    the exact size; a dynamic input keeps the image's, within ``min_size``); then scaled
    to the card's value range and normalised per channel with its ``mean`` / ``std``. EXIF orientation is
    applied to ``img`` in place (so a second call, e.g. for a λ rule, does not rotate twice). A dynamic-size
    input served by a TensorRT engine is also held to its profile's H×W range (``profile_hw``, see
    :func:`check_profile_size`).
    """
    if card.colour not in ("gray", "rgb"):
        raise ApiError(422, "unsupported_model_input",
                       f"the model's input is not an image (card colour {card.colour!r})")
    ImageOps.exif_transpose(img, in_place=True)
    size = card.fixed_hw
    if size is None:
        _check_dynamic_size(img.size, card)
        check_profile_size(*img.size, profile_hw, model)
    px = pixels(img)
    inverted = _should_invert(px, card, invert)
    n_in = px.color.shape[2]
    order = (0,) if card.colour == "gray" else (2, 1, 0) if card.channel_order == "bgr" else (0, 1, 2)
    planes: list[np.ndarray] = []
    for c in order:
        if planes and n_in == 1:  # a gray image repeated to the card's three planes: fitted once
            planes.append(planes[0])
            continue
        plane = _plane(px, c, card.colour)
        if inverted:
            np.subtract(np.float32(1.0), plane, out=plane)
        if size is not None and (plane.shape != size or card.resize == "shorter-side-crop"):  # crop: always
            plane = _fit(plane, size, card)
        planes.append(plane)
    return Fitted(to_graph(np.stack(planes)[None], card), inverted)


def _check_dynamic_size(wh: tuple[int, int], card: InputCard) -> None:
    """A dynamic-size input takes the image as it is, within the card's ``min_size`` and any fixed axis."""
    w, h = wh
    if min(w, h) < card.min_size:
        raise ApiError(422, "image_too_small", f"image is {w}×{h}; the model needs both sides ≥ {card.min_size} "
                                               "pixels")
    for axis, got in ((1, h), (2, w)):
        if card.shape[axis] > 0 and card.shape[axis] != got:
            raise ApiError(422, "invalid_image_size", f"image is {w}×{h}; the model takes "
                                                      f"{'height' if axis == 1 else 'width'} {card.shape[axis]}")


def to_graph(x: np.ndarray, card: InputCard) -> np.ndarray:
    """``[N, C, H, W]`` in [0, 1] → the card's value range, normalised per channel: ``(x - mean) / std``."""
    lo, hi = card.value_range
    mean, std = _stats(card)
    out = np.multiply(x, np.float32(hi - lo), dtype=np.float32)  # the one full-size array; the rest is in place
    out += np.float32(lo)
    out -= mean
    out /= std
    return out


def from_graph(y: np.ndarray, card: InputCard) -> np.ndarray:
    """The inverse of :func:`to_graph`, for a graph whose output is an image like its input (denoisers)."""
    lo, hi = card.value_range
    mean, std = _stats(card)
    out = np.multiply(y, std, dtype=np.float32)  # in place from here: one full-size array
    out += mean
    out -= np.float32(lo)
    out /= np.float32(hi - lo)
    return out


#: Rows per block of :func:`removed_noise_sigma` (its temporary is one block, not the image).
_ROWS = 64


def removed_noise_sigma(noisy: np.ndarray, denoised: np.ndarray, card: InputCard) -> float:
    """What a denoiser took away, as a noise level on the 0–255 scale: the RMS of ``noisy − denoised`` (both
    ``[N, C, H, W]`` in the graph's scale, as :func:`to_graph` gives them) over every pixel. For a denoiser that
    removed exactly the noise, the noise's σ; a residual-based estimate beside the wavelet one it was given."""
    _, std = _stats(card)
    lo, hi = card.value_range
    total, count = 0.0, 0
    for r in range(0, noisy.shape[-2], _ROWS):
        d = noisy[..., r:r + _ROWS, :] - denoised[..., r:r + _ROWS, :]
        d *= std / np.float32(hi - lo)  # per channel, back to [0, 1]
        total += float(np.vdot(d.ravel(), d.ravel()))
        count += d.size
    return math.sqrt(total / max(count, 1)) * 255.0


def _stats(card: InputCard) -> tuple[np.ndarray, np.ndarray]:
    return (np.asarray(card.mean, np.float32).reshape(-1, 1, 1),  # broadcasts over [N, C, H, W] and [C, H, W]
            np.asarray(card.std, np.float32).reshape(-1, 1, 1))


def _plane(px: Pixels, c: int, colour: str) -> np.ndarray:
    """Plane ``c`` of the card's colour as ``[H, W]`` float32 in [0, 1], alpha-flattened onto black.

    Built in one float buffer (plus one for luma's terms): the peak is two planes, whatever the image's mode.
    """
    col = px.color
    out = np.empty(col.shape[:2], np.float32)
    if colour == "gray" and col.shape[2] == 3:
        tmp = np.empty_like(out)
        np.multiply(col[..., 0], np.float32(_LUMA[0]), out=out, dtype=np.float32)
        for k in (1, 2):
            np.multiply(col[..., k], np.float32(_LUMA[k]), out=tmp, dtype=np.float32)
            out += tmp
        del tmp
    else:
        np.copyto(out, col[..., c if col.shape[2] > 1 else 0], casting="unsafe")
    out *= np.float32(1.0 / px.top)
    if px.alpha is not None:
        out *= px.alpha  # uint8 → float32 in numpy's small cast buffers, not a full-size copy
        out *= np.float32(1.0 / 255.0)
    return out


def _frame(a: np.ndarray, per_side: int = 1024) -> np.ndarray:
    """The outermost pixel frame of ``[H, W, ...]``, at most ``per_side`` evenly spaced pixels of each side (so
    it stays small for a 1-pixel-thin image, whose frame is all of it; the median hardly notices)."""
    h, w = a.shape[:2]
    sw, sh = -(-w // per_side), -(-h // per_side)
    return np.concatenate([a[0, ::sw], a[-1, ::sw], a[::sh, 0], a[::sh, -1]])


def border_brightness(px: Pixels) -> float:
    """Median luma (0–1, alpha-flattened onto black) of the image's outermost pixel frame: its background
    (sampled, see :func:`_frame`)."""
    col = _frame(px.color).astype(np.float64) / px.top
    luma = col @ np.asarray(_LUMA) if col.shape[-1] == 3 else col[..., 0]
    if px.alpha is not None:
        luma = luma * (_frame(px.alpha) / 255.0)
    return float(np.median(luma))


def _should_invert(px: Pixels, card: InputCard, invert: Invert) -> bool:
    """``invert`` resolved for this image. ``auto`` needs ``card.polarity`` and inverts when the median luma of the
    image's outermost pixel frame is on the other side of mid-grey (0.5) from the card's background."""
    if invert == "auto":
        if card.polarity is None:
            raise ApiError(422, "invalid_parameter", "invert=auto: the model's card declares no polarity "
                                                     "(input.polarity); pass invert=true or invert=false")
        bright = border_brightness(px)
        return bright > 0.5 if card.polarity == "light-on-dark" else bright < 0.5
    return invert == "true"


def _fit(plane: np.ndarray, size: tuple[int, int], card: InputCard) -> np.ndarray:
    """One ``[H, W]`` plane fitted to ``size`` by the card's ``resize`` policy and filter, clipped to [0, 1].

    ``pad-square`` gives what Pillow's resize of the plane padded with black to a centred square gives, without
    building the square (a 50000×1 image would need a 50000² one): the padding only adds zero terms to each
    output's sum, so each pass weighs the image's own rows or columns with Pillow's weights for the square's.
    ``shorter-side-crop`` computes only the outputs inside the centred crop of the resized image (the resized
    image itself is never built). The two separable passes run in the order with the smaller intermediate, so
    the work arrays are bounded by the plane plus ``min(H·tw, th·W)`` floats (at most ``max(th, tw)·√(H·W)``).
    """
    th, tw = size
    h, w = plane.shape
    kind = card.interpolation
    if card.resize == "none":
        raise ApiError(422, "invalid_image_size", f"image is {w}×{h}; the model takes exactly {tw}×{th} "
                                                  "(its card allows no resizing)")
    first = (0, 0)
    if card.resize == "pad-square":
        side = max(h, w)
        canvas, offset, scaled = (side, side), ((side - h) // 2, (side - w) // 2), (th, tw)
    elif card.resize == "shorter-side-crop":
        scaled = shorter_side_size((h, w), size, card.crop_ratio)
        canvas, offset = (h, w), (0, 0)
        first = (int(round((scaled[0] - th) / 2.0)), int(round((scaled[1] - tw) / 2.0)))  # torchvision's centre
    else:
        canvas, offset, scaled = (h, w), (0, 0), (th, tw)
    rows = (0, canvas[0], offset[0], scaled[0], kind, first[0], th)
    cols = (1, canvas[1], offset[1], scaled[1], kind, first[1], tw)
    if h * tw <= th * w:  # columns first (Pillow's order), or rows first when that intermediate is smaller
        out = _resample(_resample(plane, *cols), *rows)
    else:
        out = _resample(_resample(plane, *rows), *cols)
    return np.clip(out, 0.0, 1.0, out=out)


def shorter_side_size(hw: tuple[int, int], size: tuple[int, int], crop_ratio: float) -> tuple[int, int]:
    """Resized ``(H', W')`` of an ``hw`` image for ``shorter-side-crop`` to ``size``: the aspect kept, the image
    just covering ``floor(size / crop_ratio)`` (for a square ``size``: the shorter side becomes
    ``floor(side / crop_ratio)`` and the longer ``int(that · longer / shorter)``, as torchvision's ``Resize(int)``)."""
    (h, w), (th, tw) = hw, size
    sh, sw = (math.floor(t / crop_ratio + 1e-9) for t in (th, tw))
    if sh * w >= sw * h:  # the height decides (sh / h ≥ sw / w)
        return sh, max(int(sh * w / h), tw)
    return max(int(sw * h / w), th), sw


def _resample(a: np.ndarray, axis: int, canvas: int, offset: int, n_out: int, kind: str = "lanczos",
              first: int = 0, count: int | None = None) -> np.ndarray:
    """Resize ``a`` along ``axis`` as if it sat at ``offset`` on a black line of ``canvas`` pixels, to ``n_out``
    (Pillow's filter ``kind``); only outputs ``first … first + count`` are computed (a centred crop)."""
    n = a.shape[axis]
    count = n_out - first if count is None else count
    shape = (count, a.shape[1]) if axis == 0 else (a.shape[0], count)
    out = np.zeros(shape, np.float32)
    if canvas == n_out:  # no resampling along this axis (Pillow skips the pass): padding or cropping only
        lo, hi = max(offset, first), min(offset + n, first + count)
        if lo < hi:
            src = slice(lo - offset, hi - offset)
            dst = slice(lo - first, hi - first)
            if axis == 0:
                out[dst] = a[src]
            else:
                out[:, dst] = a[:, src]
        return out
    scale = canvas / n_out
    support = _SUPPORT[kind] * max(scale, 1.0)
    for j in range(count):
        i = first + j
        lo, hi = _window(i, scale, support, canvas)
        a0, a1 = max(lo, offset), min(hi, offset + n)  # the part of the window on the image
        if a0 >= a1:
            continue  # all padding: stays 0
        kk = _weights(kind, i, scale, lo, hi, a0, a1)
        if axis == 0:
            out[j] = kk @ a[a0 - offset:a1 - offset]
        else:
            out[:, j] = a[:, a0 - offset:a1 - offset] @ kk
    return out


def _window(i: int, scale: float, support: float, n_in: int) -> tuple[int, int]:
    """Input range ``[lo, hi)`` of output ``i`` (Pillow's ``Resample.c``, ``precompute_coeffs``)."""
    center = (i + 0.5) * scale
    return max(int(center - support + 0.5), 0), min(int(center + support + 0.5), n_in)


def _kernel(kind: str, t: np.ndarray) -> np.ndarray:
    """Pillow's filters (``Resample.c``): Lanczos-3, triangle (bilinear), Keys cubic with a = -0.5 (bicubic)."""
    if kind == "lanczos":
        return np.where((t >= -3.0) & (t < 3.0), np.sinc(t) * np.sinc(t / 3.0), 0.0)
    x = np.abs(t)
    if kind == "bilinear":
        return np.where(x < 1.0, 1.0 - x, 0.0)
    a = -0.5
    return np.where(x < 1.0, ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0,
                    np.where(x < 2.0, (((x - 5.0) * x + 8.0) * x - 4.0) * a, 0.0))


#: Filter support (half-width in input pixels at scale 1) per interpolation, as Pillow's.
_SUPPORT = {"lanczos": 3.0, "bilinear": 1.0, "bicubic": 2.0}


def _weights(kind: str, i: int, scale: float, lo: int, hi: int, a0: int, a1: int) -> np.ndarray:
    """Pillow's weights of output ``i`` for inputs ``[a0, a1)``, normalised over its whole window ``[lo, hi)``
    (padding included), as float32. Evaluated in chunks: a window can span most of a long side."""
    center = (i + 0.5) * scale
    inv = 1.0 / max(scale, 1.0)

    def kernel(x0: int, x1: int) -> np.ndarray:
        return _kernel(kind, (np.arange(x0, x1, dtype=np.float64) - center + 0.5) * inv)

    total = sum(float(kernel(x, min(x + _CHUNK, hi)).sum()) for x in range(lo, hi, _CHUNK))
    out = np.empty(a1 - a0, np.float32)
    for x in range(a0, a1, _CHUNK):
        k = kernel(x, min(x + _CHUNK, a1))
        out[x - a0:x - a0 + len(k)] = k / total if total != 0.0 else k
    return out


def work_bytes_bound(max_pixels: int, model_hw: tuple[int, int]) -> int:
    """Upper bound on the bytes of the numpy/Python arrays :func:`classifier_input` allocates for a decoded image
    of at most ``max_pixels`` pixels and a model input of ``model_hw`` (the tests hold it to this, measured with
    ``tracemalloc``): Pillow's export of the pixels (≤ 4 B/px, twice while it joins its chunks), two float32
    planes, the fit's intermediates (≤ ``max(th, tw)·√max_pixels`` floats each) and the model input with its
    normalisation temporaries. Pillow's own decoded image (≤ 4 B/px, plus 4 when a mode is converted, e.g.
    palette → RGBA) lives outside Python's allocator and comes on top
    (``unroll bench memory`` measures the whole service)."""
    th, tw = model_hw
    return 16 * max_pixels + 8 * max(th, tw) * (math.isqrt(max_pixels) + 1) + 48 * th * tw


def estimate_sigma(planes: Planes, limit: float = math.inf) -> float:
    """Noise σ on the [0, 1] scale (scikit-image's wavelet MAD, averaged over the colour channels), always finite and
    at most ``limit``; :func:`unroll.serving.imaging.sigma.estimate` also says whether it is reliable."""
    return sigmas.estimate(planes.data, limit).value
