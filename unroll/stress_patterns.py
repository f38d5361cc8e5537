"""Seeded synthetic images of the content that breaks reduced-precision denoisers.

INT8 activations share one scale per tensor; content whose responses are much larger or much more regular than
natural photos (high-contrast periodic patterns near the filters' own frequencies, text, hard edges, texture on a
flat background) is where a calibrated range clips or rounds coarsely. Each image is drawn from a kind and a seed
(no image files): the same (kind, seed) always gives the same pixels, and disjoint seed ranges give the gate, the
calibration and the reported sets (:data:`SEEDS`), disjoint by content (``tests/test_stress_patterns.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

#: Side of every pattern image (pixels): larger than a denoiser's receptive field, small enough for a fast gate.
SIDE = 128
#: Images per kind in each set: each draws its own scale, contrast and orientation, so the more there are, the
#: better a set spans them (with 2 per kind, the gate set missed content that the report set then failed on).
PER_KIND = 8
#: First seed of each set; a set takes seeds ``first … first + PER_KIND - 1`` of every kind.
SEEDS = {"gate": 0, "report": 1000, "calibration": 2000}


def _levels(rng: np.random.Generator) -> tuple[float, float]:
    """Two grey levels: a contrast from 0.3 to 1 around a mean that keeps both inside [0, 1]."""
    contrast = float(rng.uniform(0.3, 1.0))
    mean = float(rng.uniform(contrast / 2, 1 - contrast / 2))
    return mean - contrast / 2, mean + contrast / 2


def _grid(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Pixel coordinates rotated: half the time along a pixel axis (man-made content mostly is, and the filters'
    strongest responses are there), else by a random angle."""
    theta = float(rng.choice([0.0, np.pi / 2])) if rng.random() < 0.5 else float(rng.uniform(0, np.pi))
    y, x = np.mgrid[0:SIDE, 0:SIDE].astype(np.float32)
    return x * np.cos(theta) + y * np.sin(theta), -x * np.sin(theta) + y * np.cos(theta)


def checkerboard(rng: np.random.Generator) -> np.ndarray:
    """Squares of 2–16 pixels, random phase, random levels."""
    cell = int(rng.choice([2, 3, 4, 6, 8, 12, 16]))
    lo, hi = _levels(rng)
    dy, dx = (int(v) for v in rng.integers(0, cell, 2))
    y, x = np.mgrid[0:SIDE, 0:SIDE]
    return np.where(((y + dy) // cell + (x + dx) // cell) % 2 == 0, lo, hi).astype(np.float32)


def grating(rng: np.random.Generator) -> np.ndarray:
    """A sinusoid of period 3–24 pixels at a random orientation."""
    period = float(rng.uniform(3, 24))
    lo, hi = _levels(rng)
    u, _ = _grid(rng)
    return (lo + (hi - lo) * (0.5 + 0.5 * np.sin(2 * np.pi * u / period))).astype(np.float32)


def stripes(rng: np.random.Generator) -> np.ndarray:
    """Square-wave bars 1–8 pixels wide at a random orientation (hard-edged gratings)."""
    width = int(rng.choice([1, 2, 3, 4, 6, 8]))
    lo, hi = _levels(rng)
    u, _ = _grid(rng)
    return np.where(np.floor(u / width) % 2 == 0, lo, hi).astype(np.float32)


def text(rng: np.random.Generator) -> np.ndarray:
    """Lines of random characters in Pillow's bundled font at 10–28 px, dark on light or light on dark."""
    from PIL import Image, ImageDraw, ImageFont

    lo, hi = _levels(rng)
    ink, paper = (lo, hi) if rng.random() < 0.5 else (hi, lo)
    img = Image.new("F", (SIDE, SIDE), paper)
    d = ImageDraw.Draw(img)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789.,;:!?()[]/"
    y = int(rng.integers(0, 6))
    while y < SIDE:
        size = int(rng.integers(10, 29))
        line = "".join(rng.choice(list(alphabet), int(rng.integers(8, 20))))
        d.text((int(rng.integers(-4, 8)), y), line, fill=ink, font=ImageFont.load_default(size=size))
        y += size + int(rng.integers(1, 6))
    return np.asarray(img, np.float32)


def edges(rng: np.random.Generator) -> np.ndarray:
    """Overlapping polygons and one-pixel lines with hard edges, full contrast."""
    from PIL import Image, ImageDraw

    img = Image.new("F", (SIDE, SIDE), float(rng.choice([0.0, 1.0])))
    d = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(6, 12))):
        pts = [tuple(int(v) for v in rng.integers(-16, SIDE + 16, 2)) for _ in range(int(rng.integers(3, 6)))]
        d.polygon(pts, fill=float(rng.choice([0.0, 0.25, 0.75, 1.0])))
    for _ in range(int(rng.integers(4, 10))):
        x0, y0, x1, y1 = (int(v) for v in rng.integers(0, SIDE, 4))
        d.line((x0, y0, x1, y1), fill=float(rng.choice([0.0, 1.0])), width=1)
    return np.asarray(img, np.float32)


def flat_with_texture(rng: np.random.Generator) -> np.ndarray:
    """A flat background with a few square patches of fine texture (noise, checks, a grating)."""
    img = np.full((SIDE, SIDE), float(rng.uniform(0.1, 0.9)), np.float32)
    for _ in range(int(rng.integers(2, 5))):
        side = int(rng.integers(16, 48))
        y, x = (int(v) for v in rng.integers(0, SIDE - side, 2))
        lo, hi = _levels(rng)
        kind = int(rng.integers(3))
        if kind == 0:
            patch = rng.uniform(lo, hi, (side, side))
        elif kind == 1:
            yy, xx = np.mgrid[0:side, 0:side]
            patch = np.where((yy // 2 + xx // 2) % 2 == 0, lo, hi)
        else:
            patch = lo + (hi - lo) * (0.5 + 0.5 * np.sin(np.arange(side) * 2 * np.pi / rng.uniform(3, 8)))[None, :]
            patch = np.broadcast_to(patch, (side, side))
        img[y:y + side, x:x + side] = patch
    return img


#: Every kind, by name.
KINDS: dict[str, Callable[[np.random.Generator], np.ndarray]] = {
    "checkerboard": checkerboard, "grating": grating, "stripes": stripes, "text": text, "edges": edges,
    "flat_with_texture": flat_with_texture}


def pattern(kind: str, seed: int) -> np.ndarray:
    """One ``SIDE``×``SIDE`` float32 image in [0, 1] of ``kind``, drawn from ``seed``."""
    # the kind is part of the seed, so seed 0 of two kinds draws different numbers
    rng = np.random.default_rng([seed, list(KINDS).index(kind)])
    return np.clip(KINDS[kind](rng), 0.0, 1.0).astype(np.float32)


def pattern_set(which: str) -> dict[str, np.ndarray]:
    """The ``gate``, ``report`` or ``calibration`` set (:data:`SEEDS`): ``{"kind-seed": image}``."""
    first = SEEDS[which]
    return {f"{kind}-{seed}": pattern(kind, seed) for kind in KINDS for seed in range(first, first + PER_KIND)}
