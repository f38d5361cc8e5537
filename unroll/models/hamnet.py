"""HamNet's light decode head (Geng et al., ICLR 2021) with the official module and state-dict names.

Layout of the official ``LightHamHead`` (Gsunshine/Enjoy-Hamburger, ``seg_light_ham/mmseg/models/decode_heads/
ham_head.py``; configs ``seg_light_ham/configs/_base_/models/light_ham_van.py`` and ``configs/ham/
hamnet_light_van_*``), so the head of an official checkpoint loads with ``strict=True``::

    squeeze    ConvModule(sum(in_channels) → ham_channels, 1×1, norm, ReLU)
    hamburger  Hamburger: ham_in  ConvModule(1×1, with bias, no norm, no activation) → ReLU
                          ham     NMF2D (no parameters)                → here NMFHam, bases policy selectable
                          ham_out ConvModule(1×1, norm, no activation)
                          → ReLU(input + ham_out)
    align      ConvModule(ham_channels → channels, 1×1, norm, ReLU)
    cls_seg    dropout (Dropout2d) → conv_seg (1×1 conv, channels → num_classes)

mmcv's ``ConvModule`` names its parts ``conv``, then the norm by type (``gn`` for the configs' GroupNorm(32),
``bn`` for (Sync)BN) and gives the conv a bias only when there is no norm; :class:`ConvModule` reproduces that.

What the graph takes: the official head resizes the backbone levels it reads (``in_index``) to the first one's
size and concatenates them before ``squeeze``; the registered models take that concatenation ``[sum(in_channels),
H, W]`` (a feature map, so the task is ``block``) and return the head's per-pixel class logits ``[num_classes, H,
W]`` at the feature resolution (mmseg upsamples them to the image outside the head). :meth:`LightHamHead.
forward_levels` does the resize and concatenation for a list of levels, as the official ``forward``.

The one deviation: the official NMF draws random bases per sample at every call; here the NMF's bases policy is
``unroll.solvers.nmf.DEFAULT_BASES`` unless ``bases=`` says otherwise (see that module).
"""

from __future__ import annotations

from collections.abc import Sequence
from os import PathLike
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unroll import tasks
from unroll.card import InputCard
from unroll.checkpoints import load_strict, read_state_dict
from unroll.registry import register_model
from unroll.solvers.nmf import DEFAULT_BASES, BasesPolicy, NMFHam

Norm = Literal["gn", "bn"]
#: The configs' ``ham_norm_cfg``: GroupNorm with 32 groups.
GN_GROUPS = 32
#: mmseg's prefix of the decode head in a whole-segmentor (``EncoderDecoder``) checkpoint.
HEAD_PREFIX = "decode_head."


class GroupNorm(nn.GroupNorm):
    """``nn.GroupNorm`` (same parameters and names) written out in plain ops: ``F.group_norm`` checks the batch size
    with a Python ``if`` on traced sizes, which the exporter's static-graph check rightly refuses."""

    def forward(self, x: Tensor) -> Tensor:
        g = x.reshape(x.shape[0], self.num_groups, -1)
        mean = g.mean(dim=-1, keepdim=True)
        var = (g - mean).square().mean(dim=-1, keepdim=True)
        y = ((g - mean) / torch.sqrt(var + self.eps)).reshape(x.shape)
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return y * self.weight.reshape(shape) + self.bias.reshape(shape) if self.affine else y


class ConvModule(nn.Module):
    """mmcv ``ConvModule`` as the head uses it: ``conv`` (bias only without a norm) → norm (``gn``/``bn``) → ReLU."""

    def __init__(self, in_channels: int, out_channels: int, norm: Norm | None = "gn", act: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 1, bias=norm is None)
        self.norm_name = norm
        if norm == "gn":
            self.gn = GroupNorm(GN_GROUPS, out_channels)
        elif norm == "bn":
            self.bn = nn.BatchNorm2d(out_channels)
        elif norm is not None:
            raise ValueError(f"norm={norm!r}: the head's configs use 'gn' (GroupNorm(32)) or 'bn' (SyncBN)")
        self.activate = nn.ReLU() if act else None

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv(x)
        if self.norm_name is not None:
            x = getattr(self, self.norm_name)(x)
        return self.activate(x) if self.activate is not None else x


class Hamburger(nn.Module):
    """``ham_in`` (1×1 conv) → ReLU → NMF ``ham`` → ``ham_out`` (1×1 conv + norm), added to the input, ReLU."""

    def __init__(self, ham_channels: int = 512, norm: Norm = "gn", rank: int = 64, train_steps: int = 6,
                 eval_steps: int = 7, bases: BasesPolicy = DEFAULT_BASES, bases_seed: int = 0) -> None:
        super().__init__()
        self.ham_in = ConvModule(ham_channels, ham_channels, norm=None, act=False)
        # persistent=False: the official NMF2D has no state, so its checkpoints carry no bases.
        self.ham = NMFHam(ham_channels, rank=rank, train_steps=train_steps, eval_steps=eval_steps, seed=bases_seed,
                          bases=bases, persistent=False)
        self.ham_out = ConvModule(ham_channels, ham_channels, norm=norm, act=False)

    def forward(self, x: Tensor) -> Tensor:
        enjoy = torch.relu(self.ham_in(x))
        enjoy = self.ham_out(self.ham(enjoy))
        return torch.relu(x + enjoy)


