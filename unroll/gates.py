"""The one accuracy gate: held-out data, metrics, tolerances and their units, used by quantize and build (export)
and by the ``torch`` runtime's FP16/BF16 gate at load (serving): the core, since both stages use it.

A candidate (an FP16/INT8 ONNX in ONNX Runtime, or a TensorRT engine) is compared with the reference (the verified
FP32 ONNX in ONNX Runtime) on real held-out data the model card names: its gate split (validation) and its stress
set, never the test set, which is only reported. Metrics and units are :data:`METRICS`; tolerances come from
``card.gate(precision)``. Everything is read from the card, so a graph whose model is not registered here still has
a real gate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from unroll import data, tasks
from unroll.card import ModelCard
from unroll.errors import CardError
from unroll.metrics import psnr

Feeds = dict[str, np.ndarray]
Run = Callable[[Feeds], np.ndarray]

#: Classifier gate data per batch when the caller sets no maximum (ONNX Runtime copes; engines set theirs).
DEFAULT_MAX_BATCH = 250


# ---------------------------------------------------------------------------------------------- metrics


@dataclass(frozen=True)
class Metric:
    """One gate metric: which way is better, its unit, and how values are written in messages."""

    direction: Literal["min", "max"]  # min: the value must be ≥ the tolerance; max: ≤
    unit: str
    description: str
    #: The value a perfect candidate has (what the safety margin measures towards).
    best: float
    scale: float = 1.0  # values are shown times this…
    spec: str = ".3f"  # …in this format…
    suffix: str = ""  # …followed by this
    #: Key in the metrics naming where the value was taken (e.g. the worst σ), if any.
    where: str | None = None

    def format(self, value: float) -> str:
        return f"{value * self.scale:{self.spec}}{self.suffix}"

    def passes(self, value: float, tolerance: float) -> bool:
        """NaN never passes."""
        return bool(value >= tolerance) if self.direction == "min" else bool(value <= tolerance)


METRICS: dict[str, Metric] = {
    "top1_agreement": Metric("min", "fraction", "share of samples whose top-1 class equals the FP32 reference's",
                             best=1.0, scale=100.0, spec=".2f", suffix="%"),
    "accuracy_loss": Metric("max", "fraction", "FP32 accuracy minus candidate accuracy on the labelled gate split",
                            best=0.0, scale=100.0, spec=".2f", suffix=" points"),
    "psnr_loss_db": Metric("max", "dB", "mean PSNR of FP32 minus the candidate's, at the worst gate σ",
                           best=0.0, spec=".3f", suffix=" dB", where="worst_sigma"),
    "psnr_loss_db_worst": Metric("max", "dB", "largest PSNR loss vs FP32 of any one gate image at any gate σ",
                                 best=0.0, spec=".3f", suffix=" dB", where="worst_image"),
    "rel_err": Metric("max", "ratio", "‖candidate − reference‖₂ / ‖reference‖₂ over all gate outputs",
                      best=0.0, spec=".2e"),
}


def task_metrics(card: ModelCard) -> tuple[str, ...]:
    """The gate metrics ``card``'s task produces: ``rel_err`` and the task's own (``unroll.tasks``)."""
    return (*tasks.get(card.task).metrics, "rel_err")


def tolerances(card: ModelCard, precision: str, overrides: Mapping[str, float] | None = None) -> dict[str, float]:
    """The gate for ``precision``: ``card.gate(precision)`` (task defaults, then the card's), then ``overrides``.

    An override naming an unknown metric, or one the model's task does not produce, is an error (a gate
    that silently never applies is worse than none).
    """
    for name in overrides or {}:
        if name not in METRICS:
            raise CardError(f"unknown gate metric {name!r}; known: {', '.join(METRICS)}")
        if name not in task_metrics(card):
            usable = [m for m in METRICS if m in task_metrics(card)]
            raise CardError(f"gate metric {name!r} does not apply to {card.name} (a {card.task} model); "
                             f"its metrics: {', '.join(usable)}")
    return {**card.gate(precision), **{k: float(v) for k, v in (overrides or {}).items()}}


# ---------------------------------------------------------------------------------------------- gate data


@dataclass
class GateCase:
    """One batch of gate data: the graph's inputs, and what the task metric needs beside the reference."""

    label: str
    feeds: Feeds
    #: Classifiers: the true classes, for the accuracy delta (``None``: agreement only).
    labels: np.ndarray | None = None
    #: Denoisers: the clean image(s), same shape as the output.
    clean: np.ndarray | None = None
    #: Denoisers: the noise level σ on the 0–255 scale (the metric is reported per level).
    level: float | None = None
    #: The data role the case comes from (``validation``, ``stress``, ``test`` …) and, for denoisers, the image.
    role: str = ""
    image: str = ""

    def __len__(self) -> int:
        return len(next(iter(self.feeds.values())))


