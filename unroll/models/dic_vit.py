"""Dic-ViT: a CIFAR-10 vision transformer whose every attention is Dic-Attn (elastic-net ISTA over a dictionary).

Source: Y. Liu, X. Liu, H. Yu, X. Tang, X. Wei, "Learning Dictionary for Visual Attention" (Dic-Attn),
NeurIPS 2023. There is no public code. What comes from the paper (its supplement's ViT, as quoted in issue 26):
32×32 RGB input, patch size 4 (an 8×8 grid, 64 patch tokens), embedding dimension 768, depth 7, and a
dictionary-attention block in place of self-attention in every block.

Everything else is a choice, because the paper text available to us does not give it:

* the block's maths is the product's :class:`~unroll.solvers.dic_attn.DicAttention` (elastic-net ISTA with
  ``1/L`` steps over unit-norm atoms, ``W_φ`` / ``w_D`` / output projection) with its own defaults for the
  number of atoms, ISTA steps, β and μ (``num_atoms=128``, ``n_steps=5``, ``beta=mu=0.1``); no heads;
* standard ViT plumbing: a strided-conv patch embedding, a learned position embedding, pre-norm blocks
  (``x + attn(LN(x))``, ``x + MLP(LN(x))``), an MLP of ratio 4 with GELU, a final LayerNorm and a linear head,
  timm-style init (truncated normal, std 0.02, for linear weights and the position embedding);
* **global average pooling instead of a class token.** ``DicAttention`` codes every token on its own (it mixes
  channels/atoms, never tokens), and so does the MLP; a class token would therefore never see the image and the
  logits would not depend on the input. The readout is the mean of the patch tokens.

No committed weights: ``unroll.load("dic-vit", pretrained=False)`` gives the seeded initialisation. Each
block's dictionary is drawn from its own seed (``seed + block index``), so blocks differ.

``DicAttention`` keeps ``L = ‖D‖₂² + μ`` in a buffer computed outside ``forward`` (so the graph stays static):
the model refreshes every block at construction and after every ``load_state_dict`` (a post-hook), and the
checkpoint loader does the same, so a loaded model is ready for evaluation and export.
"""

from __future__ import annotations

from os import PathLike
from typing import Any

import torch
from torch import Tensor, nn

from unroll import tasks
from unroll.checkpoints import load_strict, read_state_dict
from unroll.models.sdnet import _CIFAR_INPUT, CIFAR10_LABELS
from unroll.registry import register_model
from unroll.solvers.dic_attn import DicAttention

#: The supplement's configuration (the rest are the choices listed in the module docstring).
SUPPLEMENT = dict(img_size=32, patch_size=4, dim=768, depth=7)


class Mlp(nn.Module):
    """``fc2(GELU(fc1(x)))``, hidden width ``ratio · dim``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DicBlock(nn.Module):
    """Pre-norm transformer block with Dic-Attn as its attention: ``x + attn(LN(x))``, then ``x + MLP(LN(x))``."""

    def __init__(self, dim: int, mlp_ratio: float = 4.0, num_atoms: int = 128, n_steps: int = 5,
                 beta: float = 0.1, mu: float = 0.1, seed: int = 0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = DicAttention(dim, num_atoms=num_atoms, n_steps=n_steps, beta=beta, mu=mu, seed=seed)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class DicViT(nn.Module):
    """ViT classifier on ``[B, 3, img_size, img_size]`` in [0, 1] → logits ``[B, num_classes]``, Dic-Attn blocks.

    Defaults are the supplement's size (32×32, patch 4, dim 768, depth 7); ``depth``, ``dim``, ``num_atoms``,
    ``n_steps``, ``mlp_ratio`` … shrink it (tests build small ones).
    """

    def __init__(self, num_classes: int = 10, img_size: int = 32, patch_size: int = 4, in_chans: int = 3,
                 dim: int = 768, depth: int = 7, mlp_ratio: float = 4.0, num_atoms: int = 128, n_steps: int = 5,
                 beta: float = 0.1, mu: float = 0.1, seed: int = 0) -> None:
        super().__init__()
        if img_size % patch_size:
            raise ValueError(f"img_size {img_size} is not a multiple of patch_size {patch_size}")
        self.num_classes, self.img_size, self.patch_size, self.dim = num_classes, img_size, patch_size, dim
        self.num_tokens = (img_size // patch_size) ** 2
        self.patch_embed = nn.Conv2d(in_chans, dim, patch_size, stride=patch_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_tokens, dim))
        self.blocks = nn.Sequential(*(DicBlock(dim, mlp_ratio, num_atoms, n_steps, beta, mu, seed=seed + i)
                                      for i in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        self._init_weights()
        self.register_load_state_dict_post_hook(_refresh_after_load)

    @torch.no_grad()
    def _init_weights(self) -> None:
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        refresh_dic(self)

    def tokens(self, x: Tensor) -> Tensor:
        """Patch tokens with position embedding, ``[B, num_tokens, dim]`` (the first block's input)."""
        return self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos_embed

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``[B, num_classes]``: blocks → LayerNorm → mean over tokens → linear head."""
        return self.head(self.norm(self.blocks(self.tokens(x))).mean(dim=1))


def dic_layers(model: nn.Module) -> list[DicAttention]:
    """Every Dic-Attn layer of ``model`` in module order."""
    return [m for m in model.modules() if isinstance(m, DicAttention)]


def refresh_dic(model: nn.Module) -> int:
    """Normalise the atoms and recompute ``L`` of every Dic-Attn layer (after training or loading); returns how many."""
    layers = dic_layers(model)
    for layer in layers:
        layer.refresh()
    return len(layers)


def _refresh_after_load(module: nn.Module, _incompatible_keys: Any) -> None:
    """``load_state_dict`` post-hook: loaded atoms are re-normalised and ``L`` recomputed from them."""
    refresh_dic(module)


def load_checkpoint(model: nn.Module, path: str | PathLike[str]) -> nn.Module:
    """Load a checkpoint into ``model`` strictly and refresh its Dic-Attn layers; returns the model.

    Accepts what :mod:`unroll.checkpoints` reads (a bare state dict, ``{"model": …}`` or ``{"state_dict": …}``,
    with or without DataParallel's ``module.`` prefix). The ``lipschitz`` buffers may be absent: they are
    recomputed from the loaded atoms anyway.
    """
    state = read_state_dict(path)
    expected = model.state_dict()
    state = {**{k: v for k, v in expected.items() if k.endswith(".lipschitz") and k not in state}, **state}
    load_strict(model, state, path)
    refresh_dic(model)  # (DicViT's load hook already did; this covers any other module holding Dic-Attn layers)
    return model


def dic_vit(**kw: Any) -> DicViT:
    """Dic-ViT at the supplement's size unless options say otherwise."""
    return DicViT(**kw)


register_model(
    "dic-vit", input_shape=(3, 32, 32), checkpoint_loader=load_checkpoint,
    card=dict(task=tasks.CLASSIFICATION, output="logits", input=_CIFAR_INPUT, labels=CIFAR10_LABELS,
              data=dict(test="photos"), trt_profile=dict(batch=(1, 8, 32)),
              description="Dic-ViT for CIFAR-10 (Dic-Attn, NeurIPS'23 supplement: 32×32, patch 4, dim 768, depth 7; "
                          "no public code: built from the paper's equations, no weights)"),
)(dic_vit)
