"""The REST gateway (FastAPI): classification and denoising over HTTP in front of Triton.

``create_app(settings)`` builds the app; one async Triton client is created per process in the
lifespan. Request flow for ``/v1/*``: API key (401) → model name (404) → parameters (422) → declared
size (413) → concurrency slot (429) → streamed body (413/415/400) → decode with limits (400/413) →
Triton (503/504/502) → response. Cheap refusals come first, so a bad request costs almost nothing.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, FastAPI, Query, Request, Security
from fastapi.responses import JSONResponse, Response
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from unroll.serving.gateway import errors, images
from unroll.serving.gateway.body import check_declared_length, read_image_bytes
from unroll.serving.gateway.errors import ApiError, ErrorBody, error_response
from unroll.serving.gateway.metrics import Metrics, MetricsMiddleware
from unroll.serving.gateway.settings import Settings
from unroll.serving.gateway.triton_client import (
    ModelInfo,
    TritonBackend,
    TritonRejected,
    TritonTimeout,
    TritonUnavailable,
    fit_shape,
)

log = logging.getLogger("unroll.gateway")

API_VERSION = "1"
#: Tensor names fixed by CONVENTIONS.md / the exporter.
CLS_IMAGE, CLS_LAM, CLS_LOGITS = "image", "lam", "logits"
AUTOLAM_OUT = "lam"
DN_NOISY, DN_SIGMA, DN_OUT = "noisy", "sigma", "denoised"
MIN_DENOISE_SIDE = 16

DESCRIPTION = f"""
Classification (`sdnet-mnist`) and denoising (`csc-denoiser`) with unrolled-solver models served by
Triton Inference Server.

**Sending an image.** Either multipart (`curl -F image=@digit.png …`) or the raw bytes with an image
content type (`curl --data-binary @noisy.png -H 'Content-Type: image/png' …`). PNG, JPEG, WebP, TIFF
and BMP are accepted; the body and the pixel count are limited (413 beyond them).

**Classification input rules.** EXIF orientation applied; alpha flattened onto black; colour → luma;
non-square images padded with black to a centred square; resized (Lanczos) to the model's input
(28×28). MNIST digits are **white on black** and images are *not* inverted automatically.

**Denoising.** Keeps size and mode (gray, RGB, RGBA, gray+alpha, 16-bit gray; palette/CMYK come back
as RGB); colour channels are denoised as one batch `[C,1,H,W]`; sides must be ≥ {MIN_DENOISE_SIDE}.
`sigma` is on the 0–255 scale; omit it to estimate it (wavelet MAD); the value used is returned in
`X-Sigma-Used`.

