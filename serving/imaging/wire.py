"""The encoded-image protocol over KServe v2: tensor names, config parameters and how a client error travels.

One place for what both ends agree on: the Triton Python-backend model (:mod:`unroll.serving.triton_backend_model`,
whose docstring describes the protocol) and the gateway (``serving/gateway/classify.py`` and ``denoise.py``).

Why ``UINT8`` and ``INT32`` rather than ``BYTES`` (``TYPE_STRING``): the bundled Triton's Python-backend stub reads
and writes ``BYTES`` tensors through its NumPy 1 ABI, and under NumPy 2 both come out wrong (an input's bytes are
garbage, an output is empty; measured, ``tests/test_triton_images.py``), while numeric tensors cross intact through
DLPack. So a file is a row of ``UINT8`` (a batch of files of different lengths: rows zero-padded at the end, which
every accepted format ignores), text is ``UINT8`` UTF-8 (JSON, padded with spaces to a fixed size) and choices are
``INT32`` codes.

A client error of the image path (an undecodable image, a pixel bomb, a bad ``invert``…) is answered by the model as
Triton's ``INVALID_ARG`` (HTTP 400 / gRPC ``INVALID_ARGUMENT``) whose message starts with
``[STATUS CODE]`` — the HTTP status and stable error code the gateway gives for the same mistake, e.g.
``[413 image_too_large] image is 5000×5000 = 25000000 pixels; the limit is 4194304``. :func:`format_error` writes
it, :func:`parse_error` finds it again in whatever Triton and its clients wrap around it.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from unroll.errors import ApiError, ImageRejected, TritonRejected

#: Input: one encoded image file (PNG, JPEG, WebP, TIFF or BMP) per batch item, ``TYPE_UINT8`` dims ``[-1]`` (the
#: file's bytes; zero-padded rows). Not ``image``: that is the float input's name on the classifiers' cards.
IMAGE_BYTES = "image_bytes"
#: Classifier input, ``TYPE_INT32`` dims ``[1]`` per item: :data:`INVERT_CODES`; default as the gateway's.
INVERT = "invert"
#: Denoiser input, ``TYPE_INT32`` dims ``[1]``: the encoding of :data:`ENCODED`, :data:`FORMAT_CODES`.
FORMAT = "format"
#: Denoiser output: the result image, encoded, ``TYPE_UINT8`` dims ``[-1]`` (its length: ``image_info``'s
#: ``encoded_bytes``; rows of a batch are zero-padded to the longest).
ENCODED = "encoded"
#: Output of both: a JSON object per item, ``TYPE_UINT8`` dims ``[INFO_BYTES]`` (UTF-8, padded with spaces; a fixed
#: size, so that tools that check every output against expected data, e.g. perf_analyzer, can).
IMAGE_INFO = "image_info"
INFO_BYTES = 256
#: Tensor types of the protocol's tensors (Triton config names).
TYPES = {IMAGE_BYTES: "TYPE_UINT8", INVERT: "TYPE_INT32", FORMAT: "TYPE_INT32", ENCODED: "TYPE_UINT8",
         IMAGE_INFO: "TYPE_UINT8"}
DIMS = {IMAGE_BYTES: [-1], INVERT: [1], FORMAT: [1], ENCODED: [-1], IMAGE_INFO: [INFO_BYTES]}
#: Every name the protocol adds to a model's config (a card's own tensor may not take one of them).
NAMES = (IMAGE_BYTES, INVERT, FORMAT, ENCODED, IMAGE_INFO)
INPUTS = (IMAGE_BYTES, INVERT, FORMAT)
OUTPUTS = (ENCODED, IMAGE_INFO)

#: Lossless encodings of :data:`ENCODED` and their media types (``npy``: the image's array, uint8 or uint16).
OUTPUT_FORMATS = {"png": "image/png", "tiff": "image/tiff", "npy": "application/x-npy"}
DEFAULT_FORMAT = "png"
#: ``format`` input values.
FORMAT_CODES = {0: "png", 1: "tiff", 2: "npy"}
#: ``invert`` input values.
INVERT_CODES = {-1: "auto", 0: "false", 1: "true"}

#: Config parameters carrying the limits the model enforces (written by ``serving/repository.py``).
MAX_PIXELS_KEY = "unroll.max_pixels"
MAX_ASPECT_RATIO_KEY = "unroll.max_aspect_ratio"
#: The defaults of both limits: the gateway's (``serving/gateway/settings.py``: ``max_pixels``,
#: ``max_aspect_ratio``; ``tests/test_triton_images.py`` holds them equal).
DEFAULT_MAX_PIXELS = 2048 * 2048
DEFAULT_MAX_ASPECT_RATIO = 32.0

_PREFIX = re.compile(r"\[(\d{3}) ([a-z][a-z0-9_]*)\] ")


@dataclass(frozen=True)
class WireError:
    """A client error as the gateway answers it: HTTP status, stable code, message."""

    status: int
    code: str
    message: str


def format_error(status: int, code: str, message: str) -> str:
    """``[413 image_too_large] message``: the text of an ``INVALID_ARG`` the gateway maps back to its 4xx."""
    return ImageRejected.wire_text(status, code, message)


def parse_error(text: str) -> WireError | None:
    """The :func:`format_error` inside ``text`` (Triton and its clients prefix their own words), or ``None``."""
    m = _PREFIX.search(text)
    if m is None:
        return None
    return WireError(int(m.group(1)), m.group(2), text[m.end():].strip())


def code_of(table: dict[int, str], name: str) -> int:
    """The code of ``name`` in :data:`FORMAT_CODES` or :data:`INVERT_CODES`."""
    return next(k for k, v in table.items() if v == name)


def info_json(info: dict) -> bytes:
    """One item's :data:`IMAGE_INFO` value: compact JSON padded with spaces to :data:`INFO_BYTES`."""
    text = json.dumps(info, separators=(",", ":")).encode()
    if len(text) > INFO_BYTES:
        raise ValueError(f"image_info over {INFO_BYTES} bytes: {text[:80]!r}…")
    return text.ljust(INFO_BYTES)


