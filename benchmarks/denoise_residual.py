"""The denoiser's residual as a noise estimate, against the true σ.

On the denoiser's held-out test photos (its card's ``data.test``) with seeded Gaussian noise at known levels, saved
as 8-bit images as a client would send them: the σ the gateway estimates from the image today (wavelet MAD,
``X-Sigma-Used``) and the RMS of what the model removed when run at that σ (``X-Sigma-Residual``,
:func:`unroll.serving.imaging.images.removed_noise_sigma`), each beside the true σ. In-process PyTorch FP32: the
served graph's output agrees with it within the export's parity gate, and the gateway computes the same RMS.
"""

from __future__ import annotations

import numpy as np
import torch

from unroll import registry, tasks
from unroll.benchmarks.common import demo_model, png_bytes
from unroll.data import add_noise, dataset, noise_seed
from unroll.serving.imaging import images, prepare, wire

#: True noise levels (0–255 scale).
LEVELS = (10.0, 25.0, 50.0)


def measure(name: str | None = None, levels: tuple[float, ...] = LEVELS, photos: int | None = None) -> dict:
    """Per test photo and level: the wavelet estimate and the residual's; per level: their mean and mean absolute
    error against the truth."""
    name = name or demo_model(tasks.DENOISING)
    card = registry.get_spec(name).card
    model = registry.load(name).eval()
    rows = []
    for photo, clean in list(dataset(card.data.test).load().items())[:photos]:
        for level in levels:
            e = estimates(model, card, png_bytes(add_noise(clean, level, noise_seed(photo, level))))
            rows.append({"photo": photo, "sigma": level, "wavelet": e["sigma"], "residual": e["residual"]})
    summary = {}
    for level in levels:
        at = [r for r in rows if r["sigma"] == level]
        summary[f"{level:g}"] = {k: {"mean": float(np.mean([r[k] for r in at])),
                                     "mae": float(np.mean([abs(r[k] - level) for r in at]))}
                                 for k in ("wavelet", "residual")}
    return {"model": name, "photos": sorted({r["photo"] for r in rows}), "levels": list(levels), "rows": rows,
            "summary": summary}


@torch.no_grad()
def estimates(model: torch.nn.Module, card, sent: bytes) -> dict[str, float]:
    """One request as the gateway serves it without ``sigma`` (decoded, σ estimated and fitted to the graph as the
    gateway and the Python backend do it): the wavelet σ it runs the model at, how many of the estimate's
    reliability rules fired, and the RMS of what the model removed (0–255 scale)."""
    planes, sigma = prepare.denoiser_planes(sent, wire.DEFAULT_MAX_PIXELS, None, card.input.min_size,
                                           sigma_max=card.sigma.max)
    x = images.to_graph(prepare.to_batch(planes.data, card.input), card.input)
    out = model(torch.from_numpy(x), torch.full((x.shape[0],), sigma.value * 255.0 / card.sigma.scale)).numpy()
    return {"sigma": sigma.value * 255.0, "sigma_rules": float(len(sigma.rules)),
            "residual": images.removed_noise_sigma(x, out, card.input)}


def markdown(p: dict) -> list[str]:
    """The section of ``ood.md``: per true σ, each estimate's mean and mean absolute error."""
    lines = [f"## {p['model']}: the residual as a noise estimate", "",
             f"Test photos ({', '.join(p['photos'])}) with seeded Gaussian noise, sent as 8-bit images; the σ the "
             "gateway estimates from the image (wavelet MAD, `X-Sigma-Used`) and the RMS of what the model removed "
             "when run at that σ (`X-Sigma-Residual`), each against the true σ (0–255 scale; in-process FP32).", "",
             "| true σ | wavelet: mean / MAE | residual: mean / MAE |", "|---|---|---|"]
    for level, s in p["summary"].items():
        lines.append(f"| {level} | {s['wavelet']['mean']:.2f} / {s['wavelet']['mae']:.2f} | "
                     f"{s['residual']['mean']:.2f} / {s['residual']['mae']:.2f} |")
    return [*lines, ""]
