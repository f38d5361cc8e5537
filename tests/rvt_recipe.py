"""The golden file's weight recipe (``tests/fixtures/vars_rvt_keys.json``: ``make_state_dict``), re-created here.

One generator seeded once, drawn in the official key order; the file's checksum proves the re-creation.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

FIXTURES = Path(__file__).parent / "fixtures"
KEYS = json.loads((FIXTURES / "vars_rvt_keys.json").read_text())
#: The golden file's attention variants → this project's registered names (RVT-Tiny).
VARIANTS = {"self-att": "rvt-tiny", "vars_d": "rvt-tiny-vars-d", "vars_sd": "rvt-tiny-vars-sd"}


def golden() -> np.lib.npyio.NpzFile:
    return np.load(FIXTURES / "vars_rvt_golden.npz")


def make_state_dict(spec: list, seed: int = KEYS["seed"]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for key, shape, dtype in spec:
        last = key.rsplit(".", 1)[-1]
        if dtype == "int64":
            t = torch.zeros(shape, dtype=torch.int64)
        elif last == "running_mean":
            t = 0.1 * torch.randn(shape, generator=g)
        elif last == "running_var":
            t = 0.5 + torch.rand(shape, generator=g)
        elif last in ("rand_matrix", "kernel"):
            t = torch.randn(shape, generator=g)
        elif last == "learned_k":
            t = torch.eye(shape[0]) + 0.01 * torch.randn(shape, generator=g)
        elif last in ("learned_lam", "learned_L"):
            t = 1 + 0.1 * (2 * torch.rand(shape, generator=g) - 1)
        elif last == "L":
            t = torch.full(shape, 25.0)
        elif len(shape) == 1:
            t = (1.0 if last == "weight" else 0.0) + 0.1 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) * math.sqrt(1 / math.prod(shape[1:]))
        sd[key] = t
    return sd


def checksum(sd: dict[str, torch.Tensor]) -> tuple[float, float]:
    s = sum(float(t.double().sum()) for t in sd.values())
    ss = sum(float(t.double().square().sum()) for t in sd.values())
    return s, ss
