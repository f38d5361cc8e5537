"""Gateway settings (pydantic-settings): keyword arguments, else ``UNROLL_*`` environment variables, else defaults.

Every limit that protects the process (body size, pixel count, concurrency, queue, timeouts) lives here so
that operators can tune it without code changes, and so that tests can start gateways with tiny limits.
Which models are served is *not* configured by name: the gateway discovers them from Triton (each model's
card, see :mod:`unroll.serving.gateway.catalog`); ``classify_models`` / ``denoise_models`` only narrow that.

A bad value is an error naming the variable (``UNROLL_MAX_PIXELS: Input should be a valid integer ...``),
never ignored.
"""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from unroll import tasks
from unroll.errors import SettingsError, UsageError
from unroll.objective import good_ms, parse_bounds
from unroll.serving.imaging import wire

#: Environment variable for each setting: ``UNROLL_`` + the upper-case field name.
ENV_PREFIX = "UNROLL_"

_Names = Annotated[tuple[str, ...], NoDecode]  # comma-separated in the environment, not JSON


class Settings(BaseSettings):
    """Where Triton is, which of its models to serve, and the limits that keep one bad client from hurting others."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="forbid",
                                      use_attribute_docstrings=True)

    triton_url: str = "127.0.0.1:8001"
    """Triton address without scheme: its gRPC port for ``grpc``, its HTTP port for ``http``. Several,
    comma-separated, for Tritons that serve the same repository (a warm standby): calls go to one and move to the
    next when it is unavailable (:class:`~.triton_client.TritonBackend`)."""
    triton_protocol: Literal["http", "grpc"] = "grpc"
    """``grpc`` (the default: measured faster here than tritonclient's aiohttp client, most of all for images)
    or ``http`` (binary tensor extension)."""
    classify_models: _Names = ()
    """Triton models served by ``/v1/classify``, comma-separated; empty = every model Triton serves whose card
    says ``classification``. The default model is the first listed, else the first by name."""
    denoise_models: _Names = ()
    """Triton models served by ``/v1/denoise``; empty = every model whose card says ``denoising``."""
    api_key: str | None = None
    """When set, every ``/v1/*`` call needs ``X-API-Key: KEY`` or ``Authorization: Bearer KEY``."""
    request_timeout_s: float = Field(60.0, gt=0, allow_inf_nan=False)
    """Deadline of each Triton call (past it: 504, Triton is slow, not down); uploads have their own limits
    (``body_idle_timeout_s`` / ``body_timeout_s`` in :mod:`.http_settings`)."""
    ready_timeout_s: float = Field(2.0, gt=0, allow_inf_nan=False)
    """Readiness probes are short so ``/readyz`` answers quickly when Triton hangs."""
    triton_stall_s: float = Field(2.0, gt=0, allow_inf_nan=False)
    """Triton has not answered a health probe for this long (stopped, hung, restarting): requests waiting for it
    and new ones get 503 with ``Retry-After`` at once instead of waiting out ``request_timeout_s`` (:mod:`.stall`;
    probed every quarter of it)."""
    max_body_bytes: int = Field(20 * 1024 * 1024, ge=1)
    """Request body limit (raw or multipart), enforced while streaming."""
    max_pixels: int = Field(wire.DEFAULT_MAX_PIXELS, ge=1)
    """Decoded image limit (width × height), checked from the header before any pixel is decoded. The default
    (2048², 4.2 Mpx) keeps a colour float32 batch (≈50 MB) under Triton's default 64 MB HTTP input limit."""
    max_aspect_ratio: float = Field(wire.DEFAULT_MAX_ASPECT_RATIO, ge=1.0)
    """Longest side ÷ shortest side an image may have (checked from the header; beyond it: 422). 32 admits
    stitched panoramas and long receipts and refuses 1-pixel lines, which no classifier or denoiser can use;
    ``inf`` disables the check (memory stays bounded by ``max_pixels`` either way)."""
    max_concurrency: int = Field(8, ge=1)
    """Requests doing work at once (decoding, Triton calls); more wait in the queue."""
    max_queue: int = Field(32, ge=0)
    """Requests allowed to wait for a slot; beyond that the gateway answers 429 at once."""
    retry_after_s: int = Field(5, ge=1)
    """``Retry-After`` seconds sent with 503 (Triton unavailable)."""
    busy_retry_after_s: int = Field(1, ge=1)
    """``Retry-After`` seconds sent with 429 (over the concurrency limit)."""
    rate_limit: str | None = None
    """Per-client rate limit of the ``/v1`` and ``/v2`` routes: ``R/s,BURST`` (e.g. ``10/s,20``), ``R,BURST`` or
    ``R``; a client is its API key, else its address (:mod:`.rate_limit`). Unset: none."""
    slo: str | None = None
    """Objective held with fewer solver iterations, for models whose card serves several counts (``iters``), e.g.
    ``p99<=50ms`` (:mod:`unroll.objective`'s grammar; its highest percentile's bound is the deadline): a request
    that pins no ``iters`` gets the largest count predicted to answer within it given what is in flight ahead of
    it (:mod:`.anytime`), and the trained count again as load falls. Unset: the trained count always, as without
    this feature; a request's own ``deadline_ms`` holds that request to its deadline either way."""
    catalog_refresh_s: float = Field(2.0, gt=0, le=3600, allow_inf_nan=False)
    """How often the gateway re-reads what Triton serves (models, loaded versions, their traffic split) in the
    background, so a version ``unroll deploy`` loads or moves traffic to is picked up without a restart. A
    deployment waits longer than this before it unloads a version (``unroll deploy --drain-s``)."""
    batching: bool = True
    """Coalesce concurrent requests for the same model into one Triton call (:mod:`.batching`); ``false``: one call
    per request."""
    batch_max_in_flight: int = Field(2, ge=1)
    """Batches of one model (and tensor layout) at Triton at once; requests beyond wait for one to return and go
    together."""
    batch_delay_ms: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    """Longest a request waits for others to join its batch while a batch slot is free (0: none, it goes at once;
    at most 1 ms). Waiting for a busy slot is not bounded by this but by Triton's answer."""

    def __init__(self, **values: Any) -> None:
        """Keyword values win over ``UNROLL_*`` variables; a bad value raises :class:`SettingsError`."""
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise SettingsError(_describe(e)) from None

    @field_validator("classify_models", "denoise_models", mode="before")
    @classmethod
    def _names(cls, v: Any) -> Any:
        if isinstance(v, str):
            return tuple(s.strip() for s in v.split(",") if s.strip())
        return v

    @field_validator("triton_url")
    @classmethod
    def _url(cls, v: str) -> str:
        urls = [u.strip() for u in v.split(",")]
        if any("://" in u or not u for u in urls):
            raise ValueError("must be HOST:PORT without a scheme (several: comma-separated)")
        return ",".join(urls)

    @field_validator("rate_limit")
    @classmethod
    def _rate(cls, v: str | None) -> str | None:
        if not v:
            return None
        from unroll.serving.gateway.rate_limit import RateLimit

        RateLimit.parse(v)  # a ValueError names the accepted forms
        return v.strip()

    @field_validator("slo")
    @classmethod
    def _slo(cls, v: str | None) -> str | None:
        if not v or not v.strip():
            return None
        try:
            bounds = parse_bounds(v, "slo")
        except UsageError as e:
            raise ValueError(str(e)) from None
        if good_ms(bounds) is None:
            raise ValueError(f"{v!r} bounds no latency: the deadline is a percentile's bound, e.g. p99<=50ms")
        return v.strip()

    @cached_property
    def deadline_ms(self) -> float | None:
        """The deployment's deadline per request (ms from arrival): :attr:`slo`'s latency bound, else ``None``
        (read once: every request of a model with several counts asks for it)."""
        return good_ms(parse_bounds(self.slo, "slo")) if self.slo else None

    @field_validator("api_key")
    @classmethod
    def _key(cls, v: str | None) -> str | None:
        return v or None  # an empty UNROLL_API_KEY means "no key", not "the empty key"

    @model_validator(mode="after")
    def _disjoint(self) -> Settings:
        overlap = set(self.classify_models) & set(self.denoise_models)
        if overlap:
            raise ValueError(f"{ENV_PREFIX}CLASSIFY_MODELS and {ENV_PREFIX}DENOISE_MODELS both name {sorted(overlap)}")
        return self

    def configured(self, task: str) -> tuple[str, ...]:
        """The models an operator restricted ``task`` to (empty: every model Triton serves for it); the setting that
        narrows a task is named by its route (``Route.setting``)."""
        route = tasks.get(task).route if task in tasks.names() else None
        return getattr(self, route.setting) if route is not None and route.setting is not None else ()

    @classmethod
    def from_env(cls, **overrides: Any) -> Settings:
        """Settings from ``UNROLL_*`` variables, with ``overrides`` (keyword = field name) on top; ``None``
        overrides are ignored, so callers can pass their optional arguments straight through."""
        return cls(**{k: v for k, v in overrides.items() if v is not None})

    def env(self) -> dict[str, str]:
        """The ``UNROLL_*`` variables that reproduce these settings (to start a gateway subprocess)."""
        out: dict[str, str] = {}
        for name in type(self).model_fields:
            v = getattr(self, name)
            if v is None:
                continue
            out[ENV_PREFIX + name.upper()] = ",".join(v) if isinstance(v, tuple) else str(v)
        return out


def _describe(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = err.get("loc") or ()
        var = ENV_PREFIX + str(loc[0]).upper() if loc else "settings"
        got = err.get("input")
        shown = f" (got {got!r})" if isinstance(got, str | int | float) else ""
        lines.append(f"{var}: {err.get('msg', 'invalid')}{shown}")
    return "invalid gateway settings: " + "; ".join(lines)