def role_dataset(card: ModelCard, role: str) -> data.Dataset:
    """The dataset the card names for ``role`` (train/validation/test/stress); unset is an error naming the field."""
    ds_id = getattr(card.data, role, None)
    if ds_id is None:
        raise CardError(f"{card.name}: no {role} data; set {card.field_hint('data', role, value='<dataset id>')} "
                         f"(dataset ids: {', '.join(data.DATASETS)})")
    return data.dataset(ds_id)


def fit_to_card(card: ModelCard, x: np.ndarray) -> np.ndarray:
    """``[N, C, H, W]`` images fitted to the card's input: resized to a fixed H×W, channels matched."""
    shape = card.input.shape
    if len(shape) != 3:
        raise CardError(f"{card.name}: images cannot feed an input of shape {list(shape)} "
                         "(card.input.shape is not [C, H, W])")
    c, h, w = shape
    target = (c, h if h > 0 else x.shape[2], w if w > 0 else x.shape[3])
    return data.fit_images(x, target).numpy()


def feature_inputs(card: ModelCard) -> np.ndarray:
    """A feature/token block's example inputs: patches of the bundled photos, ``[3, *card.input.shape]``."""
    shape = list(card.input.shape)
    for axis, n in enumerate(shape):
        if n < 0:
            rng = card.trt_profile.dims.get(str(axis))
            if rng is None:
                where = card.field_hint("trt_profile", "dims", str(axis), value="<[min, opt, max]>")
                raise CardError(f"{card.name}: input axis {axis} is dynamic; set {where} "
                                 "(its opt size is the example inputs' size)")
            shape[axis] = rng[1]
    if len(shape) not in (2, 3):
        raise CardError(f"{card.name}: no example inputs for a feature input of shape {list(card.input.shape)}; "
                         f"give the card a dataset ({card.field_hint('data', 'test', value='<dataset id>')}) "
                         "and an image input")
    x = data.photo_features(tuple(shape)).numpy()
    return np.ascontiguousarray(x, dtype=np.float32)


def real_inputs(card: ModelCard, role: str) -> tuple[np.ndarray, np.ndarray | None, str]:
    """Real inputs for a non-denoising graph from the card's ``role`` data: ``(x, labels or None, source)``.

    A feature/token block without data of its own gets :func:`feature_inputs`.
    """
    if getattr(card.data, role, None) is None and tasks.get(card.task).data == "plain" and card.input.colour is None:
        return feature_inputs(card), None, "bundled photos as tokens/feature maps (the export's example inputs)"
    ds = role_dataset(card, role)
    if ds.kind != "labelled":
        raise CardError(f"{card.name}: {card.field_hint('data', role, value=ds.id)} holds {ds.kind}, but a "
                         f"{card.task} gate needs a labelled (array) dataset")
    x, y = ds.load()
    return fit_to_card(card, x), (None if y is None else np.asarray(y)), ds.id


def _lam_feed(card: ModelCard, n: int) -> Feeds:
    if card.lam is None:
        return {}
    if card.lam.default is None:
        raise CardError(f"{card.name}: card.lam.default is unset (export fills it in from the model)")
    return {card.lam.input: np.full(n, card.lam.default, np.float32)}


