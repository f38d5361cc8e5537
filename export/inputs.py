"""Real example inputs for every registered model: the export traces with them and verifies on them.

What the inputs look like comes from the model card alone: classifiers get samples of the card's test
(else training) dataset at their input size, denoisers noisy crops of bundled images at several sizes
and σ, image-like blocks bundled photos, token blocks 8×8 patches of bundled photos as tokens, feature
maps the same patches laid out on a grid. A random input per model is added as well.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from unroll import data, tasks
from unroll.card import ModelCard
from unroll.data import fit_images, photo_features
from unroll.registry import ModelSpec


@dataclass
class Case:
    label: str
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


def image_batch(spec: ModelSpec, batch: int, offset: int = 0) -> torch.Tensor:
    """A batch of real inputs for a fixed-size image model, at its own resolution (cycling the dataset)."""
    return _image_batch(spec.card, spec.input_shape, batch, offset)


def _image_batch(card: ModelCard, shape: tuple[int, ...], batch: int, offset: int = 0) -> torch.Tensor:
    ds = data.dataset(card.data.test or card.data.train or "photos")
    if ds.kind == "images":  # {name: grayscale [H, W]} of various sizes: each fitted on its own
        imgs = list(ds.load().values())
        return torch.cat([fit_images(imgs[(offset + i) % len(imgs)][None, None], shape) for i in range(batch)])
    x, _ = ds.load()
    idx = [(offset + i) % len(x) for i in range(batch)]
    return fit_images(x[idx], shape)


def trace_shape(card: ModelCard) -> tuple[int, ...]:
    """A concrete per-sample shape for the card's input: each dynamic (-1) axis at ``max(min_size, 32)``."""
    return tuple(d if d > 0 else max(card.input.min_size, 32) for d in card.input.shape)


def _lam_values(card: ModelCard, n: int) -> torch.Tensor:
    base = card.lam.default if card.lam and card.lam.default is not None else 0.1
    return torch.tensor([base * f for f in (1.0, 0.5, 3.0, 10.0)][:n], dtype=torch.float32)


def cases(spec: ModelSpec | ModelCard, lam_input: bool, input_shape: tuple[int, ...] | None = None) -> list[Case]:
    """Batch-1 and batch>1 cases on real data plus a random one; λ/σ inputs at several values.

    ``spec`` is a registered model's spec (traced at its ``input_shape``) or just a card (a user's own
    module): then ``input_shape`` is the concrete sample shape, by default :func:`trace_shape`. A
    classifier or image block with dynamic H×W also gets a random case at a second size.
    """
    if isinstance(spec, ModelCard):
        card, shape = spec, tuple(input_shape or trace_shape(spec))
    else:
        card, shape = spec.card, tuple(input_shape or spec.input_shape)
    out = _cases(card, shape, lam_input)
    dynamic_hw = len(card.input.shape) == 3 and min(card.input.shape[1:]) < 0
    task = tasks.get(card.task)
    if isinstance(spec, ModelCard) and dynamic_hw and task.second_size_case:
        gen = torch.Generator().manual_seed(1)
        c, h, w = shape
        other = {card.input.name: torch.rand(2, c, h + 16, w + 8, generator=gen)}
        if task.logits and lam_input and card.lam is not None:
            other[card.lam.input] = _lam_values(card, 2)
        out.append(Case(f"random batch 2 at {h + 16}×{w + 8} (dynamic H×W)", other))
    return out


def _cases(card: ModelCard, input_shape: tuple[int, ...], lam_input: bool) -> list[Case]:
    gen = torch.Generator().manual_seed(0)
    name = card.input.name
    out: list[Case] = []
    kind = tasks.get(card.task).data
    if kind == "labelled":
        lam = card.lam.input if card.lam else "lam"
        for b in (1, 4):
            c = Case(f"real batch {b}", {name: _image_batch(card, input_shape, b)})
            if lam_input:
                c.inputs[lam] = _lam_values(card, b)
            out.append(c)
        x = torch.rand(2, *input_shape, generator=gen)
        out.append(Case("random batch 2", {name: x, **({lam: torch.tensor([0.2, 0.5])} if lam_input else {})}))
    elif kind == "noisy":
        sig = card.sigma.input
        scale = card.sigma.scale
        c = input_shape[0]
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
    elif len(input_shape) == 3:  # image-like blocks (photos) or feature maps (patch features on a grid)
        c, h, w = input_shape
        if card.input.colour is not None:
            real = _image_batch(card, input_shape, 3)
        else:
            real = photo_features(input_shape)
        out += [Case("real batch 1", {name: real[:1]}), Case("real batch 3", {name: real}),
                Case("random batch 2", {name: torch.rand(2, c, h, w, generator=gen)})]
    else:  # token blocks [tokens, dim]
        n, dim = input_shape
        m = 49 if card.input.shape[0] < 0 else n  # a second token count when the card's is dynamic
        real = photo_features(input_shape)
        out += [Case("real batch 1", {name: real[:1]}), Case("real batch 3", {name: real}),
                Case(f"random batch 2, {m} tokens", {name: torch.rand(2, m, dim, generator=gen)})]
    return out
