"""Images a digit classifier was never trained on, in two disjoint halves: validation (choose a rule) and test (report).

Each half has five kinds, made from package data and seeded code, at the digits' 28×28 grey scale in [0, 1]; the
halves differ by *content*, not only by draw:

- photo crops: validation from scikit-learn's two photos (``china``, ``flower``), test from scikit-image's
  ``astronaut``, ``coffee``, ``chelsea`` and ``rocket`` (grey, seeded square crops, 28²);
- letters and symbols: rendered with matplotlib's DejaVu fonts, validation in DejaVu Sans (upper-case letters),
  test in DejaVu Serif and DejaVu Sans Mono (lower-case letters and symbols);
- noise: validation uniform, test Gaussian (clipped) and salt-and-pepper, each from its own seed;
- blank: validation flat grey levels, test linear gradients;
- inverted digits: validation digits inverted for validation, test digits inverted for test.

:func:`photos` gives the three whole photos of the issue that motivated the score (astronaut, chelsea, coffee).
"""

from __future__ import annotations

import functools

import numpy as np

from unroll import data

SIDE = 28
#: Images per kind and half (letters: one per character and font).
PER_KIND = 96
VALIDATION_PHOTOS = ("sklearn_china", "sklearn_flower")
TEST_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")
WHOLE_PHOTOS = ("astronaut", "chelsea", "coffee")
VALIDATION_FONTS = ("DejaVu Sans",)
TEST_FONTS = ("DejaVu Serif", "DejaVu Sans Mono")
VALIDATION_CHARS = "ABCDEFGHJKLMNPQRSTUVWXYZ"
TEST_CHARS = "abdefghkmnpqrtwxyz#@%&?*+=<>$"
#: Seeds of the noise and blank draws: validation and test never share one.
SEEDS = {"validation": 11, "test": 29}
KINDS = ("photo crops", "letters", "noise", "blank", "inverted digits")


def _grey(rgb: np.ndarray) -> np.ndarray:
    """``[N, 3, H, W]`` → ``[N, 1, H, W]`` (plain mean, as the gateway's grey models see a colour upload's luma
    closely enough for a detector's test set)."""
    return rgb.mean(axis=1, keepdims=True).astype(np.float32)


def _crops(names: tuple[str, ...]) -> np.ndarray:
    per = -(-PER_KIND // len(names))
    return _grey(data.photo_crops(names, per_photo=per, side=SIDE)[0])[:PER_KIND]


@functools.cache
def _font(family: str, size: int):
    from matplotlib import font_manager
    from PIL import ImageFont

    path = font_manager.findfont(font_manager.FontProperties(family=family), fallback_to_default=False)
    return ImageFont.truetype(path, size)


def _letters(chars: str, families: tuple[str, ...]) -> np.ndarray:
    """Each character in each font, white on black, centred, about the height of an MNIST digit."""
    from PIL import Image, ImageDraw

    out = []
    for family in families:
        font = _font(family, 20)
        for ch in chars:
            img = Image.new("L", (SIDE, SIDE), 0)
            draw = ImageDraw.Draw(img)
            left, top, right, bottom = draw.textbbox((0, 0), ch, font=font)
            draw.text(((SIDE - (right - left)) / 2 - left, (SIDE - (bottom - top)) / 2 - top), ch, fill=255,
                      font=font)
            out.append(np.asarray(img, np.float32)[None] / 255.0)
    return np.stack(out)


def _noise(half: str) -> np.ndarray:
    rng = np.random.default_rng(SEEDS[half])
    shape = (PER_KIND, 1, SIDE, SIDE)
    if half == "validation":
        return rng.random(shape, dtype=np.float32)
    gauss = np.clip(rng.normal(0.5, 0.25, (PER_KIND // 2, 1, SIDE, SIDE)), 0, 1)
    salt = (rng.random((PER_KIND - PER_KIND // 2, 1, SIDE, SIDE)) < 0.2).astype(np.float64)
    return np.concatenate([gauss, salt]).astype(np.float32)


def _blank(half: str) -> np.ndarray:
    rng = np.random.default_rng(SEEDS[half] + 1)
    if half == "validation":
        return np.broadcast_to(rng.random((PER_KIND, 1, 1, 1)), (PER_KIND, 1, SIDE, SIDE)).astype(np.float32)
    ramp = np.linspace(0.0, 1.0, SIDE, dtype=np.float32)
    out = []
    for _ in range(PER_KIND):
        a, b = np.sort(rng.random(2))
        g = a + (b - a) * ramp
        out.append((g[None, :] if rng.random() < 0.5 else g[:, None]) * np.ones((SIDE, SIDE), np.float32))
    return np.stack(out)[:, None]


def ood_sets(half: str) -> dict[str, np.ndarray]:
    """The five kinds of ``half`` (``validation`` or ``test``): ``{kind: [N, 1, 28, 28] float32 in [0, 1]}``."""
    if half not in SEEDS:
        raise ValueError(f"half must be validation or test, not {half!r}")
    digits = data.mnist_roles()[half][0]
    sets = {
        "photo crops": _crops(VALIDATION_PHOTOS if half == "validation" else TEST_PHOTOS),
        "letters": _letters(*((VALIDATION_CHARS, VALIDATION_FONTS) if half == "validation"
                              else (TEST_CHARS, TEST_FONTS))),
        "noise": _noise(half),
        "blank": _blank(half),
        "inverted digits": 1.0 - digits[:PER_KIND],
    }
    return {k: np.ascontiguousarray(v, np.float32) for k, v in sets.items()}


def photos() -> dict[str, np.ndarray]:
    """The whole photos of :data:`WHOLE_PHOTOS`, grey, resized to 28² (antialiased): ``{name: [1, 1, 28, 28]}``."""
    import torch
    import torch.nn.functional as F

    out = {}
    for name in WHOLE_PHOTOS:
        img = torch.from_numpy(data.colour_image(name)).permute(2, 0, 1)[None]
        small = F.interpolate(img, size=(SIDE, SIDE), mode="bilinear", antialias=True, align_corners=False)
        out[name] = _grey(np.clip(small.numpy(), 0.0, 1.0))
    return out
