"""SDNet classifiers (Dai et al., NeurIPS 2022) with state-dict keys identical to the official checkpoints.

Architectures follow the official repository (Delay-Xili/SDNet, ``Lib/models/sdnet.py`` and
``Lib/models/sdnet_inverse.py``) so its ``model_best.pth.tar`` / ``checkpoint.pth.tar`` load with
``strict=True``:

* ``sdnet18/34``: only the stem is a CSC layer (``layer0 = [DictConv, BN(, MaxPool)]``); the rest is
  a plain ResNet-18/34 (conv → BN → ReLU → conv → BN, + shortcut, ReLU).
* ``sdnet18all``: every 3×3 conv of the residual blocks is a CSC layer and the block is
  ``BN(CSC(BN(CSC(x))))``; with ``shortcut=True`` it adds the (1×1 conv + BN when downsampling)
  shortcut and a ReLU, with ``shortcut=False`` the blocks are simply stacked (no add, no ReLU).

The official stem has its ReLU commented out (the non-negative sparse code is the nonlinearity), so
``stem_relu`` defaults to ``False``; it holds no parameters, so either setting loads the same weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from os import PathLike
from typing import Any, Literal

import torch
from torch import Tensor, nn

from unroll import tasks
from unroll.card import InputCard, LamCard
from unroll.checkpoints import load_strict, read_state_dict
from unroll.registry import register_model
from unroll.solvers.csc import DictBlock, normalize_atoms

Stem = Literal["cifar", "imagenet"]

# Power-iteration probe images are the layer's real input size (as the official code, which iterates
# on the actual feature map) but capped: beyond ~64 px boundary effects on λ_max are negligible and the
# cost (50 conv pairs per layer at construction) is not.
_PROBE_CAP = 64
_INPUT_SIZE: dict[str, tuple[int, int, int]] = {"cifar": (3, 32, 32), "imagenet": (3, 224, 224)}


def _conv_out(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


class DictConv(nn.Module):
    """Holds the CSC layer as ``dn`` so keys read ``….dn.weight`` like the official ``DictConv2d``."""

    def __init__(
        self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, padding: int = 0,
        lmbd: float = 0.1, n_steps: int = 2, probe_size: int = 32,
    ) -> None:
        super().__init__()
        self.dn = DictBlock(in_channels, out_channels, kernel_size=kernel_size, stride=stride,
                            padding=padding, lmbd=lmbd, n_steps=n_steps,
                            probe_size=min(probe_size, _PROBE_CAP))

    def forward(self, x: Tensor, lmbd: Tensor | None = None) -> Tensor:
        return self.dn(x, lmbd)


class BasicBlock(nn.Module):
    """Standard ResNet basic block (official SDNet keeps these as ordinary convolutions)."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(planes))

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class CSCBasicBlock(nn.Module):
    """Basic block whose two 3×3 convs are CSC layers (official ``sdnet_inverse.BasicBlock``).

    No ReLU between the two layers: the non-negative sparse code already is the nonlinearity.
    Without ``shortcut`` the module has no ``shortcut`` attribute at all (matching the official keys).
    """

    def __init__(
        self, in_planes: int, planes: int, stride: int = 1, shortcut: bool = True,
        lmbd: float = 0.1, n_steps: int = 2, in_size: int = 32,
    ) -> None:
        super().__init__()
        mid_size = _conv_out(in_size, 3, stride, 1)
        self.conv1 = DictConv(in_planes, planes, 3, stride=stride, padding=1, lmbd=lmbd, n_steps=n_steps,
                              probe_size=in_size)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = DictConv(planes, planes, 3, stride=1, padding=1, lmbd=lmbd, n_steps=n_steps,
                              probe_size=mid_size)
        self.bn2 = nn.BatchNorm2d(planes)
        self.has_shortcut = shortcut
        if shortcut:
            self.shortcut = nn.Sequential()
            if stride != 1 or in_planes != planes:
                self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                                              nn.BatchNorm2d(planes))

    def forward(self, x: Tensor) -> Tensor:
        out = self.bn2(self.conv2(self.bn1(self.conv1(x))))
        if self.has_shortcut:
            out = torch.relu(out + self.shortcut(x))
        return out


