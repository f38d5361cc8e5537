"""Image corruptions at three severities, generated in code (an MNIST-C / ImageNet-C-style set).

The robustness the seed papers promise (SDNet's λ, VARS's and Dic-Attn's sparse attention) is measured on these:
noise (Gaussian, shot, salt-and-pepper), blur (Gaussian, motion), photometric changes (contrast, brightness), lossy
encoding (JPEG), resolution loss (pixelation), occlusion patches and small rotations with shifts. Every function
takes and returns ``[N, C, H, W]`` float32 in [0, 1] and is deterministic for a seed (each image gets its own draw),
so a benchmark's corrupted test set is the same on every machine.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from unroll.errors import UnknownName

SEVERITIES = (1, 2, 3)


@dataclass(frozen=True)
class Corruption:
    name: str
    description: str
    #: One parameter per severity (1, 2, 3), in the unit the description names.
    levels: tuple[float, float, float]
    apply: Callable[[np.ndarray, float, np.random.Generator], np.ndarray]


def _gaussian_noise(img: np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
    return img + rng.normal(0.0, sigma, img.shape)


def _shot_noise(img: np.ndarray, photons: float, rng: np.random.Generator) -> np.ndarray:
    return rng.poisson(img * photons) / photons


def _salt_pepper(img: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    out = img.copy()
    hit = rng.random(img.shape[1:]) < fraction  # the same pixels in every channel
    out[:, hit] = rng.integers(0, 2, int(hit.sum())).astype(img.dtype)
    return out


def _gaussian_blur(img: np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
    from scipy.ndimage import gaussian_filter

    return gaussian_filter(img, sigma=(0, sigma, sigma), mode="nearest")


def _motion_blur(img: np.ndarray, length: float, rng: np.random.Generator) -> np.ndarray:
    """A straight streak of ``length`` pixels at a random angle (the camera moved during the exposure)."""
    from scipy.ndimage import convolve

    n = int(length)
    angle = rng.uniform(0, np.pi)
    kernel = np.zeros((n, n))
    c = (n - 1) / 2
    for t in np.linspace(-c, c, 4 * n):
        kernel[int(round(c + t * np.sin(angle))), int(round(c + t * np.cos(angle)))] = 1.0
    kernel /= kernel.sum()
    return np.stack([convolve(ch, kernel, mode="nearest") for ch in img])


def _contrast(img: np.ndarray, factor: float, rng: np.random.Generator) -> np.ndarray:
    mean = img.mean(axis=(1, 2), keepdims=True)
    return (img - mean) * factor + mean


def _brightness(img: np.ndarray, shift: float, rng: np.random.Generator) -> np.ndarray:
    return img + shift


def _jpeg(img: np.ndarray, quality: float, rng: np.random.Generator) -> np.ndarray:
    from PIL import Image

    u8 = np.rint(np.clip(img, 0, 1) * 255).astype(np.uint8)
    pil = Image.fromarray(u8[0] if len(u8) == 1 else u8.transpose(1, 2, 0))
    buf = io.BytesIO()
    pil.save(buf, format="JPEG", quality=int(quality))
    out = np.asarray(Image.open(io.BytesIO(buf.getvalue())), np.float32) / 255.0
    return out[None] if out.ndim == 2 else out.transpose(2, 0, 1)


def _pixelate(img: np.ndarray, scale: float, rng: np.random.Generator) -> np.ndarray:
    """Box-downsampled to ``scale`` of the size, then blown back up with nearest neighbours."""
    from PIL import Image

    h, w = img.shape[1:]
    small = (max(1, round(w * scale)), max(1, round(h * scale)))
    return np.stack([np.asarray(Image.fromarray(ch.astype(np.float32)).resize(small, Image.Resampling.BOX)
                                .resize((w, h), Image.Resampling.NEAREST)) for ch in img])


def _occlusion(img: np.ndarray, patches: float, rng: np.random.Generator) -> np.ndarray:
    """``patches`` black squares, each a fifth of the image side, at random places."""
    out = img.copy()
    h, w = img.shape[1:]
    side = max(1, min(h, w) // 5)
    for _ in range(int(patches)):
        top, left = rng.integers(0, h - side + 1), rng.integers(0, w - side + 1)
        out[:, top:top + side, left:left + side] = 0.0
    return out


def _rotate_shift(img: np.ndarray, degrees: float, rng: np.random.Generator) -> np.ndarray:
    """A rotation of ±``degrees`` about the centre and a shift of up to ``degrees / 10`` pixels each way."""
    from scipy.ndimage import affine_transform

    a = np.deg2rad(rng.choice([-1.0, 1.0]) * degrees)
    shift = rng.uniform(-degrees / 10, degrees / 10, 2)
    rot = np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]])
    centre = (np.array(img.shape[1:]) - 1) / 2
    offset = centre - rot @ (centre + shift)
    return np.stack([affine_transform(ch, rot, offset=offset, order=1, mode="constant", cval=0.0) for ch in img])


CORRUPTIONS: dict[str, Corruption] = {c.name: c for c in (
    Corruption("gaussian_noise", "additive Gaussian noise, σ", (0.1, 0.2, 0.35), _gaussian_noise),
    Corruption("shot_noise", "Poisson (photon) noise, photons at full brightness", (60.0, 20.0, 8.0), _shot_noise),
    Corruption("salt_pepper", "impulse noise, fraction of pixels set to 0 or 1", (0.03, 0.08, 0.15), _salt_pepper),
    Corruption("gaussian_blur", "Gaussian blur, σ in pixels", (0.6, 1.0, 1.6), _gaussian_blur),
    Corruption("motion_blur", "straight motion streak, length in pixels", (3.0, 5.0, 7.0), _motion_blur),
    Corruption("contrast", "contrast scaled about the mean, factor", (0.6, 0.4, 0.2), _contrast),
    Corruption("brightness", "brightness shift", (0.2, 0.35, 0.5), _brightness),
    Corruption("jpeg", "JPEG compression, quality", (40.0, 15.0, 5.0), _jpeg),
    Corruption("pixelate", "resolution, fraction of the size kept", (0.7, 0.5, 0.35), _pixelate),
    Corruption("occlusion", "black square patches (a fifth of the side), count", (1.0, 2.0, 3.0), _occlusion),
    Corruption("rotate_shift", "rotation in degrees (and a shift of a tenth of that in pixels)", (10.0, 20.0, 30.0),
               _rotate_shift),
)}


def corrupt(x: np.ndarray, name: str, severity: int, seed: int = 0) -> np.ndarray:
    """``x`` ``[N, C, H, W]`` in [0, 1] with corruption ``name`` at ``severity`` 1–3; clipped back to [0, 1].

    Deterministic: image ``i`` draws from a generator seeded with ``(seed, corruption index, severity, i)``.
    """
    if name not in CORRUPTIONS:
        raise UnknownName(f"unknown corruption {name!r}; known: {', '.join(CORRUPTIONS)}")
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be one of {SEVERITIES}, not {severity!r}")
    if x.ndim != 4:
        raise ValueError(f"expected [N, C, H, W] images, got shape {x.shape}")
    c = CORRUPTIONS[name]
    index = list(CORRUPTIONS).index(name)
    level = c.levels[severity - 1]
    out = [c.apply(np.asarray(img, np.float64), level, np.random.default_rng((seed, index, severity, i)))
           for i, img in enumerate(x)]
    return np.clip(np.stack(out), 0.0, 1.0).astype(np.float32)
