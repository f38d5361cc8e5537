"""Request ids: every response carries ``X-Request-Id`` and every log line written while serving it names it.

The id is the client's ``X-Request-Id`` when it is a sane token (1–128 characters of letters, digits and
``._:-``, so a log line cannot be forged through it), else a fresh UUID4 (hex). It is held in a context variable for
the request's task: :class:`RequestIdFilter` adds it to every log record (``%(request_id)s``), the Triton client
sends it as the inference request's ``id`` (Triton's own logs and traces then name it; a call the batcher joins
from several requests carries the id of the request that opened the batch), and the access log records it.
``UNROLL_LOG_FORMAT=json`` makes every gateway log line one JSON object (:func:`log_config`).
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from collections.abc import Callable
from contextvars import ContextVar

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "X-Request-Id"
_HEADER_KEY = HEADER.lower().encode()
_VALID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
#: ``text`` (default) or ``json``: the format of the gateway's log lines.
LOG_FORMAT_ENV = "UNROLL_LOG_FORMAT"

_current: ContextVar[str | None] = ContextVar("unroll_request_id", default=None)


def _no_trace_id() -> str | None:
    return None


#: The current trace id for log records; :mod:`.tracing` sets it while tracing is on (off: always ``None``).
trace_id: Callable[[], str | None] = _no_trace_id


def current() -> str | None:
    """The id of the request being served in this task (``None`` outside a request)."""
    return _current.get()


def accepted(value: str | None) -> str | None:
    """``value`` when it is a usable request id, else ``None``."""
    return value if value is not None and _VALID.fullmatch(value) else None


class RequestIdMiddleware:
    """Pure ASGI middleware: picks the request's id, holds it for the request, and adds ``X-Request-Id`` to the
    response (error answers included)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", ()) if k == _HEADER_KEY), None)
        rid = accepted(given.decode("latin-1") if given is not None else None) or uuid.uuid4().hex
        raw = rid.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != _HEADER_KEY]
                message = {**message, "headers": [*headers, (_HEADER_KEY, raw)]}
            await send(message)

        token = _current.set(rid)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _current.reset(token)


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` (``-`` outside a request) to every record that passes through its handler, and
    ``trace_id`` while tracing is on and the record is written inside a span."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = _current.get() or "-"
        tid = trace_id()
        if tid is not None:
            record.trace_id = tid
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request_id (and the trace id while tracing is on, and
    the exception, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
               "message": record.getMessage(), "request_id": getattr(record, "request_id", None)}
        if hasattr(record, "trace_id"):
            out["trace_id"] = record.trace_id
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(out).decode()


def log_format(fmt: str | None = None) -> str:
    """``fmt``, else :data:`LOG_FORMAT_ENV`, else ``text``; anything but ``text``/``json`` is an error."""
    fmt = (fmt or os.environ.get(LOG_FORMAT_ENV) or "text").strip().lower()
    if fmt not in ("text", "json"):
        raise ValueError(f"{LOG_FORMAT_ENV}: text or json, not {fmt!r}")
    return fmt


def log_config(level: str = "info", fmt: str | None = None) -> dict:
    """uvicorn's ``log_config`` for a gateway process (each worker applies it too): one stderr handler on the root
    logger with the request id in every line, text or JSON (:func:`log_format`); uvicorn's loggers go through it."""
    return {"version": 1, "disable_existing_loggers": False,
            "filters": {"request_id": {"()": f"{__name__}.RequestIdFilter"}},
            "formatters": {"text": {"format": "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"},
                           "json": {"()": f"{__name__}.JsonFormatter"}},
            "handlers": {"default": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr",
                                     "formatter": log_format(fmt), "filters": ["request_id"]}},
            "root": {"handlers": ["default"], "level": level.upper()},
            "loggers": {name: {"handlers": [], "propagate": True}
                        for name in ("uvicorn", "uvicorn.error", "uvicorn.access")}}
