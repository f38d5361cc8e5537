"""Hamburger's NMF "ham": global context as a low-rank non-negative matrix factorisation.

Geng et al., "Is Attention Better Than Matrix Decomposition?" (ICLR 2021): the feature map
``X = relu(input)`` ``[B, D, N]`` is approximated by ``bases · coefᵀ`` (``[B, D, R] · [B, R, N]``)
found by a fixed number of Lee–Seung multiplicative updates, and the reconstruction is the output.
Multiplicative updates keep every factor non-negative and never increase ``‖X − bases·coefᵀ‖_F``
(up to the ``1e-6`` guard in the denominators), with no step size to choose.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unroll import tasks
from unroll.card import InputCard
from unroll.registry import register_model

EPS = 1e-6  # the official denominator guard


def nmf_coef_step(X: Tensor, bases: Tensor, coef: Tensor) -> Tensor:
    """One multiplicative coef update ``C ← C ⊙ (XᵀD) / (C·DᵀD + ε)``.

    ``X`` ``[B, D, N]``, ``bases`` ``[B, D, R]`` (or ``[D, R]``, broadcast), ``coef`` ``[B, N, R]``;
    returns the new coef.
    """
    numerator = X.transpose(-1, -2) @ bases
    denominator = coef @ (bases.transpose(-1, -2) @ bases)
    return coef * numerator / (denominator + EPS)


def nmf_bases_step(X: Tensor, bases: Tensor, coef: Tensor) -> Tensor:
    """One multiplicative bases update ``D ← D ⊙ (X·C) / (D·CᵀC + ε)``; returns the new bases."""
    numerator = X @ coef
    denominator = bases @ (coef.transpose(-1, -2) @ coef)
    return bases * numerator / (denominator + EPS)


def nmf_updates(X: Tensor, bases: Tensor, coef: Tensor, n_steps: int) -> tuple[Tensor, Tensor]:
    """``n_steps`` alternating updates (coef, then bases), as Hamburger's ``local_step``.

    Returns ``(bases, coef)``. ``n_steps`` is a Python int, so the unrolled graph is static.
    """
    for _ in range(n_steps):
        coef = nmf_coef_step(X, bases, coef)
        bases = nmf_bases_step(X, bases, coef)
    return bases, coef


class NMFHam(nn.Module):
    """NMF matrix-decomposition "ham" on ``[B, C, H, W]`` (or ``[B, D, N]``), same shape out.

    ``X = relu(input)`` reshaped to ``[B, D, N]``; ``coef₀ = softmax(Xᵀ·bases, dim=-1)`` (the NMF
    variant's ``inv_t = 1``); ``train_steps`` updates in training mode, ``eval_steps`` in eval mode
    (the official 6 / 7); then one more coef update; output ``bases · coefᵀ``.

    Deviation from the official code, for serving: Hamburger draws fresh uniform random bases at
    every call, which makes the output random. Here the bases are drawn once, uniform in [0, 1) from
    a generator seeded with ``seed``, L2-normalised over D, stored as the buffer ``bases`` ``[D, R]``
    and expanded over the batch, so the layer is deterministic and exports as a constant.

    ``one_step_grad`` (default, as the official code) runs the first ``K`` updates without autograd
    so gradients flow only through the final coef update; it changes nothing in the forward values.
    """

    def __init__(
        self, dim: int, rank: int = 64, train_steps: int = 6, eval_steps: int = 7, seed: int = 0,
        one_step_grad: bool = True,
    ) -> None:
        super().__init__()
        self.dim, self.rank = dim, rank
        self.train_steps, self.eval_steps, self.one_step_grad = train_steps, eval_steps, one_step_grad
        gen = torch.Generator().manual_seed(seed)
        bases = F.normalize(torch.rand(dim, rank, generator=gen), dim=0)
        self.register_buffer("bases", bases)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, rank={self.rank}, train_steps={self.train_steps}, "
                f"eval_steps={self.eval_steps}")

    @property
    def n_steps(self) -> int:
        """Updates used in the current mode (``train_steps`` when training, else ``eval_steps``)."""
        return self.train_steps if self.training else self.eval_steps

    def forward(self, x: Tensor) -> Tensor:
        X = torch.relu(x.flatten(2))  # [B, D, N]
        bases = self.bases  # [D, R]: broadcasts over the batch (becomes [B, D, R] after one update)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.one_step_grad):
            coef = torch.softmax(X.transpose(-1, -2) @ bases, dim=-1)
            bases, coef = nmf_updates(X, bases, coef, self.n_steps)
        coef = nmf_coef_step(X, bases, coef)
        return (bases @ coef.transpose(-1, -2)).reshape(x.shape)


__all__ = ["NMFHam", "nmf_bases_step", "nmf_coef_step", "nmf_updates"]


@register_model(
    "nmf-ham", input_shape=(64, 16, 16), defaults={"dim": 64},
    card=dict(task=tasks.BLOCK, output="y", input=InputCard(name="x", shape=(64, 16, 16)),
              description="Hamburger's NMF ham: multiplicative updates, rank 64, seeded constant bases"))
def nmf_ham(**kw) -> NMFHam:
    return NMFHam(**kw)
