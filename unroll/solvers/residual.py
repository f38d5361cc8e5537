"""How well a model's first solver layer reconstructs what it was given: ``‖target − D·z‖ / ‖target‖`` per sample,
and how large a code it needed for that, ``‖z‖₁ / ‖target‖`` (:func:`solver_signals`).

Each unrolled solver fits a code ``z`` to a target over a dictionary ``D``; on inputs like its training data the fit
and the code's size are typical, on others they are not (an out-of-distribution signal that costs one
reconstruction, no second model):

- CSC (SDNet's ``DictBlock``): the residual ``x − D⊛c`` its last FISTA step computed anyway (at the iterate before
  the final code), so the score adds two norms and no convolution; a layer without steps falls back to
  reconstructing from its code;
- VARS attention: each head's values ``v`` and the ISTA codes over the random-feature dictionary: ``v − D·codes``,
  whose reconstruction ``D·codes`` the attention computes anyway (its output);
- Dic-Attn: the tokens and their elastic-net codes: ``x − φ·Dᵀ``;
- Hamburger's NMF: ``relu(x)`` (flattened, ``[B, D, N]``) and its factors: ``X − bases·coefᵀ``.

:func:`forward_with_residual` runs the model once, catching the first solver layer's input (and the CSC layer's
code) with a forward hook; for the attention and NMF layers, whose codes stay inside their ``forward``, the codes
are recomputed from that input with the layer's own solver (deterministic in eval: the same numbers). The CSC, VARS
and NMF layers instead keep ``(target, target − D·z)`` for one forward when asked (``keep_residual``): the graph then
adds only the norms (VARS and NMF keep their codes too). Nothing here changes a layer's output. :func:`reconstruct` is
``D·z`` for the layers that keep nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unroll.solvers.csc import DictBlock, output_padding
from unroll.solvers.dic_attn import DicAttention, elastic_net_codes
from unroll.solvers.nmf import NMFHam
from unroll.solvers.vars_attn import VARSAttention, vars_codes

SOLVERS = (DictBlock, VARSAttention, DicAttention, NMFHam)


@dataclass
class Fit:
    """A solver layer's target, dictionary and code: what :func:`reconstruct` needs (``kind`` says how)."""

    kind: str
    target: Tensor
    dictionary: Tensor | None
    code: Tensor | None
    layer: nn.Module
    #: ``target − D·z`` where the layer computed it already (``keep_residual``; CSC: its last step's, at the iterate
    #: before its output). ``dictionary`` and ``code`` are then not needed (VARS: not recomputed, ``None``).
    difference: Tensor | None = None
    #: The solver keeps its codes ≥ 0 (CSC's nonnegative shrinkage, NMF): their L1 norm is their sum.
    nonnegative: bool = False


def first_solver(model: nn.Module) -> nn.Module | None:
    """The model's first solver layer (module order), or ``None``: then it has no residual to give."""
    return next((m for m in model.modules() if isinstance(m, SOLVERS)), None)


@torch.no_grad()
def _fit(layer: nn.Module, x: Tensor, out: Tensor, kept: tuple[Tensor, Tensor] | None = None) -> Fit:
    if isinstance(layer, DictBlock):
        return Fit("csc", x, layer.weight, out, layer, None if kept is None else kept[1], nonnegative=True)
    if isinstance(layer, VARSAttention) and kept is not None:
        return Fit("vars", kept[0], None, kept[2], layer, kept[1])
    if isinstance(layer, VARSAttention):
        qv = layer.qkv(x).unflatten(-1, (2, layer.num_heads, layer.head_dim)).permute(2, 0, 3, 1, 4)
        q, v = qv[0], qv[1]
        D = layer.dictionary(q)
        Dt = D.transpose(-1, -2)
        codes = vars_codes(Dt @ D, Dt @ v, layer.lam * layer.learned_lam, layer.n_steps, layer.shrink,
                           layer.learned_k, layer.learned_L, nonneg=layer.mode == "d")
        return Fit("vars", v, D, codes, layer)
    if isinstance(layer, DicAttention):
        phi = elastic_net_codes(layer.dictionary, x, layer.beta, layer.mu, layer.n_steps, layer.lipschitz)
        return Fit("dic", x, layer.dictionary, phi, layer)
    if kept is not None:
        return Fit("nmf", kept[0], None, kept[2], layer, kept[1], nonnegative=True)
    X = torch.relu(x.flatten(2))
    bases, coef = layer.decompose(x)
    return Fit("nmf", X, bases, coef, layer, nonnegative=True)


