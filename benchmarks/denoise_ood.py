"""Is this the kind of image the denoiser was made for? The discrepancy of its own sparse reconstruction.

The denoiser's output is its sparse code's reconstruction ``D·z``; what it removed, ``y − D·z``, is its solver's
residual. For Gaussian noise of the σ it is run at (the gateway's wavelet estimate, ``X-Sigma-Used``), the residual's
RMS (``X-Sigma-Residual``) sits close to that σ (Morozov's discrepancy principle); inputs unlike the noisy photos it
was trained for break that relation. The signal is the *discrepancy* ``log(residual σ / σ used)``; both numbers are
what the gateway computes for every ``/v1/denoise`` answer already, so serving it costs nothing more.

In-distribution: crops of photos with Gaussian noise at the σ the card serves (:data:`LEVELS`). Out of distribution,
five kinds (:data:`KINDS`), each in two halves disjoint by content — validation crops from the card's validation
photos (and half the graphic images), test crops from its held-out test photos (and the other half), with their own
noise parameters and seeds. Chosen on validation only: the rule (the discrepancy one-sided either way or two-sided,
``|d − median| / MAD`` of the in-distribution validation crops) by mean AUROC over the validation kinds, and the
threshold (:data:`FLAG_QUANTILE` of the validation crops' scores). Reported on test only: AUROC and FPR95 per kind,
beside the baselines a user has today, the wavelet σ estimate itself and the count of its reliability rules
(``X-Sigma-Rule``), and the share of in-distribution test crops flagged. In-process PyTorch FP32, each crop sent
as a client would (8-bit PNG, or JPEG for that kind) and decoded and fitted as the gateway does.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import numpy as np
import torch

from unroll import registry, tasks
from unroll.benchmarks.common import demo_model, png_bytes
from unroll.benchmarks.denoise_residual import estimates
from unroll.benchmarks.ood_scores import auroc, fpr95
from unroll.data import add_noise, dataset

#: In-distribution noise levels (0–255 scale): the range the card serves.
LEVELS = (10.0, 25.0, 50.0)
#: Crop side (pixels) and crops per image and condition.
SIDE, CROPS = 128, 6
FLAG_QUANTILE = 0.99
KINDS = ("impulse noise", "JPEG blocking", "beyond the σ range", "photon noise", "graphics")
#: Each kind's parameters per half: validation and test never share a value or a seed.
PARAMS = {
    "validation": {"impulse": (0.05,), "jpeg_quality": (25,), "over_sigma": (80.0,), "photon_peak": (20.0,),
                   "seed": 101},
    "test": {"impulse": (0.02, 0.10), "jpeg_quality": (10, 40), "over_sigma": (100.0, 120.0),
             "photon_peak": (5.0, 50.0), "seed": 202},
}
SCORES = ("rule", "sigma", "sigma_rules")


def _crops(img: np.ndarray, n: int, rng: np.random.Generator) -> list[np.ndarray]:
    h, w = img.shape
    side = min(SIDE, h, w)
    return [img[y:y + side, x:x + side] for y, x in
            zip(rng.integers(0, h - side + 1, n), rng.integers(0, w - side + 1, n), strict=True)]


def _jpeg(a: np.ndarray, quality: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.rint(np.clip(a, 0, 1) * 255).astype(np.uint8)).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def _halves(card) -> dict[str, tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]:
    """Per half: its photos and its graphic images (the card's stress images, their families — a name before its
    ``-seed`` — dealt alternately to the two halves, so no family is in both)."""
    stress = dataset(card.data.stress).load()
    families = sorted({k.split("-")[0] for k in stress})
    half = {f: ("validation", "test")[i % 2] for i, f in enumerate(families)}
    graphics = {h: {k: v for k, v in stress.items() if half[k.split("-")[0]] == h} for h in ("validation", "test")}
    return {"validation": (dataset(card.data.validation).load(), graphics["validation"]),
            "test": (dataset(card.data.test).load(), graphics["test"])}


def requests(half: str, card, crops: int = CROPS) -> dict[str, list[bytes]]:
    """The encoded images of ``half``: ``in distribution`` (Gaussian noise at :data:`LEVELS`) and each kind, from
    ``crops`` crops per image."""
    photos, graphics = _halves(card)[half]
    p = PARAMS[half]
    rng = np.random.default_rng(p["seed"])
    out: dict[str, list[bytes]] = {"in distribution": [], **{k: [] for k in KINDS}}

    def noisy(c: np.ndarray, sigma: float) -> np.ndarray:
        return add_noise(c, sigma, int(rng.integers(2**31)))

    for img in photos.values():
        for c in _crops(img, crops, rng):
            out["in distribution"] += [png_bytes(noisy(c, s)) for s in LEVELS]
            for d in p["impulse"]:
                hit = rng.random(c.shape) < d
                out["impulse noise"].append(png_bytes(np.where(hit, (rng.random(c.shape) < 0.5), c)))
            out["JPEG blocking"] += [_jpeg(noisy(c, 10.0), q) for q in p["jpeg_quality"]]
            out["beyond the σ range"] += [png_bytes(noisy(c, s)) for s in p["over_sigma"]]
            out["photon noise"] += [png_bytes(rng.poisson(c * peak) / peak) for peak in p["photon_peak"]]
    for img in graphics.values():
        for c in _crops(img, crops, rng):
            out["graphics"].append(png_bytes(noisy(c, 25.0)))
    return out


def signals(model: torch.nn.Module, card, sent: list[bytes]) -> dict[str, np.ndarray]:
    """:func:`~unroll.benchmarks.denoise_residual.estimates` of every request as arrays, with the discrepancy
    ``log(residual σ / σ used)``."""
    rows = [estimates(model, card, s) for s in sent]
    out = {k: np.array([r[k] for r in rows]) for k in rows[0]}
    out["discrepancy"] = np.log((out["residual"] + 0.5) / (out["sigma"] + 0.5))  # +½ level: σ = 0 stays finite
    return out


def _rules(inside: np.ndarray) -> dict[str, Callable[[np.ndarray], np.ndarray]]:
    center = float(np.median(inside))
    scale = float(np.median(np.abs(inside - center))) or 1e-12
    return {"discrepancy, high": lambda d: (d - center) / scale, "discrepancy, low": lambda d: (center - d) / scale,
            "discrepancy, two-sided": lambda d: np.abs(d - center) / scale}


def evaluate(name: str | None = None, tick: Callable[[str], None] = lambda m: None, crops: int = CROPS) -> dict:
    """The denoiser's rule chosen on validation and its test results (module docstring); ``crops`` per image and
    condition (fewer: a quick run)."""
    name = name or demo_model(tasks.DENOISING)
    card = registry.get_spec(name).card
    model = registry.load(name).eval()
    tick(f"{name}: validation")
    val = {k: signals(model, card, v) for k, v in requests("validation", card, crops).items()}
    inside = val.pop("in distribution")
    rules = _rules(inside["discrepancy"])
    val_auroc = {r: float(np.mean([auroc(f(inside["discrepancy"]), f(s["discrepancy"])) for s in val.values()]))
                 for r, f in rules.items()}
    chosen = max(val_auroc, key=val_auroc.get)
    rule = rules[chosen]
    threshold = float(np.quantile(rule(inside["discrepancy"]), FLAG_QUANTILE))
    score = {"rule": lambda s: rule(s["discrepancy"]), "sigma": lambda s: s["sigma"],
             "sigma_rules": lambda s: s["sigma_rules"]}
    tick(f"{name}: test")
    test = {k: signals(model, card, v) for k, v in requests("test", card, crops).items()}
    test_in = test.pop("in distribution")
    sets = {kind: {"n": len(s["sigma"]), "flagged": float((score["rule"](s) > threshold).mean()),
                   **{k: {"auroc": auroc(f(test_in), f(s)), "fpr95": fpr95(f(test_in), f(s))}
                      for k, f in score.items()}} for kind, s in test.items()}
    return {"model": name, "rule": chosen, "validation_mean_auroc": val_auroc, "threshold": threshold,
            "center": float(np.median(inside["discrepancy"])), "levels": list(LEVELS), "crop": SIDE,
            "in_distribution": {"validation": len(inside["sigma"]), "test": len(test_in["sigma"]),
                                "flagged": float((score["rule"](test_in) > threshold).mean())},
            "params": PARAMS, "sets": sets}


def markdown(p: dict) -> list[str]:
    """The section of ``ood.md``."""
    t = PARAMS["test"]
    lines = [f"## {p['model']}: is this the noise it was made for?", "",
             f"The discrepancy log(residual σ / σ used): the RMS of what the denoiser removed (its sparse "
             f"reconstruction's residual, `X-Sigma-Residual`) against the wavelet σ it was run at (`X-Sigma-Used`); "
             f"both are in every `/v1/denoise` answer already. In distribution: {p['crop']}² crops of photos with "
             f"Gaussian noise σ {', '.join(f'{s:g}' for s in p['levels'])} ({p['in_distribution']['validation']} "
             f"validation, {p['in_distribution']['test']} test crops). Test kinds: impulse noise "
             f"(densities {', '.join(map(str, t['impulse']))}), JPEG blocking (σ 10 then quality "
             f"{', '.join(map(str, t['jpeg_quality']))}), noise beyond the σ range "
             f"(σ {', '.join(f'{s:g}' for s in t['over_sigma'])}), photon (Poisson) noise (peaks "
             f"{', '.join(f'{s:g}' for s in t['photon_peak'])}), graphics with σ 25 noise; validation used other "
             "photos, graphics, parameters and seeds.", "",
             f"- rule chosen on validation: **{p['rule']}** (validation mean AUROC "
             f"{p['validation_mean_auroc'][p['rule']]:.3f}; "
             + ", ".join(f"{k} {v:.3f}" for k, v in p["validation_mean_auroc"].items() if k != p["rule"])
             + f"); threshold {p['threshold']:.2f} (validation crops' {FLAG_QUANTILE:.0%} quantile)",
             f"- in-distribution test crops flagged: {p['in_distribution']['flagged']:.1%}", "",
             "| test set | images | discrepancy | σ estimate | σ rules fired | flagged |", "|---|---|---|---|---|---|"]
    for kind, s in p["sets"].items():
        cells = " | ".join(f"{s[k]['auroc']:.3f} / {s[k]['fpr95']:.2f}" for k in SCORES)
        lines.append(f"| {kind} | {s['n']} | {cells} | {s['flagged']:.0%} |")
    return [*lines, ""]
