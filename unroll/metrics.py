"""Image-quality metrics shared by training, evaluation, gates and benchmarks (one definition each)."""

from __future__ import annotations

import numpy as np


def psnr(clean: np.ndarray, estimate: np.ndarray) -> float:
    """PSNR in dB of ``estimate`` clipped to [0, 1] against ``clean`` (scikit-image, data range 1)."""
    from skimage.metrics import peak_signal_noise_ratio

    return float(peak_signal_noise_ratio(clean, np.clip(estimate, 0, 1), data_range=1.0))
