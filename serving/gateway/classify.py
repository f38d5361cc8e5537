"""``POST /v1/classify``: top-k labels for an image, with everything model-specific read from the model's card.

Request flow: API key (401) → model (404) → parameters, checked against the card (422) → declared size
(413) → concurrency slot (429) → streamed body (413/415/400) → the header's checks (not an image, pixel count and
aspect ratio: 400/413/415/422, no pixel decoded) → Triton (503/504/502). Cheap refusals come first.

Where the model takes encoded images (its CPU config has ``image_bytes``: :mod:`unroll.serving.imaging.wire`) the
upload's bytes go to Triton as they came, with λ and ``invert``; the model decodes and fits them exactly as the
gateway would and answers the same 4xx for what only the pixels show (``wire.forward_errors``). Elsewhere (GPU
configs, and ``lam=auto``, whose λ rule needs the decoded image here) the gateway decodes and fits the image to the
card's input itself (400/413/422; a dynamic-size input on a GPU model against its TensorRT profile's H×W range,
``invert`` resolved from the image's border for ``invert=auto``) → [λ rule for ``lam=auto``] → float tensors.
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from PIL import Image
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from unroll import tasks
from unroll.card import InputCard, ModelCard
from unroll.errors import TritonRejected
from unroll.serving.gateway import ood, tracing
from unroll.serving.gateway.catalog import Entry
from unroll.serving.gateway.errors import ApiError
from unroll.serving.gateway.iterations import DeadlineQuery, ItersQuery, iteration, serving_count
from unroll.serving.gateway.openapi import IMAGE_BODY, errors
from unroll.serving.gateway.query import WholeNumber
from unroll.serving.gateway.state import Gateway, GatewayDep, keyed_router, route_task
from unroll.serving.gateway.triton_client import fit_shape
from unroll.serving.imaging import images, prepare, wire
from unroll.serving.imaging.prepare import check_invert
from unroll.tasks import Task


class Prediction(BaseModel):
    label: str = Field(examples=["cat"])
    index: int = Field(examples=[3])
    score: float = Field(description="softmax probability over all classes", examples=[0.9931])


class ClassifyResponse(BaseModel):
    model: str = Field(examples=["my-classifier"])
    predictions: list[Prediction]
    latency_ms: float = Field(description="time spent in the gateway for this request", examples=[6.4])
    lam: float | None = Field(None, description="λ of the model's sparse-coding front end used for this image (the "
                                                "card's default when `lam` was omitted); absent for models without "
                                                "a λ input", examples=[0.1])
    iters: int | None = Field(None, description="solver iterations run for this image (the card's trained count when "
                                                "`iters` was omitted and no objective is in force); absent for models "
                                                "without `iters`; also the `X-Iters` header", examples=[2])
    iters_set_by: Literal["pinned", "controller", "default"] | None = Field(
        None, description="who set `iters`: `pinned` (the request's `iters`), `controller` (picked to meet the "
                          "deadline: the deployment's objective or the request's `deadline_ms`) or `default` (the "
                          "trained count, no objective); also the `X-Iters-Set-By` header", examples=["default"])
    inverted: bool = Field(description="whether the image was inverted (`1 - x`) before classification, as "
                                       "`invert` asked or `invert=auto` decided", examples=[False])
    ood_score: float | None = Field(description="how unlike the training data the image is, from the model's "
                                                "solver residual (`card.ood`'s rule; higher: less alike); null "
                                                "where there is none (`ood_note` says why)", examples=[1.3])
    in_distribution: bool | None = Field(description="whether `ood_score` is within the threshold chosen on "
                                                     "validation data (also the `X-In-Distribution` header); null "
                                                     "without a score", examples=[True])
    ood_note: str | None = Field(None, description="why there is no score: a model without a solver residual, or "
                                                   "a λ / `iters` other than the trained ones the rule holds at")
    abstained: bool | None = Field(None, description="`abstain=true` and the image is out of distribution: no "
                                                     "predictions are given")

    model_config = {"json_schema_extra": {"examples": [{
        "model": "my-classifier", "lam": 0.1, "latency_ms": 6.4, "inverted": False, "ood_score": 1.3,
        "in_distribution": True,
        "predictions": [{"label": "cat", "index": 3, "score": 0.9931}, {"label": "dog", "index": 5, "score": 0.004}]}]}}


async def classifier(request: Request, gw: GatewayDep, model: Annotated[str | None, Query(
        description="Classifier to use (default: the first served; see GET /v1/models)",
        examples=["my-classifier"])] = None) -> Entry:
    """The served model of the route's task that the request names (404 otherwise)."""
    return await gw.catalog.resolve(model, route_task(request))


