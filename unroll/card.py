"""The model card: everything a pipeline stage needs to know about a model, declared once.

A card is declared where a model is registered (its architecture file, ``@register_model``), written into
every exported ONNX as one JSON value in ``metadata_props`` under :data:`CARD_KEY`, copied by
``unroll repo`` into the Triton config's ``parameters`` (same key), and read from there by quantize,
build, repo, serve and the gateway. No stage after export looks a model up by its name: a user's model
with a card goes through the whole pipeline like the shipped ones.

Why pydantic: the card crosses process and file boundaries (ONNX metadata, Triton configs, the
gateway), so it is validated wherever it is read and a malformed card is an error naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from unroll import tasks
from unroll.errors import CardError  # re-exported: ``unroll.card.CardError`` is the same class

#: ``metadata_props`` key in the ONNX, and ``parameters`` key in the Triton config.
CARD_KEY = "unroll.card"
CARD_VERSION = 1

#: A registered task's name (:mod:`unroll.tasks`: ``classification``, ``denoising``, ``block``, ``lambda-rule`` and
#: any task registered since); the card's validator checks it against the registry.
Task = str
Precision = Literal["fp32", "fp16", "int8"]


#: Where a card was written: ``register_model(card=...)``, ``unroll export --model``'s options, a JSON file
#: (``--card FILE``) or a dict given to ``unroll.export.export()``. A message asking for a field names it as it is
#: written there (:meth:`ModelCard.field_hint`).
Origin = Literal["registration", "options", "file", "python"]
#: The ``unroll export`` options that set a card field (the field's keys, joined by dots → the option).
EXPORT_OPTIONS = {"data.train": "--data-train", "data.test": "--data-test", "labels": "--labels",
                  "lam.input": "--lam-input", "lam.default": "--lam-default", "sigma.input": "--sigma-input",
                  "sigma.scale": "--sigma-scale", "input.mean": "--mean", "input.std": "--std",
                  "input.colour": "--colour", "input.resize": "--resize", "input.min_size": "--min-size",
                  "input.name": "--input-name", "output": "--output-name", "description": "--description"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InputCard(_Strict):
    """The graph's main input, and how a user's image is fitted to it."""

    #: Graph input name (``image`` for classifiers, ``noisy`` for denoisers, ``x`` for blocks).
    name: str
    #: Shape of one sample (no batch axis); -1 marks a dynamic axis (image H×W, tokens).
    shape: tuple[int, ...]
    #: Smallest size a dynamic axis accepts (denoisers: 16, the stride-2 dictionary's floor).
    min_size: int = 1
    #: ``gray`` or ``rgb`` for image inputs (channel order of ``shape[0]``); ``None`` for feature/token tensors.
    colour: Literal["gray", "rgb"] | None = None
    #: Pixel values the model was trained on, before normalisation.
    value_range: tuple[float, float] = (0.0, 1.0)
    #: Per-channel normalisation applied *by the client* before the graph: ``(x - mean) / std``.
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    #: Order of the three planes of an ``rgb`` input: ``rgb``, or ``bgr`` for a model trained on OpenCV/Caffe-style
    #: BGR images (``mean``/``std`` are then in B, G, R order too). Must be ``rgb`` for other inputs.
    channel_order: Literal["rgb", "bgr"] = "rgb"
    #: How a classifier's image of another size is fitted to a fixed H×W: ``pad-square`` (centred black padding
    #: to a square, then resize: keeps the aspect, as MNIST digits are), ``stretch`` (resize only),
    #: ``shorter-side-crop`` (ImageNet evaluation: scale the image, keeping its aspect, so that it just covers
    #: H×W ÷ ``crop_ratio``, i.e. the shorter side becomes ``int(H / crop_ratio)`` for a square input, then
    #: take the centred H×W; torchvision's ``Resize(256)`` + ``CenterCrop(224)``) or ``none`` (no fitting:
    #: the model takes the image's own H×W, as denoisers and dynamic-size classifiers do; a fixed-size
    #: model then needs the exact size).
    resize: Literal["pad-square", "stretch", "shorter-side-crop", "none"] = "none"
    #: ``shorter-side-crop`` only: crop side ÷ resized side (torchvision's 224/256 = 0.875, timm's ``crop_pct``).
    crop_ratio: float = Field(0.875, gt=0.0, le=1.0)
    #: Resampling filter of the fit, as Pillow computes it (antialiased when shrinking): ``lanczos``
    #: (Lanczos-3), ``bilinear`` (torchvision's ``Resize`` default) or ``bicubic``.
    interpolation: Literal["lanczos", "bilinear", "bicubic"] = "lanczos"
    #: What the training images look like: ``light-on-dark`` (MNIST: white strokes on black) or
    #: ``dark-on-light``; ``None``: not a drawing of strokes on a plain background. The gateway's
    #: ``invert=auto`` needs it to decide whether a user's image is the other way round.
    polarity: Literal["light-on-dark", "dark-on-light"] | None = None

    @property
    def fixed_hw(self) -> tuple[int, int] | None:
        """``(H, W)`` for an image input of fixed size, else ``None``."""
        if self.colour is None or len(self.shape) != 3 or min(self.shape[1:]) < 0:
            return None
        return self.shape[1], self.shape[2]

    @model_validator(mode="after")
    def _check(self) -> InputCard:
        if self.colour is not None and (len(self.shape) != 3 or self.shape[0] != {"gray": 1, "rgb": 3}[self.colour]):
            raise ValueError(f"a {self.colour} image input has shape [C, H, W] with C = "
                             f"{ {'gray': 1, 'rgb': 3}[self.colour]}, not {list(self.shape)}")
        for what in (self.mean, self.std):
            if len(what) not in (1, self.shape[0] if self.shape else 1):
                raise ValueError(f"mean/std take 1 value or one per channel, got {list(what)}")
        if any(s == 0 for s in self.std):
            raise ValueError("std must not be 0")
        if self.channel_order == "bgr" and self.colour != "rgb":
            raise ValueError("channel_order bgr needs a colour (rgb) image input")
        if self.resize != "none" and self.colour is not None and self.fixed_hw is None:
            raise ValueError(f"resize {self.resize!r} needs a fixed H×W; a dynamic-size input takes resize 'none'")
        return self


class LamCard(_Strict):
    """A per-sample sparsity λ input of the first solver layer (SDNet's robustness knob)."""

    input: str = "lam"
    #: The trained λ, used when a request gives none. ``None`` in a declaration means "the first solver
    #: layer's λ": export fills it in from the model, so the number lives in one place (the weights).
    default: float | None = None
    min: float = 0.0
    max: float | None = None
    #: Name of the served companion model that picks λ from the image (``lam=auto``), if any.
    auto: str | None = None


class IterCard(_Strict):
    """Iteration counts served for the model's weight-tied solver layers (SDNet's FISTA, VARS's ISTA steps, NMF
    updates, Dic-Attn's ISTA): the request's ``iters=K`` picks one, each a static graph of its own."""

    #: The trained count, used when a request gives none. ``None`` in a declaration means "the solver layers'
    #: count": export fills it in from the model (every tied solver layer must have the same count).
    default: int | None = Field(None, ge=1)
    #: The counts served; export adds the default. Each count other than the default is a sibling graph
    #: (:meth:`graph`) exported, verified and served beside the model.
    served: tuple[int, ...] = Field(min_length=1)

    @field_validator("served")
    @classmethod
    def _positive(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if any(k < 1 for k in v):
            raise ValueError(f"iteration counts are at least 1, got {list(v)}")
        return tuple(sorted(set(v)))

    @property
    def counts(self) -> tuple[int, ...]:
        """Every served count, the default included, ascending."""
        return tuple(sorted({*self.served, *([self.default] if self.default is not None else [])}))

    def graph(self, model: str, k: int) -> str:
        """The served graph that runs ``model`` with ``k`` iterations: the model itself for the default."""
        return model if k == self.default else f"{model}-iters{k}"


class SigmaCard(_Strict):
    """A per-sample noise-level input (denoisers)."""

    input: str = "sigma"
    #: The graph takes σ / ``scale``: 255 means σ on the [0, 1] pixel scale while users speak 0–255.
    scale: float = 255.0
    #: Noise levels (0–255 scale) the quality gate measures at.
    gate_levels: tuple[float, ...] = (15.0, 25.0, 50.0)
    #: Largest σ (0–255 scale) the model is trained and gated for: the gateway clips an *estimated* σ to it (and
    #: says the estimate is unreliable, rule ``above-range``); a σ the client passes is used as given.
    max: float = Field(50.0, gt=0.0)


class DataCard(_Strict):
    """Named datasets (``unroll.data.DATASETS``) in each role. Training data also calibrates INT8 unless
    ``calibration`` names a set of its own."""

    train: str | None = None
    #: INT8 calibration data (default: ``train``), for content the training data does not cover.
    calibration: str | None = None
    validation: str | None = None
    test: str | None = None
    stress: str | None = None
    #: Which role the accuracy gates are evaluated on.
    gate: Literal["validation", "test"] = "test"


class ProfileCard(_Strict):
    """TensorRT optimization profile defaults: (min, opt, max) per dynamic axis."""

    batch: tuple[int, int, int] = (1, 8, 32)
    #: Ranges for dynamic non-batch axes by position in :attr:`InputCard.shape` (e.g. ``{"1": …}``).
    dims: dict[str, tuple[int, int, int]] = Field(default_factory=dict)


class TileCard(_Strict):
    """How a large image runs through the graph in overlapping windows (``unroll/tiling.py``): memory per graph
    execution bounded by the window, the result equal to the whole image's (the export checks it)."""

    #: Side of a window in pixels, margins included; an image side that fits is not cut.
    size: int = Field(ge=16)
    #: Pixels a window reads beyond the part it keeps: at least the graph's receptive radius.
    margin: int = Field(ge=0)
    #: Window offsets are multiples of this (2 for a stride-2 dictionary's phase grid).
    align: int = Field(1, ge=1)
    #: The graph subtracts its input's mean (a global statistic): each window then carries a filler strip that
    #: gives it the whole image's mean.
    mean_centred: bool = False

    @model_validator(mode="after")
    def _check(self) -> TileCard:
        if self.size - 2 * self.margin < self.align:
            raise ValueError(f"tiling: size {self.size} leaves nothing inside two margins of {self.margin}")
        return self


#: The columns of the graph's solver output (``OodCard.output``), per sample.
SOLVER_SIGNALS = ("residual", "code_l1")
#: What an out-of-distribution term reads, per image: the solver's signals and one minus the softmax's maximum.
OodSignal = Literal["residual", "code_l1", "msp"]


class OodTerm(_Strict):
    """One signal's part of the score: ``weight · (s − center) / scale`` (``high``: a large value counts against the
    image) or ``weight · |s − center| / scale`` (``both``: an atypical value either way); ``center`` and ``scale``
    are the validation digits' median and MAD."""

    signal: OodSignal
    sided: Literal["high", "both"]
    center: float = 0.0
    scale: float = Field(1.0, gt=0.0)
    weight: float = Field(1.0, gt=0.0)

    def value(self, s: Any) -> Any:
        """The term of one signal value, or of each of an array of them."""
        d = s - self.center
        return self.weight * (abs(d) if self.sided == "both" else d) / self.scale

    def fitted(self, inside: Any) -> OodTerm:
        """This term centred on the median of ``inside`` (the signal on in-distribution data) and scaled by its
        median absolute deviation."""
        import numpy as np

        center = float(np.median(inside))
        return self.model_copy(update={"center": center,
                                       "scale": float(np.median(np.abs(np.asarray(inside) - center))) or 1e-12})


class OodCard(_Strict):
    """An out-of-distribution score from the model's first solver layer (:mod:`unroll.solvers.residual`): the
    graph's extra output ``output``, ``[B, 2]``: per sample the relative residual ``‖x − D·z‖ / ‖x‖`` and the code's
    size ``‖z‖₁ / ‖x‖`` (:data:`SOLVER_SIGNALS`, one output: each output a Python-backend model returns costs a
    request more than these few norms), and the rule that turns them (and the softmax's maximum, where validation
    showed it adds something) into a score and a verdict, chosen on validation data by ``unroll bench ood`` (kept in
    the model's training record; export fills it in). Calibrated at the card's trained λ and iteration count:
    another λ or count changes the residual, so the verdict is given only at those."""

    output: str = "solver_fit"
    #: The score is the sum of the terms; none: not calibrated (the signals are served, no verdict).
    terms: tuple[OodTerm, ...] = ()
    #: Scores above it are out of distribution: the :attr:`quantile` of the validation digits' scores.
    threshold: float | None = None
    quantile: float = Field(0.99, gt=0.0, lt=1.0)
    #: The precision of the graph whose signals the terms and threshold were measured on (``unroll quantize``
    #: measures them again on its FP16/INT8 graph: a quantized solver's residual moves).
    measured_on: Precision = "fp32"

    @property
    def calibrated(self) -> bool:
        return bool(self.terms) and self.threshold is not None

    @property
    def signals(self) -> set[str]:
        """The signals the rule reads."""
        return {t.signal for t in self.terms}

    def score(self, signals: dict[str, Any]) -> Any:
        """The score of an image from its signals (higher: less like the training data); of each image, given arrays
        of them."""
        return sum(t.value(signals[t.signal]) for t in self.terms)

    def refit(self, inside: dict[str, Any], precision: str | None = None) -> OodCard:
        """The same rule (signals, sides, weights) with each term's centre and scale and the threshold measured again
        on ``inside``, the signals of the validation data (arrays), e.g. as a quantized graph gives them."""
        import numpy as np

        rule = self.model_copy(update={"terms": tuple(t.fitted(inside[t.signal]) for t in self.terms),
                                       **({"measured_on": precision} if precision else {})})
        return rule.model_copy(update={"threshold": float(np.quantile(rule.score(inside), self.quantile))})


class ModelCard(_Strict):
    """What every stage after export needs to know about one model (see the module docstring)."""

    version: int = CARD_VERSION
    #: The model's name: registry name, ONNX file stem and Triton model name.
    name: str
    task: Task
    description: str = ""
    input: InputCard
    #: Graph output name (``logits``, ``denoised``, ``y``, ``lam``).
    output: str
    #: Class names, one per logit (classifiers).
    labels: tuple[str, ...] | None = None
    lam: LamCard | None = None
    sigma: SigmaCard | None = None
    #: Per-request iteration counts of the weight-tied solver layers (``iters=K``), or ``None``: one count only.
    iters: IterCard | None = None
    data: DataCard = DataCard()
    #: Gate tolerances per precision, overriding the task's defaults (``unroll.tasks.get(task).gates``) metric by
    #: metric.
    gates: dict[str, dict[str, float]] = Field(default_factory=dict)
    trt_profile: ProfileCard = ProfileCard()
    #: Precisions worth building/serving; ``serve`` is what ``unroll serve`` deploys.
    precisions: tuple[Precision, ...] = ("fp32", "fp16", "int8")
    serve_precision: Precision = "fp32"
    #: CPU target: the runtime that runs the fused graph inside Triton's Python backend
    #: (``serving/cpu_runtime.py``). A per-model choice made by measurement (``unroll bench export``'s
    #: "served" column); the GPU target always runs TensorRT.
    cpu_runtime: Literal["onnxruntime", "openvino"] = "onnxruntime"
    #: OpenVINO on the CPU target: compile one static-shape model per input shape met (a few kept) instead of
    #: running the dynamic-shape graph; worth it where shapes repeat (a denoiser's tiling windows), not where the
    #: dynamic batcher makes every batch size. ``unroll optimize`` measures both.
    cpu_static_shapes: bool = False
    #: For a ``lambda-rule`` graph: the classifier it picks λ for.
    companion_of: str | None = None
    #: Image-to-image graphs with a bounded receptive field: how large images run in windows (``None``: whole).
    tiling: TileCard | None = None
    #: The solver's residual as an out-of-distribution score (a second graph output), or ``None``: the model has
    #: no such output and the API says the score is not available.
    ood: OodCard | None = None
    #: Where this card was written (set by whoever builds it, not by its author): ``registration``, ``options``
    #: (``unroll export --model``), ``python`` (a dict given to ``export()``) or ``file``, with the JSON file's name
    #: in ``origin_file`` (the name only: the card is shown by the gateway's ``/v1/models``). Messages that ask for
    #: a field use it (:meth:`field_hint`).
    origin: Origin = "registration"
    origin_file: str | None = None

    @field_validator("task")
    @classmethod
    def _known_task(cls, v: str) -> str:
        if v not in tasks.names():
            raise ValueError(f"unknown task {v!r}; registered tasks: {', '.join(tasks.names())}")
        return v

    @model_validator(mode="after")
    def _check(self) -> ModelCard:
        tasks.get(self.task).check(self)
        if self.ood is not None and not tasks.get(self.task).logits:
            raise ValueError(f"ood: the residual score is served for classifiers (a task with logits), not {self.task}")
        if self.ood is not None and self.ood.output in {self.output, *self.input_names}:
            raise ValueError(f"ood.output {self.ood.output!r} names another tensor of the graph")
        unknown = set(self.gates) - {"fp32", "fp16", "int8"}
        if unknown:
            raise ValueError(f"gates are per precision (fp32, fp16, int8), not {sorted(unknown)}")
        return self

    # ------------------------------------------------------------------ derived facts

    def gate(self, precision: str) -> dict[str, float]:
        """Tolerances for ``precision``: the task's defaults, then this card's overrides."""
        return {**tasks.get(self.task).gates.get(precision, {}), **self.gates.get(precision, {})}

    @property
    def output_names(self) -> list[str]:
        """Graph outputs in order: the main output, then the solver's signals of ``ood``."""
        return [self.output, *([self.ood.output] if self.ood is not None else [])]

    @property
    def input_names(self) -> list[str]:
        """Graph inputs in order: the main input, then λ or σ."""
        extra = [c.input for c in (self.lam, self.sigma) if c is not None]
        return [self.input.name, *extra]

    def companion(self, task: Task, name: str, description: str, output: str) -> ModelCard:
        """The card of a graph that serves this model (e.g. its λ rule), same input."""
        return ModelCard(name=name, task=task, description=description, input=self.input, output=output,
                         data=self.data, trt_profile=self.trt_profile, companion_of=self.name,
                         origin=self.origin, origin_file=self.origin_file)

    @property
    def written_in(self) -> str:
        """Where the card's fields are written, for messages: ``the model's registration``, ``FILE`` …"""
        if self.origin == "file":
            return self.origin_file or "the JSON card given with --card"
        if self.origin == "options":
            return "the options of `unroll export --model`"
        if self.origin == "python":
            return "the card given to unroll.export.export()"
        return "the model's registration"

    def field_hint(self, *keys: str, value: object = None) -> str:
        """The field ``keys`` (``"data", "test"``) set to ``value`` (``None``: ``…``; a ``str`` in ``<>`` is a
        placeholder) as the card's author writes it, and where: ``card.data.test = 'x' in the model's
        registration``, ``"data": {"test": "x"} in my-model.card.json``, or the ``unroll export`` option."""
        placeholder = value is None or (isinstance(value, str) and value.startswith("<"))
        shown = "…" if value is None else str(value) if placeholder else None
        option = EXPORT_OPTIONS.get(".".join(keys))
        if self.origin == "file":
            text = shown if placeholder else json.dumps(value)
            for k in reversed(keys[1:]):
                text = "{" + f"{json.dumps(k)}: {text}" + "}"
            return f"{json.dumps(keys[0])}: {text} in {self.written_in}"
        attr = "card." + keys[0] + "".join(f"[{k!r}]" if k.isdigit() else f".{k}" for k in keys[1:])
        assigned = f"{attr} = {shown if placeholder else repr(value)}"
        if self.origin == "options":
            return (f"`unroll export ... {option} {shown if placeholder else value}`" if option else
                    f"{assigned} in a JSON card attached with --card (no `unroll export` option sets it)")
        also = f" (or `unroll export {option}`)" if option and placeholder else ""  # asking for a value, not citing one
        return f"{assigned} in {self.written_in}{also}"

    # ------------------------------------------------------------------ serialisation

    def to_json(self) -> str:
        return self.model_dump_json(exclude_defaults=False)

    @classmethod
    def from_json(cls, text: str, where: str = "card") -> ModelCard:
        try:
            return cls.model_validate(json.loads(text))
        except (ValueError, ValidationError) as e:
            raise CardError(f"{where}: invalid unroll model card: {e}") from None


# ---------------------------------------------------------------------------------------------- ONNX


def write_to_onnx(model, card: ModelCard) -> None:
    """Put ``card`` into an ``onnx.ModelProto``'s ``metadata_props`` (replacing an older one)."""
    props = [p for p in model.metadata_props if p.key != CARD_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(props)
    entry = model.metadata_props.add()
    entry.key, entry.value = CARD_KEY, card.to_json()


def from_onnx(model) -> ModelCard:
    """The card of an ``onnx.ModelProto``, or a file path to one (only the header is parsed)."""
    where = "ONNX model"
    if isinstance(model, str | Path):
        import onnx

        where = str(model)
        model = onnx.load(str(model), load_external_data=False)
    for p in model.metadata_props:
        if p.key == CARD_KEY:
            return ModelCard.from_json(p.value, where)
    raise CardError(f"{where} carries no unroll model card (metadata_props[{CARD_KEY!r}]); "
                    "export it with `unroll export` so every later stage knows what it is")
