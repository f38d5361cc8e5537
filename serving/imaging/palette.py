"""A palette (``P``) image's palette, and denoised colours mapped back onto it, so a palette PNG comes back as one.

Why back to the input's palette rather than RGB: the response keeps the input's mode wherever PNG can hold it, and a
palette image's consumers (indexed-colour pipelines, sprite sheets, GIF-derived assets) expect indices into *that*
palette with *its* transparency. Each pixel takes the palette entry nearest to its denoised colour (Euclidean RGB,
exact; no dithering, which would add back noise) among the entries with the same alpha as the pixel's own entry,
so which pixels are transparent (and how much) never changes. The price: colours snap to the palette, as in the input.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

#: Pixels looked up per nearest-entry query (bounded temporaries at any image size).
_CHUNK = 1 << 18


@dataclass(frozen=True)
class Palette:
    """What a ``P`` image needs to be written back: its entries and their alpha, and its PNG transparency."""

    colours: np.ndarray  # [N, 3] uint8
    alphas: np.ndarray  # [N] uint8: 255 opaque
    transparency: int | bytes | None  # Pillow's ``info["transparency"]``, written back as the PNG's tRNS


def of(img: Image.Image) -> Palette | None:
    """The palette of a ``P`` image (an ``RGBA`` palette's alpha, or ``tRNS`` transparency, gives entry alphas);
    ``None`` when it has no entries."""
    rgba = img.palette is not None and img.palette.mode == "RGBA"
    flat = np.asarray(img.getpalette("RGBA" if rgba else "RGB") or [], np.uint8)
    entries = flat.reshape(-1, 4 if rgba else 3)
    if len(entries) == 0:
        return None
    alphas = entries[:, 3].copy() if rgba else np.full(len(entries), 255, np.uint8)
    t = img.info.get("transparency")
    if isinstance(t, int) and 0 <= t < len(alphas):
        alphas[t] = 0
    elif isinstance(t, bytes):
        n = min(len(t), len(alphas))
        alphas[:n] = np.frombuffer(t, np.uint8)[:n]
    if not isinstance(t, int | bytes):  # no tRNS: an RGBA palette's own alphas, if any is not opaque
        t = alphas.tobytes() if rgba and bool((alphas < 255).any()) else None
    return Palette(np.ascontiguousarray(entries[:, :3]), alphas, t)


def quantize(rgb: np.ndarray, alpha: np.ndarray | None, pal: Palette) -> Image.Image:
    """``[3, H, W]`` uint8 colours (and the pixels' ``[H, W]`` alpha, or ``None`` when opaque) → a ``P`` image on
    ``pal``: each pixel's nearest entry among those of its alpha (module docstring). Works through the pixels in
    chunks, so its temporaries stay small at any image size."""
    from scipy.spatial import cKDTree

    h, w = rgb.shape[1:]
    flat = rgb.reshape(3, -1)
    alphas = None if alpha is None else alpha.reshape(-1)
    index = np.zeros(h * w, np.uint8)
    trees: dict[int, tuple[np.ndarray, cKDTree | None]] = {}
    for i in range(0, h * w, _CHUNK):
        colours = flat[:, i:i + _CHUNK].T
        part = index[i:i + len(colours)]
        chunk_alpha = np.full(len(colours), 255, np.uint8) if alphas is None else alphas[i:i + len(colours)]
        for a in np.unique(chunk_alpha).tolist():
            if a not in trees:
                entries = np.flatnonzero(pal.alphas == a)
                if entries.size == 0:  # not one of this palette's alphas (cannot happen for a decoded P image)
                    entries = np.arange(len(pal.alphas))
                tree = cKDTree(pal.colours[entries].astype(np.float32)) if entries.size > 1 else None
                trees[a] = (entries, tree)
            entries, tree = trees[a]
            sel = chunk_alpha == a
            if tree is None:
                part[sel] = entries[0]
            else:
                part[sel] = entries[tree.query(colours[sel].astype(np.float32), k=1)[1]]
    out = Image.frombytes("P", (w, h), index.tobytes())
    out.putpalette(pal.colours.tobytes(), "RGB")
    if pal.transparency is not None:
        out.info["transparency"] = pal.transparency
    return out