ClassifierDep = Annotated[Entry, Depends(classifier)]


def parse_lam(raw: str | None) -> float | str | None:
    """``lam`` query value: ``None`` (the card's default), ``"auto"`` or a finite number."""
    if raw is None:
        return None
    if raw.strip().lower() == "auto":
        return "auto"
    try:
        v = float(raw)
    except ValueError:
        raise ApiError(422, "invalid_parameter", f"lam: expected a number or 'auto' (got {raw!r})") from None
    if not math.isfinite(v):
        raise ApiError(422, "invalid_parameter", f"lam: must be a finite number or 'auto' (got {raw!r})")
    return v


def check_lam(card: ModelCard, lam: float | str | None) -> float | str | None:
    """The λ to send (a number, ``"auto"``, or ``None`` for a model without λ), checked against ``card.lam``."""
    spec = card.lam
    if spec is None:
        if lam is not None:
            raise ApiError(422, "invalid_parameter", f"lam: {card.name} has no λ input")
        return None
    if lam is None:
        if spec.default is None:
            raise ApiError(422, "invalid_parameter", f"lam: {card.name}'s card has no default λ; pass lam=<number>")
        return spec.default
    if lam == "auto":
        if spec.auto is None:
            raise ApiError(422, "invalid_parameter", f"lam=auto: {card.name}'s card names no λ rule")
        return lam
    hi = math.inf if spec.max is None else spec.max
    if not spec.min <= lam <= hi:
        raise ApiError(422, "invalid_parameter", f"lam: {card.name} takes λ in [{spec.min:g}, {hi:g}] (got {lam:g})")
    return lam


def routes(task: Task) -> APIRouter:
    """``task``'s ``/v1`` route answered with the top-k labels of the model's logits (JSON)."""
    assert task.route is not None
    router = keyed_router()
    router.post(task.route.path, response_model=ClassifyResponse, response_model_exclude_none=True,
                tags=["inference"], summary=task.route.summary, openapi_extra=IMAGE_BODY,
                responses=errors(400, 404, 408, 413, 415, 422, 429, 502, 503, 504))(classify)
    return router


