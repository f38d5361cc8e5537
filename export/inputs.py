"""Real example inputs for every registered model: the export traces with them and verifies on them.

What the inputs look like comes from the model card alone: classifiers get samples of the card's test
(else training) dataset at their input size, denoisers noisy crops of bundled images at several sizes
and σ, image-like blocks bundled photos, token blocks 8×8 patches of bundled photos as tokens, feature
maps the same patches laid out on a grid. A random input per model is added as well.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from unroll import data
from unroll.card import ModelCard
from unroll.registry import ModelSpec


@dataclass
class Case:
    label: str
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


def _tokens(n_tokens: int, dim: int, name: str) -> torch.Tensor:
    """``[1, n_tokens, dim]``: non-overlapping √dim×√dim patches of a bundled image, as tokens."""
    p = int(round(dim**0.5))
    img = torch.from_numpy(data.bundled_image(name))[None, None]
    side = int(np.ceil(n_tokens**0.5)) * p
    img = F.interpolate(img, size=(side, side), mode="bilinear", antialias=True, align_corners=False)
    return F.unfold(img, p, stride=p).transpose(1, 2)[:, :n_tokens]


def fit_images(x: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """``[N, C, H, W]`` images resized (bilinear, antialiased) and channel-matched to ``shape = (C, H, W)``."""
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    c, h, w = shape
    if t.shape[1] != c:
        t = t.mean(1, keepdim=True).expand(-1, c, -1, -1) if c != 1 else t.mean(1, keepdim=True)
    if t.shape[2:] != (h, w):
        t = F.interpolate(t, size=(h, w), mode="bilinear", antialias=True, align_corners=False)
    return t.contiguous()


def image_batch(spec: ModelSpec, batch: int, offset: int = 0) -> torch.Tensor:
    """A batch of real inputs for a fixed-size image model, at its own resolution (cycling the dataset)."""
    card = spec.card
    ds = card.data.test or card.data.train or "photos"
    x, _ = data.dataset(ds).load()
    idx = [(offset + i) % len(x) for i in range(batch)]
    return fit_images(x[idx], spec.input_shape)


def _lam_values(card: ModelCard, n: int) -> torch.Tensor:
    base = card.lam.default if card.lam and card.lam.default is not None else 0.1
    return torch.tensor([base * f for f in (1.0, 0.5, 3.0, 10.0)][:n], dtype=torch.float32)


def cases(spec: ModelSpec, lam_input: bool) -> list[Case]:
    """Batch-1 and batch>1 cases on real data plus a random one; λ/σ inputs at several values."""
    card = spec.card
    gen = torch.Generator().manual_seed(0)
    name = card.input.name
    out: list[Case] = []
    if card.task == "classification":
        lam = card.lam.input if card.lam else "lam"
        for b in (1, 4):
            c = Case(f"real batch {b}", {name: image_batch(spec, b)})
            if lam_input:
                c.inputs[lam] = _lam_values(card, b)
            out.append(c)
        x = torch.rand(2, *spec.input_shape, generator=gen)
        out.append(Case("random batch 2", {name: x, **({lam: torch.tensor([0.2, 0.5])} if lam_input else {})}))
    elif card.task == "denoising":
        sig = card.sigma.input
        scale = card.sigma.scale
        c = spec.input_shape[0]
        cam = torch.from_numpy(data.bundled_image("camera"))[None, None].expand(1, c, -1, -1)
        coins = torch.from_numpy(data.bundled_image("coins"))[None, None].expand(1, c, -1, -1)

        def noisy(img: torch.Tensor, s: float) -> torch.Tensor:
            return img + (s / scale) * torch.randn(img.shape, generator=gen)

        out.append(Case("camera 64×64, σ=25", {name: noisy(cam[..., 200:264, 200:264], 25),
                                                sig: torch.tensor([25 / scale])}))
        out.append(Case("coins 333×300 crops ×2, σ=5/50",
                        {name: torch.cat([noisy(coins[..., :300, :333], 5), noisy(coins[..., :300, 40:373], 50)]),
                         sig: torch.tensor([5 / scale, 50 / scale])}))
        out.append(Case("camera 333×517 (odd), σ=15", {name: noisy(F.interpolate(cam, size=(333, 517),
                                                                                   mode="bilinear"), 15),
                                                        sig: torch.tensor([15 / scale])}))
        side = max(17, card.input.min_size + 1)
        out.append(Case(f"random 3×{side}×{side - 1 if side - 1 >= card.input.min_size else side}",
                        {name: torch.rand(3, c, side, side - 1 if side - 1 >= card.input.min_size else side,
                                          generator=gen),
                         sig: torch.tensor([0.0, 25.5 / scale, 51 / scale])}))
    elif len(spec.input_shape) == 3:  # image-like blocks (photos) or feature maps (patch features on a grid)
        c, h, w = spec.input_shape
        if card.input.colour is not None:
            real = image_batch(spec, 3)
        else:
            real = torch.cat([_tokens(h * w, c, n).transpose(1, 2).reshape(1, c, h, w) for n in data.PHOTOS[:3]])
        out += [Case("real batch 1", {name: real[:1]}), Case("real batch 3", {name: real}),
                Case("random batch 2", {name: torch.rand(2, c, h, w, generator=gen)})]
    else:  # token blocks [tokens, dim]
        n, dim = spec.input_shape
        real = torch.cat([_tokens(n, dim, p) for p in data.PHOTOS[:3]])
        out += [Case("real batch 1", {name: real[:1]}), Case("real batch 3", {name: real}),
                Case("random batch 2, 49 tokens", {name: torch.rand(2, 49, dim, generator=gen)})]
    return out
