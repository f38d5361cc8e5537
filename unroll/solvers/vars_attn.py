"""VARS attention: self-attention as sparse reconstruction of the values over a query dictionary.

VARS (Shi et al., "Visual Attention Emerges from Recurrent Sparse Reconstruction") replaces ``softmax(QKᵀ)V`` by
``D·x``, with ``x`` the sparse code of ``V`` over a dictionary of the queries found by a few ISTA steps. ``D`` is
the positive random-feature map (FAVOR+) of the queries scaled by ``dh**-0.25`` (softmax's temperature), with a
seeded ``Ω`` stored as a buffer; its atoms are L2-normalised over the tokens, which lets the per-atom max logit be
subtracted before ``exp`` (no overflow). The step is ``1/L`` with ``L`` a Gershgorin bound of ``‖D‖₂²`` from plain
reductions (no SVD, no data-dependent control flow), so each iteration decreases the Lasso objective.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from unroll import tasks
from unroll.card import InputCard
from unroll.registry import register_model
from unroll.solvers.shrink import is_textbook, soft_threshold


def gershgorin_lipschitz(gram: Tensor, nonneg: bool = False) -> Tensor:
    """``max_i Σ_j |G_ij| + 1`` over the last two dims of ``gram`` (kept as size-1 dims).

    An upper bound of the largest eigenvalue of the symmetric ``G = DᵀD`` (Gershgorin); the ``+ 1``
    keeps the step strictly below ``1/‖D‖₂²`` and away from zero for an all-zero dictionary.
    ``nonneg=True`` (a non-negative dictionary, so ``G ≥ 0``) skips the ``abs``.
    """
    return (gram if nonneg else gram.abs()).sum(dim=-1, keepdim=True).amax(dim=-2, keepdim=True) + 1.0


def ista_codes(D: Tensor, v: Tensor, lmbd: float | Tensor, n_steps: int, nonneg_dict: bool = False) -> Tensor:
    """Sparse codes ``x`` of ``v`` over ``D``: ``n_steps`` ISTA steps on ``½‖v − Dx‖² + λ‖x‖₁``.

    ``D`` is ``[..., N, m]`` (atoms are columns) and ``v`` is ``[..., N, d]`` (``d`` independent
    right-hand sides); returns ``[..., m, d]``. Starts from ``x₀ = shrink(Dᵀv, λ)`` and uses the step
    ``1/L`` of :func:`gershgorin_lipschitz` (one ``L`` per leading index, e.g. per sample and head).
    ``n_steps`` is a Python int, so the unrolled graph is static. The step size is folded once into
    the Gram matrix and the correlation (``x − G'x + b'``), so each step is one MatMul, two elementwise
    ops and the shrinkage; :func:`~unroll.solvers.shrink.textbook_mode` gives the unfolded form.
    """
    Dt = D.transpose(-1, -2)
    dtv = Dt @ v
    gram = Dt @ D
    inv_l = 1.0 / gershgorin_lipschitz(gram, nonneg=nonneg_dict and not is_textbook())
    theta = lmbd * inv_l
    x = soft_threshold(dtv, lmbd)
    if is_textbook():
        for _ in range(n_steps):
            x = soft_threshold(x - (gram @ x - dtv) * inv_l, theta)
        return x
    gram_s, dtv_s = gram * inv_l, dtv * inv_l
    for _ in range(n_steps):
        x = soft_threshold(x - gram_s @ x + dtv_s, theta)
    return x


def random_feature_atoms(q: Tensor, omega: Tensor) -> Tensor:
    """Positive random-feature atoms ``exp(q·Ω − ‖q‖²/2)``, unit-L2 over the tokens.

    ``q`` is ``[B, h, N, dh]`` (already scaled), ``omega`` is ``[dh, m]`` (shared by all heads) or
    ``[h, dh, m]`` (per head); returns ``[B, h, N, m]``. The per-atom max logit is subtracted before
    ``exp`` and the ``1/√m`` is left out: both are per-column constants that the normalisation
    cancels exactly, and the shift keeps ``exp`` from overflowing (the largest entry becomes 1, so
    the column norm is ≥ 1 and the division is safe).
    """
    logits = q @ omega - 0.5 * (q * q).sum(dim=-1, keepdim=True)
    feats = torch.exp(logits - logits.amax(dim=-2, keepdim=True))
    return feats / feats.norm(dim=-2, keepdim=True).clamp_min(1e-12)


class VARSAttention(nn.Module):
    """Multi-head VARS attention (``mode="d"``: VARS-D, ``mode="sd"``: VARS-SD) on ``[B, N, dim]``.

    ``n_steps`` ISTA iterations after the thresholded initial code ``shrink(Dᵀv, λ)``. Works for any
    batch size and token count N: nothing depends on N except the tensors themselves.

    VARS-SD: a static dictionary over *tokens* cannot be a ``[h, N, ·]`` parameter when N varies, so
    the static atoms live in feature space instead: a learned parameter ``static_omega``
    ``[h, dh, num_static]`` (initialised Gaussian like Ω, but trained) goes through the same
    positive feature map against the queries, ``exp(q·S − ‖q‖²/2)``, and the resulting atoms are
    L2-normalised over tokens and concatenated after the ``m`` dynamic ones.
    """

    def __init__(
        self, dim: int, num_heads: int = 4, num_features: int = 64, n_steps: int = 5, lmbd: float = 0.3,
        mode: str = "d", seed: int = 0, num_static: int | None = None,
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}")
        if mode not in ("d", "sd"):
            raise ValueError(f"mode must be 'd' or 'sd', got {mode!r}")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.num_features, self.n_steps, self.lmbd, self.mode = num_features, n_steps, lmbd, mode
        self.num_static = (num_features if num_static is None else num_static) if mode == "sd" else 0
        self.q = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        gen = torch.Generator().manual_seed(seed)
        self.register_buffer("omega", torch.randn(self.head_dim, num_features, generator=gen))
        if mode == "sd":
            s = torch.randn(num_heads, self.head_dim, self.num_static, generator=gen)
            self.static_omega = nn.Parameter(s)
        # Softmax-attention temperature split over both sides of the kernel: φ(q)·φ(k) ≈ e^{q·k/√dh}.
        self.q_scale = self.head_dim ** -0.25

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, heads={self.num_heads}, m={self.num_features}, "
                f"static={self.num_static}, n_steps={self.n_steps}, lmbd={self.lmbd}, mode={self.mode!r}")

    def _split(self, t: Tensor) -> Tensor:
        # No shape reads: batch and token count stay symbolic when traced.
        return t.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def dictionary(self, x: Tensor) -> Tensor:
        """The unit-norm dictionary ``[B, h, N, m (+ num_static)]`` built from the queries of ``x``."""
        q = self._split(self.q(x)) * self.q_scale
        D = random_feature_atoms(q, self.omega)
        if self.mode == "sd":
            D = torch.cat([D, random_feature_atoms(q, self.static_omega)], dim=-1)
        return D

    def forward(self, x: Tensor) -> Tensor:
        D = self.dictionary(x)
        v = self._split(self.v(x))
        codes = ista_codes(D, v, self.lmbd, self.n_steps, nonneg_dict=True)  # random features are > 0
        out = (D @ codes).transpose(1, 2).flatten(2)
        return self.proj(out)


__all__ = ["VARSAttention", "gershgorin_lipschitz", "ista_codes", "random_feature_atoms"]


_TOKENS = InputCard(name="x", shape=(-1, 64))
_TOKEN_PROFILE = dict(batch=(1, 8, 32), dims={"0": (1, 64, 1024)})


@register_model(
    "vars-d", input_shape=(64, 64), defaults={"dim": 64, "mode": "d"},
    card=dict(task=tasks.BLOCK, output="y", input=_TOKENS, trt_profile=_TOKEN_PROFILE,
              description="VARS-D attention: ISTA sparse reconstruction over random-feature atoms of the queries"))
def vars_d(**kw) -> VARSAttention:
    return VARSAttention(**kw)


@register_model(
    "vars-sd", input_shape=(64, 64), defaults={"dim": 64, "mode": "sd"},
    card=dict(task=tasks.BLOCK, output="y", input=_TOKENS, trt_profile=_TOKEN_PROFILE,
              description="VARS-SD attention: VARS-D plus learned static atoms"))
def vars_sd(**kw) -> VARSAttention:
    return VARSAttention(**kw)