async def classify(
    request: Request,
    gw: GatewayDep,
    entry: ClassifierDep,
    top_k: Annotated[WholeNumber, Query(ge=1, description="How many labels to return (1…number of classes)",
                                examples=[3])] = 5,
    lam: Annotated[str | None, Query(description="λ of the model's sparse-coding front end, for models whose card "
                                                 "declares one: a number within the card's bounds, or `auto` to "
                                                 "pick it from the image with the card's λ rule; omit for the "
                                                 "card's (trained) λ", examples=["0.3", "auto"])] = None,
    invert: Annotated[Literal["auto", "true", "false"] | None, Query(
        description="Invert the image (`1 - x`) before classifying: `true`, `false`, or `auto` — for models whose "
                    "card declares the training images' polarity (`input.polarity`, e.g. light strokes on a dark "
                    "background), invert when the median brightness of the image's outermost pixel frame is on the "
                    "other side of mid-grey (0.5) from the card's background. Default: `auto` when the card "
                    "declares a polarity, else `false`.", examples=["auto"])] = None,
    iters: ItersQuery = None,
    deadline_ms: DeadlineQuery = None,
    abstain: Annotated[bool, Query(description="Give no predictions for an image the model's solver residual calls "
                                               "out of distribution (`in_distribution: false`): the answer is still "
                                               "200, with `abstained: true` and an empty `predictions`")] = False,
) -> JSONResponse:
    t0 = time.perf_counter()
    card, info = entry.card, entry.info
    assert card is not None and info is not None  # served entries have both (catalog)
    n_classes = class_count(card, info)
    if n_classes is not None and top_k > n_classes:
        raise ApiError(422, "invalid_parameter", f"top_k: {entry.name} has {n_classes} classes (got {top_k})")
    lam_v = check_lam(card, parse_lam(lam))
    inv = check_invert(card.input, invert)
    rule = await gw.catalog.companion(card.lam.auto, entry.name, tasks.LAMBDA_RULE) if lam_v == "auto" else None
    model, model_card, it = entry.name, card, iteration(gw, entry, iters, deadline_ms, t0)
    settings = gw.settings
    with tracing.span("receive"):
        data = await gw.read_image(request)  # before the slot: a slow upload never holds an inference slot
    async with serving_count(gw, it) as count:  # the graph: iters=K's, or the controller's under a deadline
        entry = count.entry
        card, info = entry.card, entry.info
        assert card is not None and info is not None
        hw = info.profile.hw(card.input.name) if info.profile is not None else None
        if rule is None and wire.IMAGE_BYTES in info.inputs:  # the model decodes: the upload's bytes go as they are
            async with tracing.queued(gw.admission.slot()):
                with tracing.span("decode"):  # the header's checks; the model decodes
                    prepare.check_header(data, settings.max_pixels, settings.max_aspect_ratio, hw, entry.name)
                inputs = {wire.IMAGE_BYTES: wire.image_row(data, info.batched),
                          wire.INVERT: wire.per_item(wire.code_of(wire.INVERT_CODES, inv), np.int32, info.batched)}
                if card.lam is not None:
                    inputs[card.lam.input] = wire.per_item(lam_v, np.float32, info.batched)
                async with wire.forward_errors():
                    res = await gw.infer(entry, inputs, [card.output, *ood.outputs(card, info.outputs),
                                                         wire.IMAGE_INFO], class_count=n_classes)
            inverted = bool(wire.read_info(res[wire.IMAGE_INFO][0])["inverted"])
        else:
            res, inverted, lam_v = await _decoded(gw, entry, data, inv, lam_v, hw, rule, n_classes)
    k = count.k
    with tracing.span("encode"):
        if n_classes is None:  # a class axis only known once the model answers: logits, bounded now
            preds, msp = predictions_from_logits(np.asarray(res[card.output], np.float32)[0], top_k, card, entry.name)
        else:
            preds, msp = _classes(res[card.output][0], top_k)
    latency = round((time.perf_counter() - t0) * 1000.0, 2)
    # The documented ClassifyResponse, built as a plain dict (no per-request model validation and dump).
    body: dict = {"model": model, "predictions": preds, "latency_ms": latency}
    if card.lam is not None:
        body["lam"] = round(float(lam_v), 6)
    if k is not None:
        body["iters"], body["iters_set_by"] = k, count.set_by
    body["inverted"] = inverted
    body.update(ood.fields(model_card, card, float(lam_v) if card.lam is not None else None, res, msp))
    if abstain and body["in_distribution"] is False:
        body["predictions"], body["abstained"] = [], True
    return JSONResponse(body, headers={"X-Latency-Ms": str(latency), ood.HEADER: ood.header(body), **count.headers()})


