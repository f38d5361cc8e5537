"""The model registry: names → builders, committed weights and example inputs (CONVENTIONS.md).

``unroll.load(name)`` is the one way in, like ``timm.create_model``: it builds the architecture with
its own options, loads committed weights (or an official checkpoint), refreshes solver constants and
returns the module in eval mode.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
Task = Literal["classification", "denoising", "block"]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    task: Task
    builder: Callable[..., nn.Module]
    description: str
    #: Shape of one example input sample (without batch) — the fixed resolution where one is needed.
    input_shape: tuple[int, ...]
    #: Options forwarded to the builder unless the caller overrides them.
    defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def weights_path(self) -> Path:
        return WEIGHTS_DIR / f"{self.name}.pt"

    @property
    def info_path(self) -> Path:
        return WEIGHTS_DIR / f"{self.name}.json"

    @property
    def has_weights(self) -> bool:
        return self.weights_path.exists()

    def info(self) -> dict:
        """The committed training record (recipe, split, seed, metrics), or ``{}``."""
        return json.loads(self.info_path.read_text()) if self.info_path.exists() else {}


def _sdnet(builder_name: str) -> Callable[..., nn.Module]:
    def build(**kw: Any) -> nn.Module:
        from unroll.models import sdnet

        return getattr(sdnet, builder_name)(**kw)

    return build


def _mnist(**kw: Any) -> nn.Module:
    from unroll.models.mnist import MNISTSDNet

    return MNISTSDNet(**kw)


def _denoiser(**kw: Any) -> nn.Module:
    from unroll.models.denoiser import CSCDenoiser

    return CSCDenoiser(**kw)


def _block(kind: str) -> Callable[..., nn.Module]:
    def build(**kw: Any) -> nn.Module:
        from unroll import solvers  # noqa: F401  (package docstring only)
        from unroll.solvers.csc import DictBlock
        from unroll.solvers.dic_attn import DicAttention
        from unroll.solvers.nmf import NMFHam
        from unroll.solvers.vars_attn import VARSAttention

        classes = {"csc-fista": DictBlock, "vars-d": VARSAttention, "vars-sd": VARSAttention,
                   "nmf-ham": NMFHam, "dic-attn": DicAttention}
        return classes[kind](**kw)

    return build


_SPECS = [
    ModelSpec("sdnet-mnist", "classification", _mnist,
              "SDNet-style MNIST classifier: CSC front end (FISTA K=2, λ=0.1) + residual CNN (trained demo)",
              (1, 28, 28)),
    ModelSpec("csc-denoiser", "denoising", _denoiser,
              "Noise-level-aware convolutional LISTA denoiser, stride-2 dictionary (trained demo, grayscale)",
              (1, 64, 64)),
    ModelSpec("sdnet18-cifar", "classification", _sdnet("sdnet18_cifar"),
              "SDNet-18 for CIFAR-10: CSC stem + ResNet-18 (official checkpoint layout)", (3, 32, 32)),
    ModelSpec("sdnet18all-cifar", "classification", _sdnet("sdnet18all_cifar"),
              "SDNet-18-All for CIFAR-10: every 3×3 conv is a CSC layer (option shortcut=True/False)",
              (3, 32, 32), {"shortcut": True}),
    ModelSpec("sdnet18-imagenet", "classification", _sdnet("sdnet18_imagenet"),
              "SDNet-18 for ImageNet: 7×7 stride-2 CSC stem + ResNet-18", (3, 224, 224)),
    ModelSpec("sdnet34-imagenet", "classification", _sdnet("sdnet34_imagenet"),
              "SDNet-34 for ImageNet: 7×7 stride-2 CSC stem + ResNet-34", (3, 224, 224)),
    ModelSpec("csc-fista", "block", _block("csc-fista"),
              "SDNet's CSC layer alone: non-negative conv sparse coding, FISTA (3→64 atoms, K=2)",
              (3, 32, 32), {"in_channels": 3, "num_atoms": 64}),
    ModelSpec("vars-d", "block", _block("vars-d"),
              "VARS-D attention: ISTA sparse reconstruction over random-feature atoms of the queries",
              (64, 64), {"dim": 64, "mode": "d"}),
    ModelSpec("vars-sd", "block", _block("vars-sd"),
              "VARS-SD attention: VARS-D plus learned static atoms", (64, 64), {"dim": 64, "mode": "sd"}),
    ModelSpec("nmf-ham", "block", _block("nmf-ham"),
              "Hamburger's NMF ham: multiplicative updates, rank 64, seeded constant bases", (64, 16, 16),
              {"dim": 64}),
    ModelSpec("dic-attn", "block", _block("dic-attn"),
              "Dic-Attn: elastic-net (ISTA) sparse reconstruction over a learned unit-norm dictionary",
              (64, 64), {"dim": 64}),
]
REGISTRY: dict[str, ModelSpec] = {s.name: s for s in _SPECS}


def list_models() -> list[str]:
    """Registered model names, in registry order."""
    return list(REGISTRY)


def get_spec(name: str) -> ModelSpec:
    if name not in REGISTRY:
        raise KeyError(f"unknown model {name!r}; registered models: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def load(name: str, pretrained: bool = True, checkpoint: str | Path | None = None, **options: Any) -> nn.Module:
    """Build a registered model in eval mode, with its committed weights when ``pretrained``.

    ``checkpoint=PATH`` loads an official SDNet checkpoint (``model_best.pth.tar`` or
    ``checkpoint.pth.tar``) instead of committed weights; other ``options`` go to the architecture.
    """
    spec = get_spec(name)
    kw = {**spec.defaults, **spec.info().get("model", {}), **options}
    seed = kw.pop("seed", 0)
    with torch.random.fork_rng():  # seeded initialisation, without touching the caller's RNG state
        torch.manual_seed(seed)
        model = spec.builder(**kw)
    if checkpoint is not None:
        from unroll.models.sdnet import load_official_checkpoint

        if not name.startswith("sdnet") or name == "sdnet-mnist":
            raise ValueError(f"checkpoint= loads official SDNet checkpoints; {name!r} is not an SDNet architecture")
        load_official_checkpoint(model, checkpoint)
    elif pretrained:
        if not spec.has_weights:
            raise FileNotFoundError(
                f"{name!r} has no committed weights (expected {spec.weights_path}); use pretrained=False for "
                "a seeded random initialisation" + (", or checkpoint=PATH for an official checkpoint"
                                                    if name.startswith("sdnet") else ""))
        model.load_state_dict(torch.load(spec.weights_path, map_location="cpu", weights_only=True))
    return model.eval()
