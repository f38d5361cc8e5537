"""Classical denoisers used as baselines: BM3D (``bm3d`` package) and scikit-image's restorers."""

from __future__ import annotations

import numpy as np

from unroll import data
from unroll.metrics import psnr


def bm3d_denoise(noisy: np.ndarray, sigma255: float) -> np.ndarray:
    import bm3d

    return np.asarray(bm3d.bm3d(noisy, sigma_psd=sigma255 / 255.0), dtype=np.float32)


def bm3d_psnr(sigmas: tuple[float, ...], images: dict[str, np.ndarray] | None = None,
              progress=None) -> dict[str, dict[str, float]]:
    """BM3D's PSNR per σ on the held-out images, on the *same* seeded noisy images as the model."""
    images = images if images is not None else data.denoise_test_set()
    out: dict[str, dict[str, float]] = {}
    for s in sigmas:
        per = {}
        for n, img in images.items():
            per[n] = psnr(img, bm3d_denoise(data.add_noise(img, s, data.noise_seed(n, s)), s))
            if progress is not None:
                progress()
        out[f"{s:g}"] = {"mean": float(np.mean(list(per.values()))), **per}
    return out