def reconstruct(fit: Fit) -> Tensor:
    """``D·z`` in the target's layout (the one extra operation a served residual costs)."""
    if fit.kind == "csc":
        layer = fit.layer
        return F.conv_transpose2d(fit.code, fit.dictionary, stride=layer.stride, padding=layer.padding,
                                  output_padding=output_padding(layer.stride))
    if fit.kind == "vars":
        return fit.dictionary @ fit.code
    if fit.kind == "dic":
        return fit.code @ fit.dictionary.transpose(0, 1)
    return fit.dictionary @ fit.code.transpose(-1, -2)


#: Target norms below this count as zero.
TINY = 1e-12


def solver_signals(fit: Fit) -> Tensor:
    """``[B, 2]``: per sample ``‖target − D·z‖ / ‖target‖`` and ``‖z‖₁ / ‖target‖`` (:data:`unroll.card.SOLVER_SIGNALS`;
    a zero target counts as fully unexplained: both 1). Few graph nodes, since each costs a served request about a
    microsecond whatever its size: reductions over all but the batch axis kept as ``[B, 1, …]`` and joined, one
    division, and no comparison (``+ TINY`` on both sides makes a zero target 1 and changes no other value in float32;
    the exported graph stays free of the branch ops TensorRT's lint and the fused-shrinkage check look for)."""
    difference = fit.target - reconstruct(fit) if fit.difference is None else fit.difference
    axes = tuple(range(1, fit.target.dim()))
    code = fit.code if fit.nonnegative else fit.code.abs()
    sizes = torch.cat([torch.linalg.vector_norm(difference, dim=axes, keepdim=True),
                       code.sum(dim=axes, keepdim=True)], dim=1)
    return ((sizes + TINY) / (torch.linalg.vector_norm(fit.target, dim=axes, keepdim=True) + TINY)).flatten(1)


def relative_residual(fit: Fit) -> Tensor:
    """``‖target − D·z‖ / ‖target‖`` per sample ``[B]`` (:func:`solver_signals`' first column)."""
    return solver_signals(fit)[:, 0]


class WithResidual(nn.Module):
    """``module``'s output and, per sample, its first solver layer's relative residual and code size as one ``[B, 2]``
    tensor (``card.ood``, columns :data:`unroll.card.SOLVER_SIGNALS`): what the exported graph's two outputs are, and
    what the AOTInductor package and the torch runtime run."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *inputs: Tensor) -> tuple[Tensor, Tensor]:
        y, fit = _forward_fit(self.module, *inputs)
        return y, solver_signals(fit)


@torch.no_grad()
def forward_with_residual(model: nn.Module, *inputs: Tensor) -> tuple[Tensor, Tensor, Fit]:
    """The model's output on ``inputs`` (its positional inputs: the image, then e.g. λ), its first solver layer's
    relative residual ``[B]``, and the fit behind it. Raises ``ValueError`` for a model with no solver layer
    (:func:`first_solver`)."""
    y, fit = _forward_fit(model, *inputs)
    return y, relative_residual(fit), fit


@torch.no_grad()
def _forward_fit(model: nn.Module, *inputs: Tensor) -> tuple[Tensor, Fit]:
    """The model's output and its first solver layer's fit, from one forward (:func:`forward_with_residual`)."""
    layer = first_solver(model)
    if layer is None:
        raise ValueError(f"{type(model).__name__} has no solver layer, so no reconstruction residual")
    caught: dict[str, Tensor] = {}

    def hook(_: nn.Module, inputs: tuple, output: Tensor) -> None:
        if "x" not in caught:  # the first call (a layer run twice per forward keeps its first input)
            caught["x"], caught["out"] = inputs[0], output
            caught["kept"] = getattr(layer, "solver_residual", None)

    keeps = hasattr(layer, "keep_residual")
    handle = layer.register_forward_hook(hook)
    try:
        if keeps:
            layer.keep_residual = True
        y = model(*inputs)
    finally:
        handle.remove()
        if keeps:  # back to the class default: a plain forward holds no extra activation
            del layer.keep_residual
            layer.solver_residual = None
    return y, _fit(layer, caught["x"], caught["out"], caught["kept"])
