"""A digit classifier with its own LISTA layer, in plain PyTorch (no unroll imports): deploy it with unroll.

The sparse code of a 28×28 digit under a learned convolutional dictionary D is computed by K = 5
fixed ISTA steps,

    z₀ = 0,   z_{k+1} = shrink(z_k − η·Dᵀ(D z_k − x), η·λ),   shrink(v, θ) = sign(v)·relu(|v| − θ),

written the textbook way (the soft threshold as sign·relu(|·|−θ), the step size η multiplying the
gradient at run time), followed by a small linear head. λ is a per-sample input (``forward(x, lam)``)
so it can be turned at inference time. The iteration count is a constructor constant: a static graph
needs a fixed K, not a loop that runs until a tolerance is met.

Export it (the card comes from the options):

    unroll export --model examples/ista_digits.py:ista_digits --name ista-digits --input-shape 1,28,28 \
        --task classification --labels examples/digits.txt --lam-input lam --lam-default 0.1 \
        --data-train mnist-train --data-test mnist-test --resize pad-square

``ista_digits(weights=PATH)`` loads a ``state_dict`` saved with ``torch.save(model.state_dict(), PATH)``;
without it the weights are a seeded random initialisation (train it first for real predictions).

``python examples/ista_digits.py their_model.onnx`` writes the model the way someone else's code would: a plain
``torch.onnx.export`` with no unroll card (inputs ``image`` and ``lam``, output ``logits``, dynamic batch), the
graph the README's third way in (``unroll fuse … --card examples/my-model.card.json``) starts from.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn


def soft_threshold(v: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """The textbook shrinkage operator: sign(v)·relu(|v| − θ)."""
    return torch.sign(v) * torch.relu(torch.abs(v) - theta)


class ISTALayer(nn.Module):
    """K ISTA steps for min_z ½‖x − D∗z‖² + λ‖z‖₁ with a convolutional dictionary D (atoms × 5×5)."""

    def __init__(self, in_channels: int = 1, atoms: int = 16, kernel: int = 5, k: int = 5, eta: float = 0.1,
                 lam: float = 0.1) -> None:
        super().__init__()
        self.k, self.eta, self.lam, self.pad = k, eta, lam, kernel // 2
        self.dictionary = nn.Parameter(torch.randn(atoms, in_channels, kernel, kernel) / kernel)

    def forward(self, x: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        theta = (self.eta * lam).view(-1, 1, 1, 1)
        z = torch.zeros(x.shape[0], self.dictionary.shape[0], x.shape[2], x.shape[3], dtype=x.dtype)
        for _ in range(self.k):  # a fixed iteration count: unrolls into K copies of the step
            residual = F.conv_transpose2d(z, self.dictionary, padding=self.pad) - x  # D z − x
            grad = F.conv2d(residual, self.dictionary, padding=self.pad)             # Dᵀ(D z − x)
            z = soft_threshold(z - self.eta * grad, theta)
        return z


class ISTADigits(nn.Module):
    """ISTA sparse code → 4×4 average pooling → linear classifier over 10 digits."""

    def __init__(self, atoms: int = 16, k: int = 5, lam: float = 0.1) -> None:
        super().__init__()
        self.ista = ISTALayer(1, atoms, k=k, lam=lam)
        self.head = nn.Linear(atoms * 7 * 7, 10)

    def forward(self, x: torch.Tensor, lam: torch.Tensor | None = None) -> torch.Tensor:
        if lam is None:
            lam = torch.full((x.shape[0],), self.ista.lam, dtype=x.dtype)
        z = self.ista(x, lam)
        return self.head(F.avg_pool2d(z, 4).flatten(1))


def ista_digits(weights: str | None = None, k: int = 5) -> ISTADigits:
    """The factory ``unroll export --model examples/ista_digits.py:ista_digits`` calls (seeded weights)."""
    torch.manual_seed(0)
    model = ISTADigits(k=k)
    if weights is not None:
        model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    return model.eval()


def export_plain_onnx(path: str) -> None:
    """``torch.onnx.export`` of :func:`ista_digits` to ``path``, no card: an ONNX file as another tool leaves it."""
    model = ista_digits()
    batch = torch.export.Dim("batch", min=1, max=4096)  # an example batch of 2: a batch of 1 would be specialised
    example = (torch.rand(2, 1, 28, 28), torch.full((2,), model.ista.lam))
    torch.onnx.export(model, example, path, input_names=["image", "lam"], output_names=["logits"],
                      dynamic_shapes={"x": {0: batch}, "lam": {0: batch}}, external_data=False)


if __name__ == "__main__":
    export_plain_onnx(sys.argv[1] if len(sys.argv) > 1 else "their_model.onnx")
