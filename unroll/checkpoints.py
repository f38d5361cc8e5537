"""Reading official checkpoints: unwrap the training script's dict, strip wrapper prefixes, load strictly.

Papers' training scripts save ``{"model": state_dict, ...}`` (DeiT/RVT/VARS), ``{"state_dict": ...}`` (SDNet,
mmseg) or a bare state dict, often with DataParallel's ``module.`` prefix. Every architecture with official
checkpoints loads them through here, so the accepted shapes and the error a mismatched file gets are the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from os import PathLike

import torch
from torch import Tensor, nn

from unroll.errors import CheckpointError

#: Keys under which training scripts store the state dict, tried in order.
WRAPPERS = ("state_dict", "model")


def read_state_dict(path: str | PathLike[str], prefixes: Sequence[str] = ("module.",)) -> dict[str, Tensor]:
    """The state dict in ``path`` (bare or wrapped), with each of ``prefixes`` removed where every key has it."""
    obj = torch.load(path, map_location="cpu", weights_only=True)
    for key in WRAPPERS:
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, Tensor) for v in obj.values()):
        raise CheckpointError(f"{path}: not a state dict nor a checkpoint holding one under "
                         f"{' or '.join(repr(k) for k in WRAPPERS)}")
    for prefix in prefixes:
        if all(k.startswith(prefix) for k in obj):
            obj = {k.removeprefix(prefix): v for k, v in obj.items()}
    return obj


def load_strict(model: nn.Module, state: dict[str, Tensor], where: str | PathLike[str]) -> None:
    """``model.load_state_dict(state, strict=True)`` with an error naming every missing, extra or misshapen key."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    bad_shape = sorted(f"{k}: checkpoint {list(state[k].shape)} vs model {list(expected[k].shape)}"
                       for k in set(state) & set(expected) if state[k].shape != expected[k].shape)
    if missing or unexpected or bad_shape:
        arch = getattr(model, "arch", type(model).__name__)
        raise CheckpointError(f"{where} does not match {arch}: missing keys {missing}, unexpected keys "
                         f"{unexpected}, shape mismatches {bad_shape}")
    model.load_state_dict(state, strict=True)