class CSCStage(nn.Module):
    """CSC blocks held in ``layers``, like the official ``_make_layer`` (keys ``layerN.layers.i…``)."""

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.Sequential(*blocks)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class SDNet(nn.Module):
    """ResNet-style classifier with a CSC stem (and optionally CSC in every block).

    ``forward(x, lam)`` takes an optional per-sample ``[B]`` λ for the *first* CSC layer: SDNet's
    test-time trade-off between sparsity and reconstruction for corrupted inputs.
    """

    def __init__(
        self, num_blocks: Sequence[int], num_classes: int = 10, stem: Stem = "cifar",
        csc_blocks: bool = False, shortcut: bool = True, lmbd: float = 0.1, n_steps: int = 2,
        stem_relu: bool = False, arch: str = "sdnet",
    ) -> None:
        super().__init__()
        if stem not in _INPUT_SIZE:
            raise ValueError(f"stem must be 'cifar' or 'imagenet', got {stem!r}")
        if csc_blocks and stem != "cifar":
            # The official all-CSC ImageNet stem replaces the max-pool by a second CSC layer; no
            # checkpoint of it is published, so it is not reproduced here.
            raise ValueError("all-CSC SDNet is only defined for the CIFAR stem")
        self.arch, self.num_classes, self.input_size = arch, num_classes, _INPUT_SIZE[stem]
        size = self.input_size[-1]
        csc = {"lmbd": lmbd, "n_steps": n_steps}

        relu = [nn.ReLU(inplace=True)] if stem_relu else []
        if stem == "cifar":
            self.layer0 = nn.Sequential(DictConv(3, 64, 3, stride=1, padding=1, probe_size=size, **csc),
                                        nn.BatchNorm2d(64), *relu)
        else:
            self.layer0 = nn.Sequential(DictConv(3, 64, 7, stride=2, padding=3, probe_size=size, **csc),
                                        nn.BatchNorm2d(64), *relu, nn.MaxPool2d(3, stride=2, padding=1))
            size = _conv_out(_conv_out(size, 7, 2, 3), 3, 2, 1)

        in_planes, stages = 64, []
        for i, (planes, n) in enumerate(zip((64, 128, 256, 512), num_blocks, strict=True)):
            blocks: list[nn.Module] = []
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                if csc_blocks:
                    blocks.append(CSCBasicBlock(in_planes, planes, stride, shortcut=shortcut, in_size=size,
                                                **csc))
                else:
                    blocks.append(BasicBlock(in_planes, planes, stride))
                in_planes, size = planes, _conv_out(size, 3, stride, 1)
            stages.append(CSCStage(blocks) if csc_blocks else nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.linear = nn.Linear(512, num_classes)

    def forward(self, x: Tensor, lam: Tensor | None = None) -> Tensor:
        """Logits ``[B, num_classes]``; ``lam`` ``[B]`` overrides the stem CSC layer's λ per sample."""
        out = x
        for i, m in enumerate(self.layer0):
            out = m(out, lam) if i == 0 else m(out)
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        return self.linear(torch.flatten(self.avgpool(out), 1))


def sdnet18_cifar(num_classes: int = 10, **kw: Any) -> SDNet:
    """SDNet-18 for 32×32 inputs (CSC stem only)."""
    return SDNet((2, 2, 2, 2), num_classes, stem="cifar", arch="sdnet18-cifar", **kw)


def sdnet18_imagenet(num_classes: int = 1000, **kw: Any) -> SDNet:
    """SDNet-18 for 224×224 inputs (7×7 stride-2 CSC stem + max-pool)."""
    return SDNet((2, 2, 2, 2), num_classes, stem="imagenet", arch="sdnet18-imagenet", **kw)


def sdnet34_imagenet(num_classes: int = 1000, **kw: Any) -> SDNet:
    """SDNet-34 for 224×224 inputs."""
    return SDNet((3, 4, 6, 3), num_classes, stem="imagenet", arch="sdnet34-imagenet", **kw)


def sdnet18all_cifar(num_classes: int = 10, shortcut: bool = True, **kw: Any) -> SDNet:
    """SDNet-18-All: every residual-block conv is a CSC layer; ``shortcut`` keeps the residual path."""
    return SDNet((2, 2, 2, 2), num_classes, stem="cifar", csc_blocks=True, shortcut=shortcut,
                 arch=f"sdnet18all-cifar-shortcut{int(shortcut)}", **kw)


# Builders by the names used for the official checkpoints (and the state-dict key fixture).
SDNET_BUILDERS: dict[str, Callable[..., SDNet]] = {
    "sdnet18-cifar": sdnet18_cifar,
    "sdnet18-imagenet": sdnet18_imagenet,
    "sdnet34-imagenet": sdnet34_imagenet,
    "sdnet18all-cifar-shortcut0": partial(sdnet18all_cifar, shortcut=False),
    "sdnet18all-cifar-shortcut1": partial(sdnet18all_cifar, shortcut=True),
}


def csc_layers(model: nn.Module) -> list[DictBlock]:
    """Every CSC layer of ``model`` in module order."""
    return [m for m in model.modules() if isinstance(m, DictBlock)]


def refresh_csc(model: nn.Module) -> int:
    """Re-normalise atoms and recompute step sizes of every CSC layer (after training); returns the count.

    The step size lives in a buffer computed outside ``forward`` (to keep the traced graph static),
    so anything that changes the dictionaries must call this before evaluation or export.
    """
    layers = csc_layers(model)
    for dn in layers:
        dn.refresh()
    return len(layers)


def load_official_checkpoint(
    model: nn.Module, path: str | PathLike[str], recompute_step_size: bool = False,
) -> nn.Module:
    """Load an official SDNet checkpoint into ``model`` strictly and return it.

    Accepts ``model_best.pth.tar`` (a bare state dict) or ``checkpoint.pth.tar`` (``{'state_dict': …}``),
    with or without a DataParallel ``module.`` prefix. Atoms are re-normalised in place, which is what
    the official ``forward`` does on every call, so eval outputs match it. The stored ``step_size`` is
    kept by default: the official code saved it right after validation had recomputed it for these
    (normalised) atoms, and our power iteration (different probe, no warm start) would shift it
    slightly; pass ``recompute_step_size=True`` to recompute it anyway.
    """
    load_strict(model, read_state_dict(path), path)

    if recompute_step_size:
        refresh_csc(model)
    else:
        with torch.no_grad():
            for dn in csc_layers(model):
                dn.weight.copy_(normalize_atoms(dn.weight))
    return model


# ---------------------------------------------------------------------------------------------- registry
CIFAR10_LABELS = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
#: CIFAR models: 32×32 RGB in [0, 1] (no normalisation is assumed; a checkpoint trained with one sets
#: mean/std on its card). ImageNet models: the official evaluation transform (torchvision's bilinear
#: ``Resize(256)`` + ``CenterCrop(224)``) and the ImageNet normalisation.
_CIFAR_INPUT = InputCard(name="image", shape=(3, 32, 32), colour="rgb", resize="stretch")
_IMAGENET_INPUT = InputCard(name="image", shape=(3, 224, 224), colour="rgb", resize="shorter-side-crop",
                            crop_ratio=224 / 256, interpolation="bilinear",
                            mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))