def read_info(value) -> dict:
    """An :data:`IMAGE_INFO` row (``UINT8`` array, bytes or str) back as a dict."""
    if hasattr(value, "tobytes"):
        value = value.tobytes()
    return json.loads(value.decode() if isinstance(value, bytes) else value)


def rows(values: list[bytes], pad: bytes = b"\0") -> np.ndarray:
    """``values`` as one ``[n, longest]`` ``uint8`` array, each row padded at its end with ``pad``."""
    n = max((len(v) for v in values), default=0)
    out = np.full((len(values), n), pad[0], np.uint8)
    for i, v in enumerate(values):
        out[i, :len(v)] = np.frombuffer(v, np.uint8)
    return out


#: :func:`padded_length` rounds up to a power of two up to here, to a multiple of it beyond.
PAD_STEP = 64 * 1024


def padded_length(n: int) -> int:
    """The row length a client pads an ``n``-byte file to, so that uploads of similar sizes have equal shapes and
    batch together (Triton's dynamic batcher and the gateway's batcher join only equal shapes): the next power of
    two from 256 bytes up to :data:`PAD_STEP` (at most twice a small file), beyond it the next multiple of
    :data:`PAD_STEP` (a few percent of a large one)."""
    if n <= PAD_STEP:
        return max(256, 1 << max(n - 1, 0).bit_length())
    return -(-n // PAD_STEP) * PAD_STEP


def encoded_file(row, info: dict) -> bytes:
    """One item's :data:`ENCODED` file: its row cut to ``info["encoded_bytes"]``."""
    return bytes(row[:int(info["encoded_bytes"])])


def media_format(accept: str | None) -> str | None:
    """The :data:`OUTPUT_FORMATS` key an ``Accept`` header asks for: ``png`` when absent or for ``*/*``,
    ``image/*`` and ``image/png``; ``tiff`` for ``image/tiff``; ``npy`` for ``application/x-npy``; the
    acceptable one with the highest ``q`` (the first on a tie); ``None`` when none is acceptable (406)."""
    if accept is None or not accept.strip():
        return DEFAULT_FORMAT
    best: tuple[float, int, str] | None = None
    for pos, part in enumerate(accept.split(",")):
        kind, *params = (p.strip() for p in part.split(";"))
        kind = kind.lower()
        q = 1.0
        for p in params:
            k, _, v = p.partition("=")
            if k.strip().lower() == "q":
                try:
                    q = float(v)
                except ValueError:
                    q = 0.0
        if q <= 0:
            continue
        fmt = next((f for f, media in OUTPUT_FORMATS.items() if media == kind), None)
        if fmt is None and kind in ("*/*", "image/*"):
            fmt = DEFAULT_FORMAT
        if fmt is not None and (best is None or q > best[0]):
            best = (q, pos, fmt)
    return None if best is None else best[2]


# ---------------------------------------------------------------- the gateway's side: a request out, its errors back


def image_row(data: bytes, batched: bool) -> np.ndarray:
    """One upload as the ``image_bytes`` input: a ``[1, L]`` ``uint8`` row (``[L]`` for a model that does not batch),
    zero-padded to :func:`padded_length` so that uploads of similar sizes batch together (every accepted format
    ignores bytes after its end)."""
    row = np.zeros(padded_length(len(data)), np.uint8)
    row[:len(data)] = np.frombuffer(data, np.uint8)
    return row[None] if batched else row


def per_item(value: float | int, dtype: type, batched: bool) -> np.ndarray:
    """One per-item value as a dims-``[1]`` input (``[1, 1]``; ``[1]`` for a model that does not batch)."""
    return np.full((1, 1) if batched else (1,), value, dtype)


@contextlib.asynccontextmanager
async def forward_errors() -> AsyncIterator[None]:
    """A client error the model found in the image (``[STATUS CODE] message``) → the gateway's own 4xx, as if it
    had decoded the image itself; anything else stays a Triton error."""
    try:
        yield
    except TritonRejected as e:
        found = parse_error(str(e))
        if found is None:
            raise
        raise ApiError(found.status, found.code, found.message) from None