**Errors** are always `{{"error": {{"code", "message"}}}}`. **Auth**: when the server has an API key,
send `X-API-Key: KEY` or `Authorization: Bearer KEY` on `/v1/*` (health, readiness, metrics are open).
"""

_BIN = {"schema": {"type": "string", "format": "binary"}}
IMAGE_BODY: dict[str, Any] = {"requestBody": {"required": True, "content": {
    "multipart/form-data": {"schema": {"type": "object", "required": ["image"],
                                       "properties": {"image": {"type": "string", "format": "binary"}}}},
    **{ct: _BIN for ct in ("image/png", "image/jpeg", "image/webp", "image/tiff", "image/bmp")}}}}


def _err(code: str, message: str, description: str) -> dict[str, Any]:
    return {"model": ErrorBody, "description": description,
            "content": {"application/json": {"example": {"error": {"code": code, "message": message}}}}}


COMMON_ERRORS: dict[int | str, dict[str, Any]] = {
    400: _err("invalid_image", "truncated or corrupt image: OSError: image file is truncated",
              "Not an image, truncated or corrupt, malformed multipart"),
    401: _err("unauthorized", "missing or wrong API key", "API key required and missing or wrong"),
    404: _err("unknown_model", "unknown model 'foo'; served: sdnet-mnist", "Model not served by this gateway"),
    408: _err("request_timeout", "the upload did not finish within 60 s", "Upload too slow"),
    413: _err("image_too_large", "image is 5000×5000 = 25000000 pixels; the limit is 4194304",
              "Body over the byte limit, or image over the pixel limit (decompression bombs included)"),
    415: _err("unsupported_media_type", "Content-Type 'text/plain' is not accepted", "Not an accepted image type"),
    422: _err("invalid_parameter", "top_k: Input should be greater than or equal to 1 (got '0')",
              "Bad query parameter"),
    429: _err("too_many_requests", "server busy: 8 requests running and 32 queued; retry later",
              "Over the concurrency limit and queue bound (see Retry-After)"),
    502: _err("triton_error", "Triton rejected inference on sdnet-mnist: …", "Triton answered with an error"),
    503: _err("triton_unavailable", "cannot reach Triton at 127.0.0.1:8001", "Triton down or model not ready "
              "(see Retry-After)"),
    504: _err("triton_timeout", "Triton did not answer inference on csc-denoiser within 60 s", "Triton too slow"),
}


class Prediction(BaseModel):
    label: str = Field(examples=["7"])
    index: int = Field(examples=[7])
    score: float = Field(description="softmax probability over all classes", examples=[0.9931])


class ClassifyResponse(BaseModel):
    model: str = Field(examples=["sdnet-mnist"])
    predictions: list[Prediction]
    latency_ms: float = Field(description="time spent in the gateway for this request", examples=[6.4])
    lam: float | None = Field(None, description="λ of the CSC front end used for this image (the model's "
                                                "default when `lam` was omitted)", examples=[0.1])

    model_config = {"json_schema_extra": {"examples": [{
        "model": "sdnet-mnist", "lam": 0.1, "latency_ms": 6.4,
        "predictions": [{"label": "7", "index": 7, "score": 0.9931}, {"label": "1", "index": 1, "score": 0.004}]}]}}


class Admission:
    """At most ``limit`` requests working and ``queue`` waiting; beyond that, 429 at once (bounded memory)."""

    def __init__(self, limit: int, queue: int, retry_after_s: int, metrics: Metrics) -> None:
        self.limit, self.queue, self.retry_after_s = limit, queue, retry_after_s
        self._sem = asyncio.Semaphore(limit)
        self._admitted = 0
        self._metrics = metrics

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self._admitted >= self.limit + self.queue:
            raise ApiError(429, "too_many_requests",
                           f"server busy: {self.limit} requests running and {self.queue} queued; retry later",
                           {"Retry-After": str(self.retry_after_s)})
        self._admitted += 1
        self._metrics.queued.inc()
        queued = True
        try:
            async with self._sem:
                self._metrics.queued.dec()
                queued = False
                yield
        finally:
            if queued:
                self._metrics.queued.dec()
            self._admitted -= 1


@dataclass
class Gateway:
    """Per-process state shared by the routes (settings, Triton client, metrics, admission)."""

    settings: Settings
    backend: TritonBackend
    metrics: Metrics
    admission: Admission

    def resolve(self, model: str | None, task: str) -> str:
        served = self.settings.classify_models if task == "classification" else self.settings.denoise_models
        if model is None:
            if not served:
                raise ApiError(404, "unknown_model", f"this gateway serves no {task} model")
            return served[0]
        if model not in served:
            raise ApiError(404, "unknown_model",
                           f"unknown {task} model {model!r}; served: {', '.join(served) or 'none'}")
        return model

    def all_models(self) -> list[str]:
        s = self.settings
        extra = [s.autolam_models[m] for m in s.classify_models if m in s.autolam_models]
        return list(dict.fromkeys([*s.classify_models, *extra, *s.denoise_models]))


def _gw(request: Request) -> Gateway:
    return request.app.state.gateway


_api_key_header = APIKeyHeader(name="X-API-Key", auto_error=False,
                               description="API key, when the server was started with one")
_bearer = HTTPBearer(auto_error=False, description="Alternative to X-API-Key: `Authorization: Bearer KEY`")


async def require_api_key(request: Request, key: Annotated[str | None, Security(_api_key_header)],
                          bearer: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]) -> None:
    """When an API key is configured, ``/v1/*`` needs it (constant-time comparison)."""
    expected = _gw(request).settings.api_key
    if expected is None:
        return
    given = key if key is not None else (bearer.credentials if bearer is not None else None)
    if given is None or not hmac.compare_digest(given.encode(), expected.encode()):
        what = "missing" if given is None else "wrong"
        raise ApiError(401, "unauthorized", f"{what} API key: send X-API-Key: KEY or Authorization: Bearer KEY",
                       {"WWW-Authenticate": "Bearer"})


def parse_lam(raw: str | None) -> float | str | None:
    """``lam`` query value: ``None`` (model default), ``"auto"`` or a finite number ≥ 0."""
    if raw is None:
        return None
    if raw.strip().lower() == "auto":
        return "auto"
    try:
        v = float(raw)
    except ValueError:
        raise ApiError(422, "invalid_parameter", f"lam: expected a number ≥ 0 or 'auto' (got {raw!r})") from None
    if not math.isfinite(v) or v < 0:
        raise ApiError(422, "invalid_parameter", f"lam: must be a finite number ≥ 0 or 'auto' (got {raw!r})")
    return v


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000.0, 2)


def _require(info: ModelInfo, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> None:
    missing = [n for n in inputs if n not in info.inputs] + [n for n in outputs if n not in info.outputs]
    if missing:
        raise TritonRejected(f"model {info.name} lacks tensor(s) {', '.join(missing)} the gateway needs "
                             f"(has inputs {list(info.inputs)}, outputs {list(info.outputs)})")


def _classes(entries: np.ndarray, top_k: int) -> list[Prediction]:
    """Parse Triton's ``score:index[:label]`` strings (all classes) → top-k with softmax probabilities."""
    parsed = []
    for e in entries.reshape(-1):
        text = e.decode() if isinstance(e, bytes) else str(e)
        parts = text.split(":", 2)
        try:
            parsed.append((float(parts[0]), int(parts[1]), parts[2] if len(parts) == 3 else parts[1]))
        except (ValueError, IndexError):
            raise TritonRejected(f"unexpected classification entry from Triton: {text!r}") from None
    logits = np.array([p[0] for p in parsed], dtype=np.float64)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")[:top_k]
    return [Prediction(label=parsed[i][2], index=parsed[i][1], score=round(float(probs[i]), 6)) for i in order]


v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], responses={401: COMMON_ERRORS[401]})


@v1.post("/classify", response_model=ClassifyResponse, response_model_exclude_none=True, tags=["inference"],
         summary="Classify an image (top-k labels with probabilities)", openapi_extra=IMAGE_BODY,
         responses={k: COMMON_ERRORS[k] for k in (400, 404, 408, 413, 415, 422, 429, 502, 503, 504)})
async def classify(
    request: Request,
    model: Annotated[str | None, Query(description="Classifier to use (default: the first served)",
                                       examples=["sdnet-mnist"])] = None,
    top_k: Annotated[int, Query(ge=1, description="How many labels to return (1…number of classes)",
                                examples=[3])] = 5,
    lam: Annotated[str | None, Query(description="λ of the CSC front end: a number ≥ 0, or `auto` to pick it "
                                                 "from the image (SDNet's robustness rule); omit for the trained λ",
                                     examples=["0.3", "auto"])] = None,
) -> JSONResponse:
    t0 = time.perf_counter()
    gw = _gw(request)
    name = gw.resolve(model, "classification")
    lam_v = parse_lam(lam)
    info = await gw.backend.model_info(name)
    _require(info, (CLS_IMAGE,), (CLS_LOGITS,))
    n_classes = info.outputs[CLS_LOGITS].shape[-1]
    if top_k > n_classes:
        raise ApiError(422, "invalid_parameter", f"top_k: {name} has {n_classes} classes (got {top_k})")
    autolam = None
    if lam_v is not None and CLS_LAM not in info.inputs:
        raise ApiError(422, "invalid_parameter", f"lam: {name} has no λ input")
    if lam_v == "auto":
        autolam = gw.settings.autolam_models.get(name)
        if autolam is None:
            raise ApiError(422, "invalid_parameter", f"lam=auto: no λ rule is served for {name}")
    if lam_v is None and CLS_LAM in info.inputs:
        lam_v = info.input_defaults.get(CLS_LAM)
        if lam_v is None and not info.inputs[CLS_LAM].optional:
            raise ApiError(422, "invalid_parameter", f"lam: {name} needs λ here; pass lam=<number> or lam=auto")
    shape = info.inputs[CLS_IMAGE].shape
    if len(shape) != 4 or shape[1] != 1:
        raise ApiError(501, "not_implemented", f"{name} takes input {list(shape)}; the gateway feeds "
                                               "single-channel [B,1,H,W] classifiers only")
    size = (shape[2], shape[3]) if shape[2] > 0 and shape[3] > 0 else None
    check_declared_length(request, gw.settings.max_body_bytes)
    async with gw.admission.slot():
        data = await read_image_bytes(request, gw.settings.max_body_bytes, gw.settings.request_timeout_s)
        x = await run_in_threadpool(_classifier_tensor, data, gw.settings.max_pixels, size)
        inputs = {CLS_IMAGE: x}
        if autolam is not None:
            ainfo = await gw.backend.model_info(autolam)
            _require(ainfo, (CLS_IMAGE,), (AUTOLAM_OUT,))
            out = await gw.backend.infer(autolam, {CLS_IMAGE: x}, [AUTOLAM_OUT])
            lam_v = float(np.asarray(out[AUTOLAM_OUT], dtype=np.float32).reshape(-1)[0])
        if isinstance(lam_v, float) and CLS_LAM in info.inputs:
            inputs[CLS_LAM] = fit_shape(np.array([lam_v], np.float32), info.inputs[CLS_LAM])
        res = await gw.backend.infer(name, inputs, [CLS_LOGITS], class_count=n_classes)
    preds = _classes(res[CLS_LOGITS][0], top_k)
    latency = _ms(t0)
    body = ClassifyResponse(model=name, predictions=preds, latency_ms=latency,
                            lam=round(lam_v, 6) if isinstance(lam_v, float) else None)
    return JSONResponse(body.model_dump(exclude_none=True), headers={"X-Latency-Ms": str(latency)})


def _classifier_tensor(data: bytes, max_pixels: int, size: tuple[int, int] | None) -> np.ndarray:
    img = images.decode(data, max_pixels)
    if size is None:
        planes = images.to_planes(img)
        size = planes.data.shape[1:]
    return images.classifier_input(img, size)


@v1.post("/denoise", tags=["inference"], summary="Denoise an image (PNG of the same size and mode)",
         openapi_extra=IMAGE_BODY, response_class=Response,
         responses={200: {"content": {"image/png": {}}, "description": "The denoised image as PNG; headers "
                          "X-Sigma-Used (0–255 scale), X-Sigma-Estimated, X-Latency-Ms, X-Model"},
                    **{k: COMMON_ERRORS[k] for k in (400, 404, 408, 413, 415, 422, 429, 502, 503, 504)}})
async def denoise(
    request: Request,
    model: Annotated[str | None, Query(description="Denoiser to use (default: the first served)",
                                       examples=["csc-denoiser"])] = None,
    sigma: Annotated[float | None, Query(ge=0, le=255, allow_inf_nan=False,
                                         description="Noise standard deviation on the 0–255 scale; omit to "
                                                     "estimate it from the image (wavelet MAD)",
                                         examples=[25])] = None,
) -> Response:
    t0 = time.perf_counter()
    gw = _gw(request)
    name = gw.resolve(model, "denoising")
    info = await gw.backend.model_info(name)
    _require(info, (DN_NOISY, DN_SIGMA), (DN_OUT,))
    check_declared_length(request, gw.settings.max_body_bytes)
    async with gw.admission.slot():
        data = await read_image_bytes(request, gw.settings.max_body_bytes, gw.settings.request_timeout_s)
        planes, sigma01 = await run_in_threadpool(_denoiser_planes, data, gw.settings.max_pixels, sigma)
        c = planes.data.shape[0]
        noisy = planes.data[:, None]  # [C, 1, H, W]: colour channels as one batch
        sig = fit_shape(np.full(c, sigma01, np.float32), info.inputs[DN_SIGMA])
        step = info.max_batch_size if info.max_batch_size > 0 else 1
        if info.max_batch_size == 0 and c > 1:
            raise TritonRejected(f"{name} does not batch, so it cannot take {c} colour channels at once")
        parts = await asyncio.gather(*(gw.backend.infer(name, {DN_NOISY: noisy[i:i + step], DN_SIGMA: sig[i:i + step]},
                                                        [DN_OUT]) for i in range(0, c, step)))
        den = np.concatenate([p[DN_OUT] for p in parts])[:, 0]
        if den.shape != planes.data.shape:
            raise TritonRejected(f"{name} returned shape {den.shape} for input {planes.data.shape}")
        png = await run_in_threadpool(lambda: images.encode_png(images.from_planes(den, planes)))
    latency = _ms(t0)
    return Response(png, media_type="image/png", headers={
        "X-Sigma-Used": f"{sigma01 * 255.0:.3f}", "X-Sigma-Estimated": "false" if sigma is not None else "true",
        "X-Latency-Ms": str(latency), "X-Model": name})


def _denoiser_planes(data: bytes, max_pixels: int, sigma: float | None) -> tuple[images.Planes, float]:
    planes = images.to_planes(images.decode(data, max_pixels))
    h, w = planes.data.shape[1:]
    if min(h, w) < MIN_DENOISE_SIDE:
        raise ApiError(422, "image_too_small",
                       f"image is {w}×{h}; the denoiser needs both sides ≥ {MIN_DENOISE_SIDE} pixels")
    sigma01 = sigma / 255.0 if sigma is not None else images.estimate_sigma(planes)
    return planes, float(sigma01)


@v1.get("/models", tags=["info"], summary="What this gateway serves, with Triton's tensor metadata")
async def models(request: Request) -> dict[str, Any]:
    gw = _gw(request)
    t = gw.settings.ready_timeout_s
    server = await gw.backend.server_ready(t)
    out = []
    for name, task in gw.settings.models.items():
        ready = server and await gw.backend.model_ready(name, t)
        served = gw.settings.classify_models if task == "classification" else gw.settings.denoise_models
        entry: dict[str, Any] = {"name": name, "task": task, "ready": ready, "default": name == served[0]}
        if task == "classification":
            entry["lam_auto"] = name in gw.settings.autolam_models
            entry["params"] = {"top_k": "1…classes", "lam": "number ≥ 0 | auto"}
        else:
            entry["params"] = {"sigma": "0…255 (omit to estimate)"}
        if ready:
            try:
                entry.update((await gw.backend.model_info(name)).public())
            except (TritonUnavailable, TritonTimeout, TritonRejected) as e:
                entry["error"] = str(e)
        out.append(entry)
    return {"api_version": API_VERSION, "triton": {"protocol": gw.settings.triton_protocol, "ready": server},
            "models": out}


def _warm_sigma_estimator() -> None:
    try:
        # A textured probe: an all-zero image makes the wavelet MAD divide by an empty slice (a warning).
        probe = np.random.default_rng(0).random((1, 32, 32), dtype=np.float32)
        images.estimate_sigma(images.Planes(probe, None, "L"))
    except ImportError as e:
        raise RuntimeError(f"sigma estimation needs scikit-image with PyWavelets ({e}); pip install PyWavelets") from e


def create_app(settings: Settings | None = None) -> FastAPI:
    """The gateway app; ``settings`` default to :meth:`Settings.from_env` (``UNROLL_*`` variables)."""
    settings = settings or Settings.from_env()
    images.set_pillow_limit(settings.max_pixels)
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        backend = TritonBackend(settings.triton_url, settings.triton_protocol, settings.request_timeout_s,
                                observe=metrics.observe_triton)
        app.state.gateway = Gateway(settings, backend, metrics,
                                    Admission(settings.max_concurrency, settings.max_queue,
                                              settings.busy_retry_after_s, metrics))
        log.info("gateway: Triton %s at %s; models %s", settings.triton_protocol, settings.triton_url,
                 ", ".join(settings.models))
        if settings.denoise_models:  # pay scikit-image/PyWavelets imports at start-up, and fail here if missing
            await run_in_threadpool(_warm_sigma_estimator)
        try:
            yield
        finally:
            await backend.close()

    app = FastAPI(title="unroll gateway", version=API_VERSION, description=DESCRIPTION, lifespan=lifespan,
                  openapi_tags=[{"name": "inference", "description": "Classification and denoising"},
                                {"name": "info", "description": "Served models"},
                                {"name": "ops", "description": "Health, readiness and metrics (never need a key)"}])
    errors.install(app)

    async def unavailable(_: Request, exc: Exception) -> JSONResponse:
        return error_response(503, "triton_unavailable", str(exc), {"Retry-After": str(settings.retry_after_s)})

    async def timeout(_: Request, exc: Exception) -> JSONResponse:
        return error_response(504, "triton_timeout", str(exc))

    async def rejected(_: Request, exc: Exception) -> JSONResponse:
        log.warning("Triton error: %s", exc)
        return error_response(502, "triton_error", str(exc))

    app.add_exception_handler(TritonUnavailable, unavailable)
    app.add_exception_handler(TritonTimeout, timeout)
    app.add_exception_handler(TritonRejected, rejected)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.include_router(v1)

    @app.get("/healthz", tags=["ops"], summary="The gateway process is alive (does not call Triton)")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"], summary="Triton is ready and every configured model is loaded",
             responses={503: _err("not_ready", "model csc-denoiser is not ready", "Not ready (see Retry-After)")})
    async def readyz(request: Request) -> JSONResponse:
        gw = _gw(request)
        t = settings.ready_timeout_s
        names = gw.all_models()
        server = await gw.backend.server_ready(t)
        states = [False] * len(names)
        if server:
            states = list(await asyncio.gather(*(gw.backend.model_ready(m, t) for m in names)))
        ready = dict(zip(names, states, strict=True))
        if server and all(states):
            return JSONResponse({"status": "ready", "triton": True, "models": ready})
        why = "Triton is not reachable or not ready" if not server else \
            "model(s) not ready: " + ", ".join(m for m, ok in ready.items() if not ok)
        return error_response(503, "not_ready", why, {"Retry-After": str(settings.retry_after_s)},
                              triton=server, models=ready)

    @app.get("/metrics", tags=["ops"], summary="Prometheus metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
