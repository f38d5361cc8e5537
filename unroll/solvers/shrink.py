"""Shrinkage (proximal operators of the L1 norm), written in their cheapest exact form.

The export step pattern-matches these forms: the non-negative threshold is one ``relu(v - θ)``, the
signed one ``v - clamp(v, -θ, θ)``. Both are exact (not approximations) and cost one or two
elementwise ops, unlike the ``sign(v)·relu(|v| - θ)`` chain.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

_TEXTBOOK = False


@contextmanager
def textbook_mode() -> Iterator[None]:
    """Switch every solver to its *textbook* form: ``sign(v)·relu(|v| − θ)`` shrinkage, unfolded step
    sizes, ``Dᵀx − DᵀDy`` gradients. Same maths; used to produce the "naive export" that the fused graph
    is compared with."""
    global _TEXTBOOK
    previous, _TEXTBOOK = _TEXTBOOK, True
    try:
        yield
    finally:
        _TEXTBOOK = previous


def is_textbook() -> bool:
    return _TEXTBOOK


def _broadcast(theta: Tensor | float, v: Tensor) -> Tensor | float:
    """Make a scalar, per-channel ``[C]`` or per-sample ``[B]`` threshold broadcast against ``v``.

    A 1-D threshold whose length equals ``v``'s channel dim (dim 1) is per-channel; otherwise a 1-D
    threshold must have length ``B`` (per-sample). Pass an explicitly shaped tensor to avoid the
    ambiguity when ``B == C``.
    """
    if not isinstance(theta, Tensor) or theta.dim() != 1:
        return theta
    shape = [1] * v.dim()
    if v.dim() >= 2 and theta.shape[0] == v.shape[1] and theta.shape[0] != v.shape[0]:
        shape[1] = -1
    else:
        shape[0] = -1
    return theta.reshape(shape)


def soft_threshold(v: Tensor, theta: Tensor | float) -> Tensor:
    """Signed soft threshold ``sign(v)·max(|v| - θ, 0)`` computed as ``v - clamp(v, -θ, θ)``."""
    theta = _broadcast(theta, v)
    if _TEXTBOOK:
        return torch.sign(v) * torch.relu(torch.abs(v) - theta)
    if isinstance(theta, Tensor) and theta.dim() > 0:
        return v - torch.minimum(torch.maximum(v, -theta), theta)
    return v - torch.clamp(v, -theta, theta)


def soft_threshold_nonneg(v: Tensor, theta: Tensor | float) -> Tensor:
    """Non-negative soft threshold ``max(v - θ, 0)``: the prox of ``θ‖·‖₁ + ι(· ≥ 0)``."""
    if _TEXTBOOK:
        return torch.relu(soft_threshold(v, theta))
    return torch.relu(v - _broadcast(theta, v))