def _sdnet_card(description: str, imagenet: bool) -> dict[str, Any]:
    return dict(task=tasks.CLASSIFICATION, description=description, output="logits",
                input=_IMAGENET_INPUT if imagenet else _CIFAR_INPUT,
                labels=None if imagenet else CIFAR10_LABELS,  # ImageNet synset names are not bundled
                lam=LamCard(default=None, max=10.0), data=dict(test="photos"),
                trt_profile=dict(batch=(1, 8, 32)))


register_model("sdnet18-cifar", input_shape=(3, 32, 32), checkpoint_loader=load_official_checkpoint,
               card=_sdnet_card("SDNet-18 for CIFAR-10: CSC stem + ResNet-18 (official checkpoint layout)",
                                False))(sdnet18_cifar)
register_model("sdnet18all-cifar", input_shape=(3, 32, 32), checkpoint_loader=load_official_checkpoint,
               defaults={"shortcut": True},
               card=_sdnet_card("SDNet-18-All for CIFAR-10: every 3×3 conv is a CSC layer (option "
                                "shortcut=True/False)", False))(sdnet18all_cifar)
register_model("sdnet18-imagenet", input_shape=(3, 224, 224), checkpoint_loader=load_official_checkpoint,
               card=_sdnet_card("SDNet-18 for ImageNet: 7×7 stride-2 CSC stem + ResNet-18", True))(sdnet18_imagenet)
register_model("sdnet34-imagenet", input_shape=(3, 224, 224), checkpoint_loader=load_official_checkpoint,
               card=_sdnet_card("SDNet-34 for ImageNet: 7×7 stride-2 CSC stem + ResNet-34", True))(sdnet34_imagenet)
