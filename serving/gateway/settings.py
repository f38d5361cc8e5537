"""Gateway settings: one frozen dataclass, filled from keyword arguments or ``UNROLL_*`` environment variables.

Every limit that protects the process (body size, pixel count, concurrency, queue, timeouts) lives here so
that operators can tune it without code changes, and so that tests can start gateways with tiny limits.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

#: Environment variable for each setting (``UNROLL_`` + upper-case field name).
ENV_PREFIX = "UNROLL_"
PROTOCOLS = ("http", "grpc")


@dataclass(frozen=True)
class Settings:
    """What the gateway serves, where Triton is, and the limits that keep one bad client from hurting others."""

    #: Triton address without scheme: its gRPC port for ``grpc``, its HTTP port for ``http``.
    triton_url: str = "127.0.0.1:8001"
    #: ``grpc`` (the default: measured faster here than tritonclient's aiohttp client, most of all for
    #: images — a 512² denoise took ~220 ms through the gateway over gRPC vs ~295 ms over HTTP) or
    #: ``http`` (binary tensor extension).
    triton_protocol: str = "grpc"
    #: Triton model names served by ``/v1/classify``; the first is the default.
    classify_models: tuple[str, ...] = ("sdnet-mnist",)
    #: Triton model names served by ``/v1/denoise``; the first is the default.
    denoise_models: tuple[str, ...] = ("csc-denoiser",)
    #: classifier → the model that picks its λ for ``lam=auto``.
    autolam_models: Mapping[str, str] = field(default_factory=lambda: {"sdnet-mnist": "sdnet-mnist-autolam"})
    #: When set, every ``/v1/*`` call needs ``X-API-Key: KEY`` or ``Authorization: Bearer KEY``.
    api_key: str | None = None
    #: Deadline of each Triton call (past it: 504, Triton is slow, not down) and of reading one upload (408).
    request_timeout_s: float = 60.0
    #: Readiness probes are short so ``/readyz`` answers quickly when Triton hangs.
    ready_timeout_s: float = 2.0
    #: Request body limit (raw or multipart), enforced while streaming.
    max_body_bytes: int = 20 * 1024 * 1024
    #: Decoded image limit (width × height), checked from the header before any pixel is decoded.
    #: The default (2048², 4.2 Mpx) keeps a colour float32 batch (≈50 MB) under Triton's default
    #: 64 MB HTTP input limit and a CPU denoise under ~30 s.
    max_pixels: int = 2048 * 2048
    #: Requests doing work at once (decoding, Triton calls); more wait in the queue.
    max_concurrency: int = 8
    #: Requests allowed to wait for a slot; beyond that the gateway answers 429 at once.
    max_queue: int = 32
    #: ``Retry-After`` seconds sent with 503 (Triton unavailable).
    retry_after_s: int = 5
    #: ``Retry-After`` seconds sent with 429 (over the concurrency limit).
    busy_retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.triton_protocol not in PROTOCOLS:
            raise ValueError(f"triton_protocol must be one of {PROTOCOLS}, got {self.triton_protocol!r}")
        if "://" in self.triton_url or not self.triton_url:
            raise ValueError(f"triton_url must be HOST:PORT without a scheme, got {self.triton_url!r}")
        if not self.classify_models and not self.denoise_models:
            raise ValueError("configure at least one model (classify_models or denoise_models)")
        for name in ("request_timeout_s", "ready_timeout_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        for name in ("max_body_bytes", "max_pixels", "max_concurrency", "retry_after_s", "busy_retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be ≥ 1, got {getattr(self, name)!r}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be ≥ 0, got {self.max_queue!r}")
        overlap = set(self.classify_models) & set(self.denoise_models)
        if overlap:
            raise ValueError(f"models configured for both tasks: {sorted(overlap)}")
        if self.api_key == "":
            object.__setattr__(self, "api_key", None)

    @property
    def models(self) -> dict[str, str]:
        """Served model name → task (``classification`` or ``denoising``)."""
        out = {m: "classification" for m in self.classify_models}
        out.update({m: "denoising" for m in self.denoise_models})
        return out

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from ``UNROLL_*`` variables (e.g. ``UNROLL_MAX_PIXELS``), then explicit ``overrides``.

        Lists are comma-separated (``UNROLL_CLASSIFY_MODELS=a,b``); ``UNROLL_AUTOLAM_MODELS`` is
        ``classifier=autolam,...``. A malformed value is an error naming the variable, never ignored.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            key = ENV_PREFIX + f.name.upper()
            if key not in env:
                continue
            raw = env[key].strip()
            try:
                values[f.name] = _parse(f.name, raw)
            except ValueError as e:
                raise ValueError(f"{key}={raw!r}: {e}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def env(self) -> dict[str, str]:
        """The ``UNROLL_*`` variables that reproduce these settings (to start a gateway subprocess)."""
        out: dict[str, str] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            if isinstance(v, tuple):
                v = ",".join(v)
            elif isinstance(v, Mapping):
                v = ",".join(f"{k}={m}" for k, m in v.items())
            out[ENV_PREFIX + f.name.upper()] = str(v)
        return out


_INTS = {"max_body_bytes", "max_pixels", "max_concurrency", "max_queue", "retry_after_s", "busy_retry_after_s"}
_FLOATS = {"request_timeout_s", "ready_timeout_s"}
_LISTS = {"classify_models", "denoise_models"}


def _parse(name: str, raw: str) -> Any:
    if name in _INTS:
        return int(raw)
    if name in _FLOATS:
        return float(raw)
    if name in _LISTS:
        return tuple(s.strip() for s in raw.split(",") if s.strip())
    if name == "autolam_models":
        pairs = [p.strip() for p in raw.split(",") if p.strip()]
        if any(p.count("=") != 1 for p in pairs):
            raise ValueError("expected classifier=autolam[,classifier=autolam...]")
        return dict(tuple(s.strip() for s in p.split("=")) for p in pairs)
    return raw
