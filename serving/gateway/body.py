"""Read the uploaded image from a request — raw body or multipart field ``image`` — within a byte limit.

The limit holds on the declared ``Content-Length`` and on the streamed bytes (chunked uploads, lying headers,
multipart parsed while streaming), so buffering stops the moment it is crossed. Reading is also bounded in time
(``idle_s`` between pieces, ``timeout_s`` for the whole body: 408) and happens before the request takes an inference
slot, so slow uploaders cannot starve inference. A client gone mid-upload is counted as 499.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from fastapi import Request
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from unroll.serving.gateway.errors import ApiError
from unroll.serving.imaging.images import CONTENT_TYPES

IMAGE_FIELD = "image"
_ACCEPTED = "multipart/form-data (field 'image') or a raw body with Content-Type " + ", ".join(
    sorted({"image/png", "image/jpeg", "image/webp", "image/tiff", "image/bmp"}))


def media_type(value: str | None) -> str:
    return (value or "").split(";", 1)[0].strip().lower()


def too_large(limit: int, declared: int | None = None) -> ApiError:
    size = f" ({declared} bytes declared)" if declared is not None else ""
    return ApiError(413, "payload_too_large", f"request body over the {limit}-byte limit{size}")


def check_declared_length(request: Request, limit: int) -> None:
    """Refuse a body whose declared Content-Length is over the limit, before reading any of it."""
    raw = request.headers.get("content-length")
    if raw is None:
        return
    try:
        n = int(raw)
    except ValueError:
        raise ApiError(400, "bad_request", f"Content-Length is not a number: {raw!r}") from None
    if n > limit:
        raise too_large(limit, n)


def _timed_out(message: str) -> ApiError:
    # Connection: close, so uvicorn drops the connection instead of waiting for the rest of the body.
    return ApiError(408, "request_timeout", message, {"Connection": "close"})


async def _counted(request: Request, limit: int, idle_s: float | None) -> AsyncGenerator[bytes, None]:
    """The body's chunks, at most ``limit`` bytes in all, each within ``idle_s`` of the previous one."""
    n = 0
    chunks = request.stream().__aiter__()
    while True:
        try:
            async with asyncio.timeout(idle_s):
                chunk = await anext(chunks)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise _timed_out(f"the upload stalled: no data for {idle_s:g} s ({n} bytes received)") from None
        n += len(chunk)
        if n > limit:
            raise too_large(limit)
        yield chunk


async def read_image_bytes(request: Request, limit: int, timeout_s: float, idle_s: float | None = None) -> bytes:
    """The uploaded file's bytes; 413 over ``limit`` as read, 415 for other media types, 400 for bad multipart,
    408 when the whole body takes over ``timeout_s`` or a pause between two pieces over ``idle_s``. The declared
    length is the caller's to check first (:func:`check_declared_length`, before it takes an upload permit)."""
    ctype = media_type(request.headers.get("content-type"))
    try:
        async with asyncio.timeout(timeout_s):
            if ctype == "multipart/form-data":
                return await _multipart(request, limit, idle_s)
            if ctype in CONTENT_TYPES:
                return await _all(request, limit, idle_s)
    except TimeoutError:
        raise _timed_out(f"the upload did not finish within {timeout_s:g} s") from None
    what = f"Content-Type {ctype!r}" if ctype else "a request without Content-Type"
    raise ApiError(415, "unsupported_media_type", f"{what} is not accepted; send {_ACCEPTED}")


async def read_body(request: Request, limit: int, timeout_s: float, idle_s: float | None = None) -> bytes:
    """The whole body whatever its type, within the same byte and time limits as :func:`read_image_bytes`."""
    try:
        async with asyncio.timeout(timeout_s):
            return await _all(request, limit, idle_s)
    except TimeoutError:
        raise _timed_out(f"the upload did not finish within {timeout_s:g} s") from None


async def _all(request: Request, limit: int, idle_s: float | None) -> bytes:
    buf = bytearray()
    async for chunk in _counted(request, limit, idle_s):
        buf += chunk
    return bytes(buf)


async def _multipart(request: Request, limit: int, idle_s: float | None) -> bytes:
    parser = MultiPartParser(request.headers, _counted(request, limit, idle_s), max_files=1, max_fields=16,
                             max_part_size=64 * 1024)
    try:
        form = await parser.parse()
    except MultiPartException as e:
        raise ApiError(400, "bad_request", f"malformed multipart body: {e.message}") from None
    try:
        part = form.get(IMAGE_FIELD)
        if not isinstance(part, UploadFile):
            names = ", ".join(repr(k) for k in form) or "none"
            raise ApiError(400, "missing_image", f"multipart body has no file field {IMAGE_FIELD!r} (fields: {names})")
        declared = media_type(part.content_type)
        if declared and declared not in CONTENT_TYPES and declared != "application/octet-stream":
            raise ApiError(415, "unsupported_media_type",
                           f"file part has Content-Type {declared!r}; send PNG, JPEG, WebP, TIFF or BMP")
        return await part.read()
    finally:
        await form.close()
