"""Classifier accuracy with a per-sample λ, in batches: one definition for training recipes and benchmarks.

Models with a CSC front end take ``forward(x, lam)`` (CONVENTIONS.md); the λ-robustness studies sweep
:data:`LAM_GRID` and choose on validation data.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

#: The λ values the robustness studies sweep (the recipe's table, its λ rule's fit, ``bench robustness``).
LAM_GRID = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0)
#: Samples per forward pass in evaluation. Larger batches are slower on a CPU, not faster: their CSC activations are
#: large enough to be allocated with mmap and page-faulted afresh by every op. Every sample's logits are independent
#: of the batch, so the metrics do not move.
EVAL_BATCH = 100


@torch.inference_mode()
def accuracy(model: nn.Module, x: torch.Tensor, y: np.ndarray, lam: torch.Tensor | float | None = None) -> float:
    """Top-1 accuracy at the training λ (``None``), one λ for all samples (a float) or one per sample (``[N]``)."""
    preds = []
    for i in range(0, len(x), EVAL_BATCH):
        xb = x[i:i + EVAL_BATCH]
        lb = None
        if isinstance(lam, float):
            lb = torch.full((len(xb),), lam)
        elif isinstance(lam, torch.Tensor):
            lb = lam[i:i + EVAL_BATCH]
        preds.append((model(xb) if lb is None else model(xb, lb)).argmax(1))  # a model without λ takes one input
    return float((torch.cat(preds).numpy() == y).mean())


@torch.inference_mode()
def auto_lam(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``model.auto_lam`` (its λ rule) per sample, in batches of :data:`EVAL_BATCH` (the same values as one pass)."""
    return torch.cat([model.auto_lam(x[i:i + EVAL_BATCH]) for i in range(0, len(x), EVAL_BATCH)])