async def _decoded(gw: Gateway, entry: Entry, data: bytes, inv: images.Invert, lam_v: float | str | None,
                   hw: images.HWRange | None, rule: Entry | None, n_classes: int | None
                   ) -> tuple[dict[str, np.ndarray], bool, float | str | None]:
    """The image decoded and fitted here and sent as float tensors (a GPU config; ``lam=auto``'s λ rule):
    Triton's result, whether it was inverted and the λ used."""
    card, info, settings = entry.card, entry.info, gw.settings
    assert card is not None and info is not None

    def fit() -> tuple[Image.Image, images.Fitted]:
        img = images.decode(data, settings.max_pixels, settings.max_aspect_ratio)
        return img, images.classifier_input(img, card.input, inv, hw, entry.name)

    async with tracing.queued(gw.admission.slot()):
        # A small image (a digit, a thumbnail) is decoded and fitted on the event loop: cheaper than the hop to a
        # worker thread and back (measured, benchmarks/gateway_profile.py); anything larger goes to the threadpool.
        with tracing.span("decode"):
            if images.is_small(data, card.input):
                img, fitted = fit()
            else:
                img, fitted = await run_in_threadpool(fit)
        inputs = {card.input.name: fitted.x}
        if rule is not None:
            lam_v = await _auto_lam(gw, rule, img, fitted, card.input)
        if card.lam is not None:
            inputs[card.lam.input] = fit_shape(np.array([lam_v], np.float32), info.inputs[card.lam.input])
        res = await gw.infer(entry, inputs, [card.output, *ood.outputs(card, info.outputs)], class_count=n_classes)
    return res, fitted.inverted, lam_v


def class_count(card: ModelCard, info) -> int | None:
    """The model's real number of classes: the served output's last axis where it is static, else the card's
    labels; ``None`` where neither says (then ``top_k`` is checked against the logits Triton returns)."""
    out = info.outputs.get(card.output)
    dim = out.shape[-1] if out is not None and out.shape else -1
    if dim > 0:
        return int(dim)
    return len(card.labels) if card.labels else None


def predictions_from_logits(logits: np.ndarray, top_k: int, card: ModelCard, name: str) -> tuple[list[dict], float]:
    """Top-k from raw logits (a model whose class axis is dynamic), labels from the card where it has them; and one
    minus the softmax's maximum."""
    logits = logits.reshape(-1).astype(np.float64)
    if top_k > logits.size:
        raise ApiError(422, "invalid_parameter", f"top_k: {name} has {logits.size} classes (got {top_k})")
    labels = card.labels if card.labels and len(card.labels) == logits.size else None
    return _top(logits, [(int(i), labels[i] if labels else str(int(i))) for i in range(logits.size)], top_k)


def _top(logits: np.ndarray, classes: list[tuple[int, str]], top_k: int) -> tuple[list[dict], float]:
    """The ``top_k`` classes (``(index, label)`` per logit) by softmax probability, and one minus the largest."""
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")[:top_k]
    preds = [{"label": classes[i][1], "index": classes[i][0], "score": round(float(probs[i]), 6)} for i in order]
    return preds, float(1.0 - probs.max())


async def _auto_lam(gw: Gateway, rule: Entry, img: Image.Image, fitted: images.Fitted, fitted_for: InputCard) -> float:
    """λ picked by the classifier's λ rule (a Triton model with its own card) from the same image, inverted or not
    as the classifier's input was."""
    assert rule.card is not None
    same = "true" if fitted.inverted else "false"
    rx = fitted.x if rule.card.input == fitted_for else (
        await run_in_threadpool(images.classifier_input, img, rule.card.input, same)).x
    out = await gw.infer(rule, {rule.card.input.name: rx}, [rule.card.output])
    lam = float(np.asarray(out[rule.card.output], dtype=np.float32).reshape(-1)[0])
    if not math.isfinite(lam):
        raise TritonRejected(f"the λ rule {rule.name} returned {lam}")
    return lam


def _classes(entries: np.ndarray, top_k: int) -> tuple[list[dict], float]:
    """Parse Triton's ``score:index[:label]`` strings (all classes) → top-k with softmax probabilities, and one minus
    the largest."""
    parsed = []
    for e in entries.reshape(-1):
        text = e.decode() if isinstance(e, bytes) else str(e)
        parts = text.split(":", 2)
        try:
            parsed.append((float(parts[0]), int(parts[1]), parts[2] if len(parts) == 3 else parts[1]))
        except (ValueError, IndexError):
            raise TritonRejected(f"unexpected classification entry from Triton: {text!r}") from None
    return _top(np.array([p[0] for p in parsed], dtype=np.float64), [(p[1], p[2]) for p in parsed], top_k)