def _center_crop(img: np.ndarray, hw: tuple[int, int] | None) -> np.ndarray:
    if hw is None:
        return img
    h, w = img.shape[-2:]
    top, left = max(0, (h - hw[0]) // 2), max(0, (w - hw[1]) // 2)
    return img[..., top:top + min(h, hw[0]), left:left + min(w, hw[1])]


def _denoising_cases(card: ModelCard, role: str, max_hw: tuple[int, int] | None) -> list[GateCase]:
    ds = role_dataset(card, role)
    if ds.kind != "images":
        raise CardError(f"{card.name}: {card.field_hint('data', role, value=ds.id)} holds {ds.kind}, a denoiser "
                         "gate needs images")
    channels = card.input.shape[0]
    cases = []
    for name, img in ds.load().items():
        clean = np.repeat(img[None, None], channels, axis=1).astype(np.float32)
        for s in card.sigma.gate_levels:
            noisy = np.repeat(data.add_noise(img, s, data.noise_seed(name, s))[None, None], channels, axis=1)
            c, n = _center_crop(clean, max_hw), _center_crop(noisy, max_hw)
            cases.append(GateCase(f"{name} {c.shape[2]}×{c.shape[3]} σ={s:g}",
                                  {card.input.name: np.ascontiguousarray(n),
                                   card.sigma.input: np.array([s / card.sigma.scale], np.float32)},
                                  clean=np.ascontiguousarray(c), level=float(s), role=role, image=name))
    return cases


def gate_roles(card: ModelCard, split: str | None = None) -> list[str]:
    """The data roles a gate runs on: ``split`` alone if given, else ``card.data.gate`` and, when the card
    names one, ``stress``."""
    if split is not None:
        return [split]
    return [card.data.gate, *(["stress"] if card.data.stress is not None else [])]


def gate_cases(card: ModelCard, split: str | None = None, max_batch: int | None = None,
               max_hw: tuple[int, int] | None = None) -> list[GateCase]:
    """Real held-out gate data for the card's model, as its task builds it.

    ``split``: one data role only (e.g. ``test``, to report); default :func:`gate_roles` — the card's gate split
    and its stress set. ``max_batch``: largest batch per case; ``max_hw``: denoisers' images are centre-cropped
    to at most this H×W.
    """
    if max_batch is not None and max_batch < 1:
        raise ValueError(f"max_batch must be ≥ 1, not {max_batch}")
    return [c for role in gate_roles(card, split) for c in _role_cases(card, role, max_batch, max_hw)]


def gate_source(card: ModelCard, cases: Sequence[GateCase], split: str | None = None) -> str:
    """Where gate cases come from, for reports: ``card.data.validation = denoise-validation + card.data.stress = …``."""
    src = " + ".join(f"card.data.{r} = {getattr(card.data, r, None) or 'the export example inputs'}"
                     for r in gate_roles(card, split))
    return f"{src}: {len(cases)} batches, {sum(len(c) for c in cases)} samples"


def _role_cases(card: ModelCard, role: str, max_batch: int | None,
                max_hw: tuple[int, int] | None) -> list[GateCase]:
    if tasks.get(card.task).data == "noisy":
        return _denoising_cases(card, role, max_hw)
    x, y, source = real_inputs(card, role)
    return array_cases(card, x, source, y, role, max_batch or DEFAULT_MAX_BATCH)


def array_cases(card: ModelCard, x: np.ndarray, source: str, labels: np.ndarray | None = None, role: str = "",
                step: int = DEFAULT_MAX_BATCH) -> list[GateCase]:
    """Inputs ``x`` (fitted to the card) as cases of at most ``step`` samples, each with the card's default λ."""
    cases = []
    for s in range(0, len(x), step):
        part = x[s:s + step]
        cases.append(GateCase(f"{source} [{s}:{s + len(part)}]", {card.input.name: part, **_lam_feed(card, len(part))},
                              labels=None if labels is None else labels[s:s + step], role=role))
    return cases


# ---------------------------------------------------------------------------------------------- measuring


def onnxruntime_run(model, output: str, threads: int = 2) -> Run:
    """A :data:`Run` over ONNX Runtime on CPU (``model``: a path or an ``onnx.ModelProto``) returning ``output``."""
    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(Path(model))
    sess = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    return lambda feeds: sess.run([output], feeds)[0]


def reference_outputs(cases: Sequence[GateCase], run: Run) -> list[np.ndarray]:
    """The reference's outputs once, so many candidates can be measured against them."""
    return [np.asarray(run(c.feeds), np.float32) for c in cases]


def _classification(cases: Sequence[GateCase], refs: list[np.ndarray], gots: list[np.ndarray]) -> dict:
    r, g = np.concatenate(refs).argmax(1), np.concatenate(gots).argmax(1)
    out = {"n": len(r), "top1_agreement": float(np.mean(r == g))}
    if all(c.labels is not None for c in cases):
        y = np.concatenate([np.asarray(c.labels) for c in cases])
        right_ref, right_got = int(np.sum(r == y)), int(np.sum(g == y))
        # the loss from counts, not from two rounded means: one digit of 1,000 is exactly 0.001
        out.update(accuracy_fp32=right_ref / len(y), accuracy=right_got / len(y),
                   accuracy_loss=(right_ref - right_got) / len(y))
    return out


def _denoising(cases: Sequence[GateCase], refs: list[np.ndarray], gots: list[np.ndarray]) -> dict:
    rows: dict[str, dict[str, list[float]]] = {}
    images: dict[str, dict] = {}  # "role/image" → per-σ PSNRs and loss
    for c, a, b in zip(cases, refs, gots, strict=True):
        if c.clean is None or c.level is None:
            raise ValueError(f"gate case {c.label!r}: a denoiser's gate needs the clean image and σ level")
        row = rows.setdefault(f"{c.level:g}", {"ref": [], "got": [], "diff": []})
        for k in range(len(a)):
            ref, got = psnr(c.clean[k], a[k]), psnr(c.clean[k], b[k])
            row["ref"].append(ref)
            row["got"].append(got)
            key = f"{c.role}/{c.image or c.label}" + (f"[{k}]" if len(a) > 1 else "")
            images.setdefault(key, {"role": c.role, "image": c.image or c.label, "per_sigma": {}})["per_sigma"][
                f"{c.level:g}"] = {"psnr_fp32": round(ref, 4), "psnr": round(got, 4), "loss_db": round(ref - got, 4)}
        row["diff"].append(float(np.max(np.abs(a - b))))
    for v in images.values():
        v["worst_loss_db"] = max(p["loss_db"] for p in v["per_sigma"].values())
    worst_key, worst_sigma = max(((k, s) for k, v in images.items() for s in v["per_sigma"]),
                                 key=lambda ks: images[ks[0]]["per_sigma"][ks[1]]["loss_db"])
    per = {s: {"images": len(v["ref"]), "psnr_fp32": float(np.mean(v["ref"])), "psnr": float(np.mean(v["got"])),
               "psnr_loss_db": float(np.mean(v["ref"]) - np.mean(v["got"])), "max_abs_diff": max(v["diff"])}
           for s, v in rows.items()}
    worst = max(per, key=lambda s: per[s]["psnr_loss_db"])
    return {"per_sigma": per, "psnr_loss_db": per[worst]["psnr_loss_db"], "worst_sigma": f"σ={worst}",
            "psnr_loss_db_worst": images[worst_key]["per_sigma"][worst_sigma]["loss_db"],
            "worst_image": f"{worst_key} σ={worst_sigma}", "per_image": images}


def measure(card: ModelCard, cases: Sequence[GateCase], reference_run: Run | Sequence[np.ndarray],
            candidate_run: Run) -> dict:
    """Candidate vs reference on ``cases``: the task's metrics, plus ``rel_err``, ``max_abs_diff``, ``finite``.

    ``reference_run``: a :data:`Run`, or its outputs already computed (:func:`reference_outputs`).
    """
    if not cases:
        raise ValueError(f"{card.name}: no gate cases to measure on")
    refs = list(reference_run) if not callable(reference_run) else reference_outputs(cases, reference_run)
    if len(refs) != len(cases):
        raise ValueError(f"{len(refs)} reference outputs for {len(cases)} gate cases")
    gots = []
    for c, ref in zip(cases, refs, strict=True):
        got = np.asarray(candidate_run(c.feeds), np.float32)
        if got.shape != ref.shape:
            raise ValueError(f"{c.label}: candidate output shape {got.shape} != reference {ref.shape}")
        gots.append(got)
    diff = [(g.astype(np.float64) - r) for g, r in zip(gots, refs, strict=True)]
    num = math.sqrt(sum(float(np.sum(d * d)) for d in diff))
    den = math.sqrt(sum(float(np.sum(r.astype(np.float64) ** 2)) for r in refs))
    out: dict = {"cases": len(cases), "samples": sum(len(c) for c in cases),
                 "finite": all(bool(np.isfinite(g).all()) for g in gots),
                 "max_abs_diff": max(float(np.max(np.abs(d))) for d in diff),
                 "rel_err": num / max(den, 1e-30)}
    task = tasks.get(card.task)
    if task.logits:
        out.update(_classification(cases, refs, gots))
    elif task.data == "noisy":
        out.update(_denoising(cases, refs, gots))
    return out


# ---------------------------------------------------------------------------------------------- verdict


def failures(metrics: Mapping, tolerances: Mapping[str, float]) -> list[str]:
    """One sentence per missed tolerance: the metric, its value, the tolerance and the shortfall.

    A tolerance whose metric was not measured (``accuracy_loss`` on data without labels) is not checked;
    :func:`unmeasured` lists those. Non-finite candidate outputs always fail.
    """
    out = []
    for name, tol in tolerances.items():
        m = METRICS[name]
        if name not in metrics:
            continue
        v = float(metrics[name])
        if m.passes(v, tol):
            continue
        where = f" at {metrics[m.where]}" if m.where and m.where in metrics else ""
        op, gap, word = ("<", tol - v, "short by") if m.direction == "min" else (">", v - tol, "over by")
        out.append(f"{name} {m.format(v)} {op} {m.format(tol)}{where} ({word} {m.format(gap)})")
    if metrics.get("finite") is False:
        out.append("the candidate produced NaN or Inf")
    return out


def unmeasured(metrics: Mapping, tolerances: Mapping[str, float]) -> list[str]:
    """Tolerances the data could not check (reported, so a skipped gate is visible)."""
    return [name for name in tolerances if name not in metrics]


def margin(metrics: Mapping, tolerances: Mapping[str, float]) -> float:
    """How far inside its gate a candidate is: the tightest measured metric's unused fraction of its tolerance.

    1 means no loss at all, 0 exactly on the gate, negative a failure (``-inf`` for NaN/Inf outputs).
    Relative, so one safety fraction fits dB and fractions alike.
    """
    if metrics.get("finite") is False:
        return -math.inf
    fractions = []
    for name, tol in tolerances.items():
        if name not in metrics:
            continue
        m, v = METRICS[name], float(metrics[name])
        span = max((m.best - tol) if m.direction == "min" else (tol - m.best), 1e-9)
        slack = (v - tol) if m.direction == "min" else (tol - v)
        fractions.append(slack / span if math.isfinite(slack) else -math.inf)
    if not fractions:
        raise ValueError(f"none of the gate metrics {sorted(tolerances)} was measured")
    return min(fractions)


@dataclass
class GateResult:
    """A measurement judged against its tolerances."""

    metrics: dict
    tolerances: dict[str, float]
    failures: list[str] = field(default_factory=list)
    unmeasured: list[str] = field(default_factory=list)
    margin: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.failures


def evaluate(card: ModelCard, cases: Sequence[GateCase], reference_run: Run | Sequence[np.ndarray],
             candidate_run: Run, tolerances: Mapping[str, float]) -> GateResult:
    """:func:`measure`, then :func:`failures` and :func:`margin` against ``tolerances``."""
    metrics = measure(card, cases, reference_run, candidate_run)
    tol = dict(tolerances)
    return GateResult(metrics, tol, failures(metrics, tol), unmeasured(metrics, tol), margin(metrics, tol))
