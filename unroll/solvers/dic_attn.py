"""Dic-Attn: attention output as the sparse reconstruction of the tokens over a learned dictionary.

Each token ``x`` ``[dim]`` is coded over a learned dictionary ``D`` ``[dim, num_atoms]`` of unit-norm
atoms by the elastic net ``φ = argmin ½‖x − Dφ‖² + β‖φ‖₁ + (μ/2)‖φ‖²`` (the ``μ`` term makes the
problem strongly convex, so the code is unique and stable even with an overcomplete ``D``), solved
by ``n_steps`` ISTA steps of size ``1/L``, ``L = ‖D‖₂² + μ``. The code is then mixed by a learned
``W_φ`` (init identity), re-weighted per atom by a learned ``w_D`` (init ones) and decoded:
``out = proj(D · diag(w_D) · W_φ · φ)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unroll import tasks
from unroll.card import InputCard
from unroll.registry import register_model
from unroll.solvers.shrink import is_textbook, soft_threshold


def elastic_net_codes(
    D: Tensor, x: Tensor, beta: float | Tensor, mu: float | Tensor, n_steps: int, L: float | Tensor,
) -> Tensor:
    """Codes ``φ`` ``[..., k]`` of the vectors ``x`` ``[..., d]`` over ``D`` ``[d, k]`` by ISTA.

    ``n_steps`` steps of ``φ ← shrink(φ − (Dᵀ(Dφ − x) + μφ)/L, β/L)`` from ``φ = 0`` (so the first step
    is ``shrink(Dᵀx/L, β/L)``) on ``½‖x − Dφ‖² + β‖φ‖₁ + (μ/2)‖φ‖²``; ``L`` must be ≥ ``‖D‖₂² + μ``
    for the objective to decrease monotonically. Row-vector layout: ``Dφ`` is ``φ @ Dᵀ``.

    Fused form: with constant ``D`` and ``L`` the step is affine in ``φ``, ``φ ← shrink(φ·M + b)`` with
    ``M = I(1 − μ/L) − DᵀD/L`` (one constant matrix) and ``b = Dᵀx/L`` computed once, so each step is a
    MatMul, an Add and the shrinkage (a ``Clip`` for a scalar threshold).
    """
    xd = x @ D  # Dᵀx for every token
    if n_steps <= 0:
        return torch.zeros_like(xd)
    gram = D.transpose(-1, -2) @ D
    inv_l = 1.0 / L
    theta = beta * inv_l
    if is_textbook():
        phi = soft_threshold(xd * inv_l, theta)
        for _ in range(n_steps - 1):
            phi = soft_threshold(phi - (phi @ gram - xd + mu * phi) * inv_l, theta)
        return phi
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    step = eye * (1.0 - mu * inv_l) - gram * inv_l
    b = xd * inv_l
    phi = soft_threshold(b, theta)
    for _ in range(n_steps - 1):
        phi = soft_threshold(phi @ step + b, theta)
    return phi


def normalize_columns(D: Tensor) -> Tensor:
    """Unit L2 norm per atom (column)."""
    return F.normalize(D, dim=0, eps=1e-12)


class DicAttention(nn.Module):
    """Dic-Attn on tokens ``[B, N, dim]`` → ``[B, N, dim]`` with ``n_steps`` elastic-net ISTA steps.

    ``w_D`` placement: it scales the atoms *in the reconstruction only* (equivalently the mixed
    code), i.e. ``D·diag(w_D)`` decodes ``W_φ φ``; the coding step uses the unit-norm atoms, so the
    sparse problem and its step size ``1/L`` do not depend on the learned re-weighting.

    ``L`` lives in the buffer ``lipschitz`` and is computed outside ``forward`` by :meth:`refresh`
    (which also normalises the atoms in place); call it after training or loading weights. In
    training mode the atoms are normalised and ``L`` is computed on the fly (``L`` detached: the
    step size is not learned), so training never sees a stale ``L``.
    """

    def __init__(
        self, dim: int, num_atoms: int = 128, n_steps: int = 5, beta: float = 0.1, mu: float = 0.1,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.dim, self.num_atoms, self.n_steps, self.beta, self.mu = dim, num_atoms, n_steps, beta, mu
        gen = torch.Generator().manual_seed(seed)
        self.dictionary = nn.Parameter(normalize_columns(torch.randn(dim, num_atoms, generator=gen)))
        self.w_d = nn.Parameter(torch.ones(num_atoms))
        self.w_phi = nn.Parameter(torch.eye(num_atoms))
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("lipschitz", torch.tensor(1.0))
        self.refresh()

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_atoms={self.num_atoms}, n_steps={self.n_steps}, "
                f"beta={self.beta}, mu={self.mu}")

    def _lipschitz(self, D: Tensor) -> Tensor:
        return torch.linalg.matrix_norm(D.detach(), ord=2) ** 2 + self.mu

    @torch.no_grad()
    def refresh(self) -> float:
        """Normalise the atoms in place and store ``L = ‖D‖₂² + μ`` (outside ``forward``)."""
        self.dictionary.copy_(normalize_columns(self.dictionary))
        self.lipschitz.copy_(self._lipschitz(self.dictionary))
        return float(self.lipschitz)

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            D = normalize_columns(self.dictionary)
            L = self._lipschitz(D)
        else:  # refresh() already normalised the atoms and stored L: no normalisation/SVD in the graph
            D, L = self.dictionary, self.lipschitz
        phi = elastic_net_codes(D, x, self.beta, self.mu, self.n_steps, L)
        mixed = (phi @ self.w_phi.transpose(0, 1)) * self.w_d  # diag(w_D) · W_φ · φ, row layout
        return self.proj(mixed @ D.transpose(0, 1))


__all__ = ["DicAttention", "elastic_net_codes", "normalize_columns"]


@register_model(
    "dic-attn", input_shape=(64, 64), defaults={"dim": 64},
    card=dict(task=tasks.BLOCK, output="y", input=InputCard(name="x", shape=(-1, 64)),
              trt_profile=dict(batch=(1, 8, 32), dims={"0": (1, 64, 1024)}),
              description="Dic-Attn: elastic-net (ISTA) sparse reconstruction over a learned unit-norm dictionary"))
def dic_attn(**kw) -> DicAttention:
    return DicAttention(**kw)
