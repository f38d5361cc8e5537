"""A user's classifier whose cost is its solver's, for the anytime controller's tests (tests/test_anytime.py).

FISTA on a 1×64×64 image with 64 atoms of 7×7 (unroll's :class:`~unroll.solvers.csc.DictBlock`, so every
iteration count exports as a graph of its own), then a linear head over the mean code: each iteration costs a few
milliseconds on this machine's CPU, far more than the gateway's own work, so the count decides the capacity.
Weights are drawn from a fixed seed (no training: the tests judge latency and which graph answered, not accuracy).
"""

from __future__ import annotations

import torch
from torch import nn

from unroll.solvers.csc import DictBlock

SIDE = 64
TRAINED = 8
SERVED = (1, 2, 4)


class SolverClassifier(nn.Module):
    def __init__(self, n_steps: int = TRAINED) -> None:
        super().__init__()
        g = torch.random.fork_rng()
        with g:
            torch.manual_seed(0)
            self.csc = DictBlock(1, 64, kernel_size=7, padding=3, n_steps=n_steps, probe_size=SIDE)
            self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.csc(x).mean((2, 3)))


def factory() -> SolverClassifier:
    return SolverClassifier()
