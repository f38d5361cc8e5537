"""Hamburger's NMF "ham": global context as a low-rank non-negative matrix factorisation.

Geng et al., "Is Attention Better Than Matrix Decomposition?" (ICLR 2021): the feature map
``X = relu(input)`` ``[B, D, N]`` is approximated by ``bases · coefᵀ`` (``[B, D, R] · [B, R, N]``)
found by a fixed number of Lee–Seung multiplicative updates, and the reconstruction is the output.
Multiplicative updates keep every factor non-negative and never increase ``‖X − bases·coefᵀ‖_F``
(up to the ``1e-6`` guard in the denominators), with no step size to choose.

Where the updates start (the bases policy, :data:`BASES_POLICIES`) is the one place where serving and the
official code (Enjoy-Hamburger ``NMF2D``, ``RAND_INIT=True``) can differ: the official module draws fresh
uniform bases for every sample at every call, so its output is random. The policies:

- ``seeded`` — one draw ``[D, R]`` from a generator seeded with ``seed``, stored as the buffer ``bases``
  and shared by every sample: deterministic, batch-independent, exported as a constant.
- ``given`` — the bases passed to the constructor (``[D, R]``, or ``[B, D, R]`` for a fixed batch), e.g. the
  bases an official forward drew, for parity; exported as a constant.
- ``per-sample`` — sample ``b`` of a batch starts from row ``b`` of a ``[B, D, R]`` draw from a generator
  seeded with ``seed``: the official forward's draw after ``torch.manual_seed(seed)`` (CPU), reproduced without
  touching the global RNG. It depends on the sample's position in the batch, so it is not exported.
- ``official-random`` — a fresh draw per sample at every call from the global RNG (or ``generator``), the
  official distribution exactly; not exportable (a graph cannot hold a fresh draw).

``unroll bench ham-draws`` (``benchmarks/ham_draws.py``) measures how far each deterministic policy is from the
official draws' mean, next to how far one official draw is from it; :data:`DEFAULT_BASES` is its choice.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unroll import tasks
from unroll.card import InputCard
from unroll.errors import ExportError
from unroll.registry import register_model

EPS = 1e-6  # the official denominator guard
#: The official moving-average rate of the ``RAND_INIT=False`` bases (``ETA``), used by :func:`online_update`.
ETA = 0.9

BasesPolicy = Literal["seeded", "given", "per-sample", "official-random"]
BASES_POLICIES: tuple[str, ...] = ("seeded", "given", "per-sample", "official-random")
#: Policies whose starting bases are constants a static graph can hold (the others draw at call time).
EXPORTABLE_POLICIES: tuple[str, ...] = ("seeded", "given")
#: The serving default: chosen by ``unroll bench ham-draws`` (benchmarks/results/ham_draws.md; a test keeps the
#: two equal).
DEFAULT_BASES: BasesPolicy = "seeded"


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


def draw_bases(batch: int, dim: int, rank: int, generator: torch.Generator | None = None) -> Tensor:
    """``batch`` starting bases ``[batch, dim, rank]`` as the official ``NMF2D`` draws them (``RAND_INIT=True``).

    Uniform in [0, 1) on the CPU, L2-normalised over ``dim``; from ``generator``, or the global RNG when ``None``
    (then the numbers are the official forward's own under the same ``torch.manual_seed``).
    """
    return F.normalize(torch.rand((batch, dim, rank), generator=generator), dim=1)


def online_update(bases: Tensor, final_bases: Tensor, eta: float = ETA) -> Tensor:
    """The official ``RAND_INIT=False`` warm start: ``bases ← normalise(bases + η·(mean_b final_b − bases))``.

    ``bases`` ``[D, R]`` (the stored start), ``final_bases`` ``[B, D, R]`` (a call's bases after its updates);
    the official eval-mode forward applies this after every call. Returns the new ``[D, R]``.
    """
    update = final_bases.reshape(-1, *bases.shape).mean(dim=0)
    return F.normalize(bases + eta * (update - bases), dim=0)


def _exporting() -> bool:
    return bool(torch.jit.is_tracing() or torch.onnx.is_in_onnx_export() or torch.compiler.is_exporting())


class NMFHam(nn.Module):
    """NMF matrix-decomposition "ham" on ``[B, C, H, W]`` (or ``[B, D, N]``), same shape out.

    ``X = relu(input)`` reshaped to ``[B, D, N]``; ``coef₀ = softmax(Xᵀ·bases₀, dim=-1)`` (the NMF
    variant's ``inv_t = 1``); ``train_steps`` updates in training mode, ``eval_steps`` in eval mode
    (the official 6 / 7); then one more coef update; output ``bases · coefᵀ``. Given the same ``bases₀`` this
    is the official ``NMF2D`` (``SPATIAL=True``, ``MD_S=1``) to the last bit.

    ``bases`` picks where ``bases₀`` comes from (the module docstring, :data:`BASES_POLICIES`); ``given`` is
    the tensor for ``bases="given"``. Whatever the policy, the buffer ``bases`` holds the constant start
    (``seeded``: the seeded draw; ``given``: the given tensor), and ``forward(x, bases=T)`` starts from ``T``
    instead (``[D, R]`` or ``[B, D, R]``). ``persistent=False`` keeps the buffer out of the state dict, as the
    official module (which has no state) needs for strict loading of its checkpoints.

    ``one_step_grad`` (default, as the official code) runs the first ``K`` updates without autograd
    so gradients flow only through the final coef update; it changes nothing in the forward values.
    """

    def __init__(
        self, dim: int, rank: int = 64, train_steps: int = 6, eval_steps: int = 7, seed: int = 0,
        one_step_grad: bool = True, bases: BasesPolicy = DEFAULT_BASES, given: Tensor | None = None,
        persistent: bool = True, generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        if bases not in BASES_POLICIES:
            raise ValueError(f"bases={bases!r}: choose one of {', '.join(BASES_POLICIES)}")
        if (given is not None) != (bases == "given"):
            raise ValueError("bases='given' needs given=TENSOR ([D, R] or [B, D, R]), and given= needs bases='given'")
        self.dim, self.rank, self.seed, self.policy = dim, rank, seed, bases
        self.train_steps, self.eval_steps, self.one_step_grad = train_steps, eval_steps, one_step_grad
        #: ``official-random`` only: the generator its draws come from (``None``: the global RNG, as the official).
        self.generator = generator
        if given is not None:
            start = self._checked(given.detach().clone())
        else:
            start = draw_bases(1, dim, rank, torch.Generator().manual_seed(seed))[0]
        self.register_buffer("bases", start, persistent=persistent)

    def _checked(self, bases: Tensor, batch: int | None = None) -> Tensor:
        if _exporting():  # shapes are traced values then (a Python check would freeze them); checked when built
            return bases
        ok = bases.dim() in (2, 3) and tuple(bases.shape[-2:]) == (self.dim, self.rank)
        if ok and batch is not None and bases.dim() == 3:
            ok = bases.shape[0] in (1, batch)
        if not ok:
            raise ValueError(f"NMF bases of shape {list(bases.shape)} do not fit: expected [{self.dim}, {self.rank}] "
                             f"or [B, {self.dim}, {self.rank}]" + (f" with B = {batch}" if batch is not None else ""))
        return bases

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, rank={self.rank}, train_steps={self.train_steps}, "
                f"eval_steps={self.eval_steps}, bases={self.policy!r}")

    @property
    def n_steps(self) -> int:
        """Updates used in the current mode (``train_steps`` when training, else ``eval_steps``)."""
        return self.train_steps if self.training else self.eval_steps

    def initial_bases(self, batch: int) -> Tensor:
        """``bases₀`` for a batch of ``batch`` samples under this module's policy (``[D, R]`` or ``[B, D, R]``).

        Raises :class:`ExportError` while tracing a policy that draws at call time: a graph would freeze one
        draw and pass it off as the policy.
        """
        if self.policy in EXPORTABLE_POLICIES:
            return self._checked(self.bases, batch)
        if _exporting():
            raise ExportError(f"NMF bases policy {self.policy!r} draws new bases at call time and cannot be exported "
                              f"as a static graph; export with bases='seeded' (the default) or bases='given'")
        gen = self.generator if self.policy == "official-random" else torch.Generator().manual_seed(self.seed)
        return draw_bases(batch, self.dim, self.rank, gen).to(self.bases)

    def decompose(self, x: Tensor, bases: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The factorisation ``(bases, coef)`` of ``relu(x)``: ``[B, D, R]`` and ``[B, N, R]`` (the official
        ``local_inference`` then ``compute_coef``), starting from ``bases`` or the policy's ``bases₀``."""
        X = torch.relu(x.flatten(2))  # [B, D, N]
        start = self.initial_bases(X.shape[0]) if bases is None else self._checked(bases.to(X), X.shape[0])
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.one_step_grad):
            coef = torch.softmax(X.transpose(-1, -2) @ start, dim=-1)
            final, coef = nmf_updates(X, start, coef, self.n_steps)
        coef = nmf_coef_step(X, final, coef)
        return final, coef

    #: Set by :func:`unroll.solvers.residual.forward_with_residual` around one forward: keep ``(X, X − bases·coefᵀ,
    #: coef)`` (the factorised ``relu(x)``, what the factors leave of it, the coefficients) in
    #: :attr:`solver_residual`, so the residual needs no second factorisation.
    keep_residual: bool = False
    solver_residual: tuple[Tensor, Tensor, Tensor] | None = None

    def forward(self, x: Tensor, bases: Tensor | None = None) -> Tensor:
        final, coef = self.decompose(x, bases)
        recon = final @ coef.transpose(-1, -2)
        if self.keep_residual:
            X = torch.relu(x.flatten(2))
            self.solver_residual = (X, X - recon, coef)
        return recon.reshape(x.shape)

    @torch.no_grad()
    def warm_up(self, batches: list[Tensor], eta: float = ETA) -> Tensor:
        """Run the official ``RAND_INIT=False`` eval sequence over ``batches``: each call starts from the stored
        bases, then :func:`online_update` moves them towards the call's final bases. Updates the buffer (so
        ``seeded``/``given`` then start from the warm bases) and returns it; the batches' outputs are dropped."""
        if self.bases.dim() != 2:
            raise ValueError("warm_up needs [D, R] stored bases (not a per-batch [B, D, R] tensor)")
        for x in batches:
            final, _ = self.decompose(x, self.bases)
            self.bases.copy_(online_update(self.bases, final, eta))
        return self.bases


__all__ = ["BASES_POLICIES", "DEFAULT_BASES", "EXPORTABLE_POLICIES", "NMFHam", "draw_bases", "nmf_bases_step",
           "nmf_coef_step", "nmf_updates", "online_update"]


@register_model(
    "nmf-ham", input_shape=(64, 16, 16), defaults={"dim": 64},
    card=dict(task=tasks.BLOCK, output="y", input=InputCard(name="x", shape=(64, 16, 16)),
              description="Hamburger's NMF ham: multiplicative updates, rank 64, seeded constant bases"))
def nmf_ham(**kw) -> NMFHam:
    return NMFHam(**kw)
