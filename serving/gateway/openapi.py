"""OpenAPI text shared by the routers (the API description, the image request body, documented errors), and the
interactive docs, served from the package so that ``/docs`` works on a server with no internet access.

Examples use generic names (``my-classifier``): the gateway serves whatever models Triton has, so no
shipped model's name belongs in the API's documentation.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from unroll.serving.gateway.errors import ErrorBody

API_VERSION = "1"

DESCRIPTION = """
Classification and denoising with the models Triton Inference Server serves. The gateway discovers them
from Triton: every model whose card (copied into its Triton config by `unroll repo`) says `classification`
or `denoising` is served; `GET /v1/models` lists them, their cards, and the models not served with the
reason. Everything model-specific — tensor names, input size and colour, normalisation, λ and σ — comes
from the card.

**Sending an image.** Either multipart (`curl -F image=@photo.png …`) or the raw bytes with an image
content type (`curl --data-binary @noisy.png -H 'Content-Type: image/png' …`). PNG, JPEG, WebP, TIFF
and BMP are accepted; the body and the pixel count are limited (413 beyond them).

**Classification input rules** (from the model's card). EXIF orientation applied; alpha flattened onto
black; colour converted to the card's (gray: luma; rgb: three planes in the card's channel order); fitted to
the card's input size by its resize policy (`pad-square`: padded with black to a centred square, then resized;
`stretch`: resized; `shorter-side-crop`: shorter side resized to size ÷ crop ratio, then the centred crop, as
ImageNet evaluation does; `none`: the exact size) with the card's interpolation; normalised with the card's
mean/std. Inverted only as `invert` says (below).

**Denoising.** Keeps size and mode (gray, RGB, RGBA, gray+alpha, 16-bit gray; palette/CMYK come back
as RGB); a single-channel denoiser gets the colour channels as one batch `[C,1,H,W]`, a 3-channel denoiser
the RGB image as `[1,3,H,W]`; sides
must be at least the card's `input.min_size`. `sigma` is on the 0–255 scale; omit it to estimate it
(wavelet MAD); the value used is returned in `X-Sigma-Used`, and the RMS of what the model removed (a
residual-based noise estimate, same scale) in `X-Sigma-Residual`.

**Parameters.** `invert` (`auto`, `true`, `false`) inverts the image before classifying; `auto` (the default
for models whose card declares the training images' polarity) inverts when the median brightness of the
image's outermost pixel frame is on the other side of mid-grey from the card's background, so a digit drawn
dark on white reaches a model trained on white-on-black digits the right way round. Images whose longer side
is more than the server's aspect-ratio limit times the shorter are refused (422).

**Errors** are always `{"error": {"code", "message"}}`. **Auth**: when the server has an API key,
send `X-API-Key: KEY` or `Authorization: Bearer KEY` on `/v1/*` and `/v2/*` (health, readiness, metrics are open).
"""

TAGS = [{"name": "inference", "description": "Classification and denoising"},
        {"name": "info", "description": "Served models"},
        {"name": "triton", "description": "Triton's own v2 inference protocol (tritonclient.http), every declared "
                                          "tensor size checked against the bytes sent before Triton sees it"},
        {"name": "ops", "description": "Health, readiness and metrics (never need a key)"}]

_BIN = {"schema": {"type": "string", "format": "binary"}}
IMAGE_BODY: dict[str, Any] = {"requestBody": {"required": True, "content": {
    "multipart/form-data": {"schema": {"type": "object", "required": ["image"],
                                       "properties": {"image": {"type": "string", "format": "binary"}}}},
    **{ct: _BIN for ct in ("image/png", "image/jpeg", "image/webp", "image/tiff", "image/bmp")}}}}


def error_doc(code: str, message: str, description: str) -> dict[str, Any]:
    """One documented error response (schema + example)."""
    return {"model": ErrorBody, "description": description,
            "content": {"application/json": {"example": {"error": {"code": code, "message": message}}}}}


COMMON_ERRORS: dict[int | str, dict[str, Any]] = {
    400: error_doc("invalid_image", "truncated or corrupt image: OSError: image file is truncated",
                   "Not an image, truncated or corrupt, malformed multipart"),
    401: error_doc("unauthorized", "missing or wrong API key", "API key required and missing or wrong"),
    404: error_doc("unknown_model", "unknown classification model 'foo'; served: my-classifier",
                   "Model not served by this gateway"),
    408: error_doc("request_timeout", "the upload did not finish within 60 s", "Upload too slow"),
    413: error_doc("image_too_large", "image is 5000×5000 = 25000000 pixels; the limit is 4194304",
                   "Body over the byte limit, or image over the pixel limit (decompression bombs included)"),
    415: error_doc("unsupported_media_type", "Content-Type 'text/plain' is not accepted",
                   "Not an accepted image type"),
    422: error_doc("invalid_parameter", "top_k: Input should be greater than or equal to 1 (got '0')",
                   "Bad query parameter (e.g. outside the bounds in the model's card), or an image the model "
                   "cannot take (aspect ratio over the limit: `aspect_ratio_too_large`; too small for a denoiser)"),
    429: error_doc("too_many_requests", "server busy: 8 requests running and 32 queued; retry later",
                   "Over the concurrency limit and queue bound (see Retry-After)"),
    502: error_doc("triton_error", "Triton rejected inference on my-classifier: …", "Triton answered with an error"),
    503: error_doc("triton_unavailable", "cannot reach Triton at 127.0.0.1:8001",
                   "Triton down or model not ready (see Retry-After)"),
    504: error_doc("triton_timeout", "Triton did not answer inference on my-denoiser within 60 s", "Triton too slow"),
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {k: COMMON_ERRORS[k] for k in codes}


#: Where the docs pages load Swagger UI / ReDoc from: the gateway itself (never a CDN).
DOCS_STATIC = "/docs/static"


def install_docs(app: FastAPI) -> None:
    """``/docs`` (Swagger UI) and ``/redoc`` with their JavaScript, CSS and icon served by the gateway.

    FastAPI's own pages load these from a CDN, so they are blank on an offline server. The assets come from
    the ``fastapi-offline`` package (Swagger UI 5, which renders the OpenAPI 3.1 that FastAPI writes); its
    ``static`` folder is mounted, and Swagger UI's online validator badge is switched off.
    """
    static = files("fastapi_offline") / "static"
    app.mount(DOCS_STATIC, StaticFiles(directory=str(static)), name="docs-static")
    title = app.title

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}", title=f"{title} — API docs",
            swagger_js_url=f"{root}{DOCS_STATIC}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{DOCS_STATIC}/swagger-ui.css",
            swagger_favicon_url=f"{root}{DOCS_STATIC}/favicon.png",
            swagger_ui_parameters={"validatorUrl": None})

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(openapi_url=f"{root}{app.openapi_url}", title=f"{title} — API reference",
                              redoc_js_url=f"{root}{DOCS_STATIC}/redoc.standalone.js",
                              redoc_favicon_url=f"{root}{DOCS_STATIC}/favicon.png", with_google_fonts=False)
