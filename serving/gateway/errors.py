"""One error shape for every failure: ``{"error": {"code", "message"}}`` with the right HTTP status.

Clients branch on ``code`` (stable, snake_case) and show ``message`` (one human sentence). Every
:class:`~unroll.errors.UnrollError` (an :class:`ApiError`, Triton's failures, any stage's error) is answered by one
handler from its ``http_status`` and ``code``; FastAPI's own validation errors and Starlette's 404/405 are reshaped
to match, so no response ever has another format.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from unroll.errors import ApiError, ServingError, UnrollError
from unroll.serving.gateway.responses import JSONResponse

__all__ = ["ApiError", "error_response", "install"]

log = logging.getLogger("unroll.gateway")

#: code used for each HTTP status when Starlette raises a plain HTTPException (unknown route, wrong method).
_DEFAULT_CODES = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
                  413: "payload_too_large", 415: "unsupported_media_type", 422: "invalid_parameter",
                  429: "too_many_requests", 503: "unavailable", 504: "timeout"}


class ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorBody(BaseModel):
    """Every non-2xx response of the gateway."""

    error: ErrorDetail


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None,
                   **extra: object) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}, **extra}, status_code=status, headers=headers)


def _field(loc: tuple) -> str:
    parts = [str(p) for p in loc if p not in ("query", "body", "header", "path")]
    return ".".join(parts) or "request"


def _unroll_error(retry_after_s: int | None):
    """The one handler of :class:`UnrollError`: its status and code, its message, its headers. A server-side
    unavailability (a :class:`ServingError` answered 503, e.g. Triton unreachable) adds ``Retry-After``; any other
    5xx is logged, since it is the server's fault, not the client's."""

    async def handler(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, UnrollError)
        headers = dict(getattr(exc, "headers", None) or {})
        if retry_after_s is not None and isinstance(exc, ServingError) and exc.http_status == 503:
            headers.setdefault("Retry-After", str(retry_after_s))
        elif exc.http_status >= 500 and exc.http_status not in (503, 504):
            log.warning("%s: %s", exc.code, exc)
        return error_response(exc.http_status, exc.code, str(exc), headers or None)

    return handler


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    msgs = []
    for e in exc.errors():
        value = e.get("input")
        got = f" (got {value!r})" if isinstance(value, str | int | float) else ""
        msgs.append(f"{_field(tuple(e.get('loc', ())))}: {e.get('msg', 'invalid')}{got}")
    return error_response(422, "invalid_parameter", "; ".join(msgs) or "invalid request")


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = _DEFAULT_CODES.get(exc.status_code, "error")
    message = str(exc.detail)
    if exc.status_code == 404 and message == "Not Found":  # Starlette's "no such route": say which, and hint
        path = request.url.path
        message = f"no route {request.method} {path}"
        bare = path.rstrip("/")
        if bare != path and _routed(request, bare):
            message += f" (routes have no trailing slash: {bare})"
        message += "; see /docs"
    return error_response(exc.status_code, code, message, dict(exc.headers or {}))


def _routed(request: Request, path: str) -> bool:
    """Whether some route (any method) answers ``path``: asked of the routes themselves, as the router does."""
    scope = {**request.scope, "path": path}
    return any(route.matches(scope)[0] != Match.NONE for route in request.app.router.routes)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal_error", f"internal error ({type(exc).__name__}); see the gateway log")


def install(app: FastAPI, retry_after_s: int | None = None) -> None:
    """Route every exception type the app can raise to the common JSON shape (``retry_after_s``: the
    ``Retry-After`` seconds sent with a 503 for an unavailable server)."""
    app.add_exception_handler(UnrollError, _unroll_error(retry_after_s))
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