class LightHamHead(nn.Module):
    """The official light Hamburger decode head (module docstring): features ``[B, sum(in_channels), H, W]`` →
    class logits ``[B, num_classes, H, W]``."""

    def __init__(self, in_channels: Sequence[int] = (64, 160, 256), ham_channels: int = 480, channels: int = 512,
                 num_classes: int = 150, norm: Norm = "gn", dropout_ratio: float = 0.1, align_corners: bool = False,
                 rank: int = 64, train_steps: int = 6, eval_steps: int = 7, bases: BasesPolicy = DEFAULT_BASES,
                 bases_seed: int = 0) -> None:
        super().__init__()
        self.in_channels, self.align_corners = tuple(in_channels), align_corners
        # mmseg's BaseDecodeHead: classifier and dropout first, then the head's own layers
        self.conv_seg = nn.Conv2d(channels, num_classes, 1)
        self.dropout = nn.Dropout2d(dropout_ratio) if dropout_ratio > 0 else None
        self.squeeze = ConvModule(sum(self.in_channels), ham_channels, norm=norm)
        self.hamburger = Hamburger(ham_channels, norm, rank, train_steps, eval_steps, bases, bases_seed)
        self.align = ConvModule(ham_channels, channels, norm=norm)

    def cls_seg(self, x: Tensor) -> Tensor:
        """mmseg's classifier: dropout, then the 1×1 ``conv_seg``."""
        return self.conv_seg(self.dropout(x) if self.dropout is not None else x)

    def forward(self, x: Tensor) -> Tensor:
        return self.cls_seg(self.align(self.hamburger(self.squeeze(x))))

    def forward_levels(self, levels: Sequence[Tensor]) -> Tensor:
        """The official ``forward`` from the selected backbone levels: each resized (bilinear) to the first's
        H×W, concatenated over channels, then :meth:`forward`."""
        size = levels[0].shape[2:]
        x = torch.cat([F.interpolate(t, size=size, mode="bilinear", align_corners=self.align_corners)
                       for t in levels], dim=1)
        return self.forward(x)


def load_official_checkpoint(model: LightHamHead, path: str | PathLike[str]) -> LightHamHead:
    """Load an official head checkpoint into ``model`` strictly and return it.

    Accepts a bare state dict, ``{"state_dict": …}`` (mmseg/mmcv) or ``{"model": …}``, with or without a
    DataParallel ``module.`` prefix. In a whole-segmentor checkpoint the head's keys start with ``decode_head.``:
    those are taken and the rest (``backbone.``, an ``auxiliary_head.``) is left out, since this model is the head
    alone. A checkpoint trained with ``RAND_INIT=False`` stores its warm bases as ``hamburger.ham.bases``
    ``[1, D, R]``: they become the NMF's stored start. Any other missing, unexpected or misshapen key is an error
    naming every one.
    """
    state = read_state_dict(path)
    if any(k.startswith(HEAD_PREFIX) for k in state):
        state = {k.removeprefix(HEAD_PREFIX): v for k, v in state.items() if k.startswith(HEAD_PREFIX)}
    ham = model.hamburger.ham
    warm = state.pop("hamburger.ham.bases", None)
    if warm is not None and warm.numel() != ham.bases.numel():
        raise ValueError(f"{path}: hamburger.ham.bases has shape {list(warm.shape)}, the model's NMF needs "
                         f"[1, {ham.dim}, {ham.rank}]")
    load_strict(model, state, path)
    if warm is not None:
        with torch.no_grad():
            ham.bases.copy_(warm.reshape(ham.bases.shape))
    return model


# ---------------------------------------------------------------------------------------------- registry
#: Official configs (``seg_light_ham/configs/ham/hamnet_light_van_{tiny,small}_512x512_160k_ade20k.py``):
#: VAN levels 1–3 of the backbone, 150 ADE20K classes.
_CONFIGS = {
    "tiny": dict(in_channels=(64, 160, 256), ham_channels=480, channels=512, num_classes=150),
    "small": dict(in_channels=(128, 320, 512), ham_channels=512, channels=512, num_classes=150),
}


def _card(variant: str) -> dict:
    cfg = _CONFIGS[variant]
    c = sum(cfg["in_channels"])
    return dict(task=tasks.BLOCK, output="logits", input=InputCard(name="x", shape=(c, -1, -1), min_size=2),
                trt_profile=dict(batch=(1, 4, 16), dims={"1": (8, 64, 128), "2": (8, 64, 128)}),
                description=(f"HamNet light head (VAN-{variant}, ADE20K): official LightHamHead layout, NMF "
                             f"rank 64 with {DEFAULT_BASES} bases; concatenated features [{c}, H, W] → "
                             f"{cfg['num_classes']} class logits"))


def _register(variant: str) -> None:
    def build(**kw) -> LightHamHead:
        return LightHamHead(**kw)

    build.__name__ = f"hamnet_light_{variant}"
    register_model(f"hamnet-light-{variant}", input_shape=(sum(_CONFIGS[variant]["in_channels"]), 32, 32),
                   defaults=dict(_CONFIGS[variant]), checkpoint_loader=load_official_checkpoint,
                   card=_card(variant))(build)


for _variant in _CONFIGS:
    _register(_variant)

__all__ = ["ConvModule", "Hamburger", "LightHamHead", "load_official_checkpoint"]
