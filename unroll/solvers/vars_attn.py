"""VARS attention (Shi et al., ICML 2022): self-attention as a recurrent sparse reconstruction, in the official form.

The official code (bfshi/VARS, commit 651eb517, ``vars_block.py``: ``VARS_D`` / ``VARS_SD``) computes, per head:

* ``q, v`` from one ``qkv`` projection (``dim → 2·dim``: queries the first half, values the second);
* the dictionary ``D``: the positive random features ``exp(q̂·Ω − ‖q̂‖²/2)`` of the unit-length queries ``q̂`` with a
  per-head Gaussian ``rand_matrix`` Ω ``[heads, dh, m]`` (``m = 2·dh``), each atom L2-normalised over the tokens;
  VARS-SD appends learned static atoms, a token-space parameter ``kernel`` ``[1, heads, N, m]`` normalised the same way;
* ``num_step`` steps of a learned ISTA on ``½‖v − Dx‖² + λ‖x‖₁`` from ``x₀ = shrink(Dᵀv, λ')``:
  ``x ← shrink(x − (K'x − Dᵀv)·ℓ/L, λ'·ℓ/L)`` with ``K' = A·DᵀD·A`` (``A = learned_k``), ``λ' = λ·learned_lam``,
  ``ℓ = learned_L`` and ``L = max row-L1 of DᵀD + 1`` (Gershgorin); the shrinkage is ``sign(v)·GELU(|v| − θ)``
  (``shrink="relu"``: the paper's soft threshold, as in the official code's earlier revision);
* the output ``proj(D·x)``.

Fused form (what export traces; :func:`~unroll.solvers.shrink.textbook_mode` gives the official code's literal
form): the step size is folded once into ``M = I − K'·ℓ/L`` and ``b = Dᵀv·ℓ/L``, so a step is one MatMul, one Add
and the shrinkage; the GELU shrinkage runs on a √2-scaled iterate (``w = v/√2``, ``z = √2·x``) so that
``sign(w)·(|w| − θ/√2)·(1 + erf(|w| − θ/√2))`` needs no ``÷√2`` and no ``×½`` per step (they fold into ``M``
and ``b``). The ``1/√m`` of the features and the query scale cancel in the normalisations and are left out.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unroll import tasks
from unroll.card import InputCard
from unroll.registry import register_model
from unroll.solvers.shrink import is_textbook, soft_threshold

Mode = Literal["d", "sd"]
Shrink = Literal["gelu", "relu"]
_SQRT2 = math.sqrt(2.0)


def gershgorin_lipschitz(gram: Tensor, nonneg: bool = False) -> Tensor:
    """``max_i Σ_j |G_ij| + 1`` over the last two dims of ``gram`` (kept as size-1 dims), as the official ``L``.

    An upper bound of the largest eigenvalue of the symmetric ``G = DᵀD`` (Gershgorin); ``nonneg=True`` (a
    non-negative dictionary, so ``G ≥ 0``) skips the ``abs``.
    """
    return (gram if nonneg else gram.abs()).sum(dim=-1, keepdim=True).amax(dim=-2, keepdim=True) + 1.0


def gelu_shrink(v: Tensor, theta: Tensor | float) -> Tensor:
    """The official VARS shrinkage ``sign(v)·GELU(|v| − θ)``: a smooth, odd soft threshold."""
    return torch.sign(v) * F.gelu(v.abs() - theta)


def _scaled_gelu_shrink(w: Tensor, theta_s: Tensor | float) -> Tensor:
    """``gelu_shrink(√2·w, √2·θ_s) / √2`` with no ``÷√2`` inside the erf (exact algebra)."""
    u = w.abs() - theta_s
    return torch.sign(w) * u * (0.5 + 0.5 * torch.erf(u))


def vars_codes(gram: Tensor, corr: Tensor, lam: Tensor | float, n_steps: int, shrink: Shrink = "gelu",
               learned_k: Tensor | None = None, learned_l: Tensor | float = 1.0, nonneg: bool = False) -> Tensor:
    """The codes ``x`` ``[..., m, d]`` of the official VARS solver, given ``DᵀD`` ``[..., m, m]`` and ``Dᵀv``.

    ``lam`` is the effective threshold ``λ·learned_lam``; ``learned_k``/``learned_l`` are the learned gradient
    matrix and step multiplier (identity and 1: plain ISTA with the Gershgorin step, which with
    ``shrink="relu"`` solves the Lasso). ``nonneg`` marks a non-negative dictionary (no ``abs`` in ``L``).
    ``n_steps`` is a Python int, so the unrolled graph is static.
    """
    L = gershgorin_lipschitz(gram, nonneg=nonneg and not is_textbook())
    K = gram if learned_k is None else learned_k @ gram @ learned_k
    if is_textbook():  # the official att_func, literally
        step = L / learned_l
        sh = gelu_shrink if shrink == "gelu" else soft_threshold
        x = sh(corr, lam)
        for _ in range(n_steps):
            x = x - (K @ x - corr) / step
            x = sh(x, lam / step)
        return x
    inv = learned_l / L  # [..., 1, 1]
    eye = torch.eye(K.shape[-1], dtype=K.dtype, device=K.device)
    if shrink == "relu":
        M, b, theta = eye - K * inv, corr * inv, lam * inv
        x = soft_threshold(corr, lam)
        for _ in range(n_steps):
            x = soft_threshold(M @ x + b, theta)
        return x
    # The iterate is kept as p = x/√2: the shrinkage's input is then w = v/√2 = p − K·p·ℓ/L + Dᵀv·ℓ/(√2·L) and
    # its output x/√2 = ½·sign(w)·u·(1 + erf(u)), u = |w| − θ/√2. The identity stays out of the matrix: folding it
    # in (x·(I − K·ℓ/L)) rounds the step's small correction against 1 and doubles the FP32 error.
    Ks, b, theta = K * inv, corr * (inv / _SQRT2), lam * (inv / _SQRT2)
    p = _scaled_gelu_shrink(corr / _SQRT2, lam / _SQRT2)
    for _ in range(n_steps):
        p = _scaled_gelu_shrink(p - Ks @ p + b, theta)
    return p * _SQRT2


def random_feature_atoms(q: Tensor, rand_matrix: Tensor) -> Tensor:
    """Per-head positive random features of the unit-length queries, unnormalised (official ``to_random_feature``).

    ``q`` ``[B, h, N, dh]``, ``rand_matrix`` ``[h, dh, m]``; returns ``[B, h, N, m]`` without the ``1/√m``
    (a constant per atom, which the normalisation over tokens cancels) unless in textbook mode.
    """
    qn = F.normalize(q, dim=-1)
    feats = torch.exp(qn @ rand_matrix - (qn * qn).sum(dim=-1, keepdim=True) * 0.5)
    return feats / rand_matrix.shape[-1] ** 0.5 if is_textbook() else feats


class VARSAttention(nn.Module):
    """Official VARS-D (``mode="d"``) / VARS-SD (``mode="sd"``) attention on ``[B, N, dim]``, official parameter names.

    ``num_tokens`` (VARS-SD only) is the token count N its static ``kernel`` is learned for; VARS-D takes any N.
    ``use_mask`` declares the official (unused by VARS's forward) ``att_mask`` of the ``-plus`` RVT variants.
    """

    #: Set by :func:`unroll.solvers.residual.forward_with_residual` around one forward: keep ``(v, v − D·codes,
    #: codes)`` (the values, what the sparse reconstruction, computed anyway, leaves of them, and the codes) in
    #: :attr:`solver_residual`.
    keep_residual: bool = False
    solver_residual: tuple[Tensor, Tensor, Tensor] | None = None

    def __init__(self, dim: int, num_heads: int = 8, mode: Mode = "d", num_tokens: int = 196, lam: float = 0.3,
                 num_step: int = 5, rand_feat_dim_ratio: int = 2, qkv_bias: bool = True, shrink: Shrink = "gelu",
                 use_mask: bool = False) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}")
        if mode not in ("d", "sd"):
            raise ValueError(f"mode must be 'd' or 'sd', got {mode!r}")
        if shrink not in ("gelu", "relu"):
            raise ValueError(f"shrink must be 'gelu' (official) or 'relu' (the paper's soft threshold), got {shrink!r}")
        self.dim, self.num_heads, self.head_dim, self.mode = dim, num_heads, dim // num_heads, mode
        self.lam, self.n_steps, self.shrink = lam, num_step, shrink
        m = self.head_dim * rand_feat_dim_ratio
        self.num_features = m
        self.qkv = nn.Linear(dim, dim * 2, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        if use_mask:
            self.att_mask = nn.Parameter(torch.zeros(num_heads, 196, 196))
        self.rand_matrix = nn.Parameter(torch.randn(num_heads, self.head_dim, m), requires_grad=False)
        if mode == "sd":
            self.kernel = nn.Parameter(torch.randn(1, num_heads, num_tokens, m))
        self.L = nn.Parameter(torch.full((num_heads,), 25.0), requires_grad=False)  # official; unused by forward
        atoms = m * (2 if mode == "sd" else 1)
        self.learned_k = nn.Parameter(torch.eye(atoms))
        self.learned_lam = nn.Parameter(torch.ones(1))
        self.learned_L = nn.Parameter(torch.ones(1))

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, heads={self.num_heads}, m={self.num_features}, mode={self.mode!r}, "
                f"num_step={self.n_steps}, lam={self.lam}, shrink={self.shrink!r}")

    def dictionary(self, q: Tensor) -> Tensor:
        """The token-normalised dictionary ``[B, h, N, m (+ m static)]`` from the queries ``[B, h, N, dh]``."""
        D = random_feature_atoms(q * self.head_dim ** -0.25 if is_textbook() else q, self.rand_matrix)
        if self.mode == "sd":
            D = torch.cat([D, self.kernel.expand_as(D)], dim=-1)  # (expand_as: the batch stays symbolic)
        return F.normalize(D, dim=-2)

    def forward(self, x: Tensor) -> Tensor:
        qv = self.qkv(x).unflatten(-1, (2, self.num_heads, self.head_dim)).permute(2, 0, 3, 1, 4)
        q, v = qv[0], qv[1]  # [B, h, N, dh]
        D = self.dictionary(q)
        Dt = D.transpose(-1, -2)
        codes = vars_codes(Dt @ D, Dt @ v, self.lam * self.learned_lam, self.n_steps, self.shrink,
                           self.learned_k, self.learned_L, nonneg=self.mode == "d")  # random features are > 0
        recon = D @ codes
        if self.keep_residual:
            self.solver_residual = (v, v - recon, codes)
        return self.proj(recon.transpose(1, 2).flatten(2))


__all__ = ["VARSAttention", "gelu_shrink", "gershgorin_lipschitz", "random_feature_atoms", "vars_codes"]


def _block_card(mode: Mode) -> dict:
    tokens = -1 if mode == "d" else 196  # VARS-SD's static atoms are learned for a fixed token count (a 14×14 grid)
    return dict(task=tasks.BLOCK, output="y", input=InputCard(name="x", shape=(tokens, 64)),
                trt_profile=dict(batch=(1, 8, 32), dims={"0": (1, 64, 1024)}) if mode == "d" else
                dict(batch=(1, 8, 32)),
                description=f"official VARS-{mode.upper()} attention: 64 wide, 2 heads of RVT's 32, 5 learned ISTA "
                            "steps, GELU shrinkage")


@register_model("vars-d", input_shape=(64, 64), defaults={"dim": 64, "num_heads": 2, "mode": "d"},
                card=_block_card("d"))
def vars_d(**kw) -> VARSAttention:
    return VARSAttention(**kw)


@register_model("vars-sd", input_shape=(196, 64), defaults={"dim": 64, "num_heads": 2, "mode": "sd"},
                card=_block_card("sd"))
def vars_sd(**kw) -> VARSAttention:
    return VARSAttention(**kw)
