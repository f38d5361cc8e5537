"""Convolutional sparse coding layer solved by FISTA: SDNet's ``DictBlock``, reproduced exactly.

Solves ``min_c λ‖c‖₁ + ½‖x − D⊛c‖²`` with ``c ≥ 0``: ``D`` is applied by ``conv_transpose2d`` and
``Dᵀ`` by ``conv2d`` with the same weight (atoms unit-L2 over ``(C, k, k)``). The step size
``0.9 / L`` (``L`` = largest eigenvalue of ``DᵀD``) is found by power iteration *outside*
``forward`` and kept in the buffer ``step_size`` so the traced graph is static.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unroll import tasks
from unroll.card import InputCard
from unroll.registry import register_model
from unroll.solvers.shrink import is_textbook, soft_threshold_nonneg


def fista_momenta(n_steps: int) -> list[float]:
    """FISTA extrapolation weights ``(t_{k-1} − 1)/t_k`` for steps 2..n (``t_1 = 1``): constants.

    Step 2 gets 0 (plain ISTA from the first iterate), step 3 gets ≈0.2818, and so on.
    """
    t, out = 1.0, []
    for _ in range(n_steps - 1):
        t_next = (1.0 + math.sqrt(1.0 + 4.0 * t * t)) / 2.0
        out.append((t - 1.0) / t_next)
        t = t_next
    return out


@torch.no_grad()
def power_iteration(
    weight: Tensor, in_shape: tuple[int, int, int], stride: int, padding: int,
    max_iters: int = 50, tol: float = 1e-5, seed: int = 0,
) -> float:
    """Largest eigenvalue of ``DᵀD`` for a conv dictionary, by power iteration on a probe image."""
    gen = torch.Generator().manual_seed(seed)
    c, h, w = in_shape
    x = torch.randn(1, c, h, w, generator=gen, dtype=weight.dtype).to(weight.device)
    op = output_padding(stride)
    x = x / x.norm()
    eig = 0.0
    for _ in range(max_iters):
        code = F.conv2d(x, weight, stride=stride, padding=padding)
        y = F.conv_transpose2d(code, weight, stride=stride, padding=padding, output_padding=op)
        new_eig = float((y * x).sum())
        x = y / y.norm()
        if abs(new_eig - eig) <= tol * max(abs(new_eig), 1e-12):
            eig = new_eig
            break
        eig = new_eig
    return eig


def output_padding(stride: int) -> int:
    return stride - 1 if stride > 1 else 0


def normalize_atoms(weight: Tensor) -> Tensor:
    """Unit L2 norm per atom over ``(C, k, k)``."""
    return weight / weight.flatten(1).norm(dim=1).clamp_min(1e-12).view(-1, 1, 1, 1)


class DictBlock(nn.Module):
    """Non-negative convolutional sparse coding by ``n_steps`` FISTA iterations (SDNet).

    ``weight`` has shape ``[num_atoms, in_channels, k, k]`` (the official layout) and is normalised
    on the fly while training; call :meth:`refresh` after loading or training to store the
    normalised weight and recompute ``step_size`` by power iteration.
    """

    #: Set by :func:`unroll.solvers.residual.forward_with_residual` around one forward: keep ``(x, x − D⊛c)``, the
    #: residual its last step computed anyway, in :attr:`solver_residual`, so the score costs no reconstruction of
    #: its own. Off otherwise: a forward then holds no extra activation.
    keep_residual: bool = False
    solver_residual: tuple[Tensor, Tensor] | None = None

    def __init__(
        self, in_channels: int, num_atoms: int, kernel_size: int = 3, stride: int = 1,
        padding: int = 1, lmbd: float = 0.1, n_steps: int = 2, probe_size: int = 32,
    ) -> None:
        super().__init__()
        self.in_channels, self.num_atoms = in_channels, num_atoms
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
        self.lmbd, self.n_steps, self.probe_size = lmbd, n_steps, probe_size
        w = torch.randn(num_atoms, in_channels, kernel_size, kernel_size)
        self.weight = nn.Parameter(normalize_atoms(w))
        self.register_buffer("step_size", torch.tensor(0.1))
        self.refresh()

    def extra_repr(self) -> str:
        return (f"{self.in_channels}->{self.num_atoms}, k={self.kernel_size}, stride={self.stride}, "
                f"lmbd={self.lmbd}, n_steps={self.n_steps}")

    @torch.no_grad()
    def refresh(self) -> float:
        """Normalise the atoms in place and recompute the FISTA step size (outside ``forward``)."""
        self.weight.copy_(normalize_atoms(self.weight))
        size = max(self.probe_size, 2 * self.kernel_size)
        eig = power_iteration(self.weight, (self.in_channels, size, size), self.stride, self.padding)
        self.step_size.fill_(0.9 / eig)
        return 0.9 / eig

    def _weight(self) -> Tensor:
        # While training, gradients flow through the normalisation (as SDNet does); in eval the
        # stored weight is already unit-norm, so the graph needs no normalisation ops.
        return normalize_atoms(self.weight) if self.training else self.weight

    def forward(self, x: Tensor, lmbd: Tensor | None = None) -> Tensor:
        """Sparse code of ``x``; ``lmbd`` ``[B]`` overrides λ per sample (SDNet's test-time λ).

        Written in the fused form the export relies on: the step size is folded into the analysis
        weight (``t·Dᵀ`` is one constant), a baked threshold ``λ·t`` rides in the convolution's bias, so
        each step is ``relu(a + conv(x − convᵀ(c)))``: two convolutions and two or three elementwise ops.
        """
        if is_textbook():
            return self._forward_textbook(x, lmbd)
        w, t = self._weight(), self.step_size
        s, p, op = self.stride, self.padding, output_padding(self.stride)
        wt = w * t
        if lmbd is None:
            bias, theta = (-self.lmbd * t).expand(self.num_atoms), None
        else:
            bias, theta = None, lmbd.reshape(-1, 1, 1, 1) * t

        def analysis(v: Tensor) -> Tensor:
            out = F.conv2d(v, wt, bias=bias, stride=s, padding=p)
            return out if theta is None else out - theta

        c = torch.relu(analysis(x))
        c_prev, residual = c, None
        for beta in fista_momenta(self.n_steps):
            # As in the official SDNet code, the gradient is taken at the current iterate c and added to
            # the extrapolated point; beta is a Python constant per step (a literal in the graph).
            a = c if beta == 0.0 else c + beta * (c - c_prev)
            residual = x - F.conv_transpose2d(c, w, stride=s, padding=p, output_padding=op)
            c_prev, c = c, torch.relu(a + analysis(residual))
        self._keep(x, residual)
        return c

    def _keep(self, x: Tensor, residual: Tensor | None) -> None:
        """Keep the last step's residual when :attr:`keep_residual` asks (none without a step)."""
        if self.keep_residual and residual is not None:
            self.solver_residual = (x, residual)

    def _forward_textbook(self, x: Tensor, lmbd: Tensor | None) -> Tensor:
        """The same iteration as the paper writes it (reference for the naive export)."""
        w, t = self._weight(), self.step_size
        s, p, op = self.stride, self.padding, output_padding(self.stride)
        lam = self.lmbd if lmbd is None else lmbd.reshape(-1, 1, 1, 1)
        theta = lam * t
        dtx = F.conv2d(x, w, stride=s, padding=p)
        c = soft_threshold_nonneg(t * dtx, theta)
        c_prev = c
        residual = None
        for beta in fista_momenta(self.n_steps):
            a = c if beta == 0.0 else c + beta * (c - c_prev)
            dc = F.conv_transpose2d(c, w, stride=s, padding=p, output_padding=op)
            dtdc = F.conv2d(dc, w, stride=s, padding=p)
            c_prev, c = c, soft_threshold_nonneg(a + t * (dtx - dtdc), theta)
            residual = x - dc if self.keep_residual else None
        self._keep(x, residual)
        return c


@register_model(
    "csc-fista", input_shape=(3, 32, 32), defaults={"in_channels": 3, "num_atoms": 64},
    card=dict(task=tasks.BLOCK, output="y", data=dict(test="photos"),
              description="SDNet's CSC layer alone: non-negative conv sparse coding, FISTA (3→64 atoms, K=2)",
              input=InputCard(name="x", shape=(3, 32, 32), colour="rgb", resize="stretch")))
def csc_fista(**kw) -> DictBlock:
    return DictBlock(**kw)
