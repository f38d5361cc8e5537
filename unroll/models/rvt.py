"""RVT vision transformers (Mao et al., CVPR 2022) as the VARS paper ships them, with the official state-dict keys.

The official code (bfshi/VARS, commit 651eb517: ``robust_models.py``, ``vars_block.py``) builds a
``PoolingTransformer``: a convolutional stem (``patch_embed.proj``: 7×7/2 conv, BN, 3×3/2 max-pool, 4×4/4 conv),
stages of pre-norm blocks (``transformers.S.blocks.i``: LayerNorm → attention → LayerNorm → MLP, both residual)
joined by depthwise stride-2 pooling convs (``pools.S.conv``), global average pooling, LayerNorm and a linear
head. The attention is plain softmax (``rvt-*``), VARS-D or VARS-SD (``rvt-*-vars-d`` / ``-vars-sd``,
:mod:`unroll.solvers.vars_attn`). Its MLP is the official one: 1×1 conv, BN, GELU, depthwise 3×3 conv, BN,
GELU, 1×1 conv, BN on the token grid — except when the width is exactly 768 (RVT-Base), where the official code
uses a plain two-layer Linear MLP. ``-plus`` variants add the learned attention mask ``att_mask``
``[heads, 196, 196]`` to the first ``masked_block`` blocks (softmax: logits × sigmoid(mask); VARS declares it
and its forward does not use it, as officially).

Deviations, all value-preserving: the feature-map sizes are fixed at construction (the input is 224², as the
official model assumes), so the graph reads no shapes; the pooled features are flattened rather than
``squeeze()``-d, so a batch of one keeps its batch axis.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn

from unroll import tasks
from unroll.card import InputCard
from unroll.checkpoints import load_strict, read_state_dict
from unroll.registry import register_model
from unroll.solvers.vars_attn import VARSAttention

Attention = Literal["softmax", "vars-d", "vars-sd"]
#: Official configurations (``robust_models.py``): base_dims, depth, heads, masked_block of the ``_plus`` variant.
ARCHS: dict[str, dict[str, Any]] = {
    "tiny": dict(base_dims=(32, 32), depth=(10, 2), heads=(6, 12), masked_block=10),
    "small": dict(base_dims=(64,), depth=(12,), heads=(6,), masked_block=5),
    "base": dict(base_dims=(64,), depth=(12,), heads=(12,), masked_block=5),
}
IMAGE_SIZE, PATCH = 224, 16
#: The official token count of the masked stage (``att_mask`` is [heads, 196, 196]).
MASK_TOKENS = 196


class SoftmaxAttention(nn.Module):
    """Official ``Attention``: ``qkv`` (dim → 3·dim), scaled dot product, softmax, ``proj``; optional ``att_mask``."""

    def __init__(self, dim: int, num_heads: int, use_mask: bool = False) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        if use_mask:
            self.att_mask = nn.Parameter(torch.zeros(num_heads, MASK_TOKENS, MASK_TOKENS))

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, self.head_dim)).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        if hasattr(self, "att_mask"):
            attn = attn * torch.sigmoid(self.att_mask)
        return self.proj((attn.softmax(dim=-1) @ v).transpose(1, 2).flatten(2))


class Mlp(nn.Module):
    """Official RVT MLP: convolutional on the ``side × side`` token grid, or two Linear layers at width 768."""

    def __init__(self, dim: int, hidden: int, side: int) -> None:
        super().__init__()
        self.linear, self.side = dim == 768, side
        self.act = nn.GELU()
        if self.linear:
            self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        else:
            self.fc1 = nn.Conv2d(dim, hidden, 1)
            self.bn1 = nn.BatchNorm2d(hidden)
            self.dwconv = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden)
            self.bn2 = nn.BatchNorm2d(hidden)
            self.fc2 = nn.Conv2d(hidden, dim, 1)
            self.bn3 = nn.BatchNorm2d(dim)

    def forward(self, x: Tensor) -> Tensor:
        if self.linear:
            return self.fc2(self.act(self.fc1(x)))
        g = x.transpose(1, 2).unflatten(2, (self.side, self.side))
        g = self.act(self.bn1(self.fc1(g)))
        g = self.act(self.bn2(self.dwconv(g)))
        return self.bn3(self.fc2(g)).flatten(2).transpose(1, 2)


class Block(nn.Module):
    """Pre-norm transformer block (keys ``norm1``, ``attn``, ``norm2``, ``mlp``), LayerNorm eps 1e-6."""

    def __init__(self, dim: int, heads: int, side: int, attention: Attention, use_mask: bool,
                 mlp_ratio: int = 4, **vars_options: Any) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        if attention == "softmax":
            self.attn: nn.Module = SoftmaxAttention(dim, heads, use_mask)
        else:
            self.attn = VARSAttention(dim, heads, mode=attention.removeprefix("vars-"), num_tokens=side * side,
                                      use_mask=use_mask, **vars_options)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, dim * mlp_ratio, side)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Stage(nn.Module):
    """Official ``Transformer``: blocks on the flattened ``side × side`` grid (keys ``blocks.i``)."""

    def __init__(self, blocks: list[Block], side: int) -> None:
        super().__init__()
        self.blocks, self.side = nn.ModuleList(blocks), side

    def forward(self, x: Tensor) -> Tensor:
        x = x.flatten(2).transpose(1, 2)
        for blk in self.blocks:
            x = blk(x)
        return x.transpose(1, 2).unflatten(2, (self.side, self.side))


class HeadPooling(nn.Module):
    """Official ``conv_head_pooling``: a depthwise-grouped 3×3 stride-2 conv (key ``conv``)."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(dim_in, dim_out, kernel_size=3, padding=1, stride=2, groups=dim_in)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


class ConvEmbedding(nn.Module):
    """Official ``conv_embedding``: ``proj`` = 7×7/2 conv, BN, 3×3/2 max-pool, 4×4/4 conv (224² → 14²)."""

    def __init__(self, out_channels: int) -> None:
        super().__init__()
        self.proj = nn.Sequential(nn.Conv2d(3, 32, 7, stride=2, padding=2), nn.BatchNorm2d(32),
                                  nn.MaxPool2d(3, stride=2, padding=1), nn.Conv2d(32, out_channels, 4, stride=4))

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x)


class RVT(nn.Module):
    """The official ``PoolingTransformer`` (eval-mode maths; dropout and drop-path are identities at inference)."""

    def __init__(self, base_dims: tuple[int, ...], depth: tuple[int, ...], heads: tuple[int, ...],
                 attention: Attention = "softmax", num_classes: int = 1000, use_mask: bool = False,
                 masked_block: int = 0, mlp_ratio: int = 4, arch: str = "rvt", **vars_options: Any) -> None:
        super().__init__()
        if attention not in ("softmax", "vars-d", "vars-sd"):
            raise ValueError(f"attention must be 'softmax', 'vars-d' or 'vars-sd', got {attention!r}")
        self.arch, self.num_classes = arch, num_classes
        dims = [b * h for b, h in zip(base_dims, heads, strict=True)]
        self.patch_embed = ConvEmbedding(dims[0])
        self.transformers, self.pools = nn.ModuleList(), nn.ModuleList()
        for s, (n, h) in enumerate(zip(depth, heads, strict=True)):
            side = IMAGE_SIZE // (PATCH * 2 ** s)
            masked = use_mask and s == 0  # the official mask is on the first stage only
            self.transformers.append(Stage([Block(dims[s], h, side, attention, masked and i < masked_block,
                                                  mlp_ratio, **vars_options) for i in range(n)], side))
            if s < len(depth) - 1:
                self.pools.append(HeadPooling(dims[s], dims[s + 1]))
        self.norm = nn.LayerNorm(dims[-1], eps=1e-6)
        self.head = nn.Linear(dims[-1], num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x)
        for stage, pool in zip(self.transformers, self.pools, strict=False):
            x = pool(stage(x))
        x = self.transformers[-1](x)
        return self.head(self.norm(x.mean(dim=(2, 3))))


def rvt_name(size: str, plus: bool, attention: Attention) -> str:
    """The registered name: ``rvt-<size>[-plus][-vars-d|-vars-sd]`` (softmax has no suffix)."""
    return f"rvt-{size}{'-plus' if plus else ''}{'' if attention == 'softmax' else '-' + attention}"


def build(size: str, attention: Attention = "softmax", plus: bool = False, **kw: Any) -> RVT:
    """``rvt_<size>[_plus]`` with the given attention; ``kw`` overrides the configuration or VARS options."""
    cfg = {**ARCHS[size], **kw}
    masked_block = cfg.pop("masked_block")
    return RVT(attention=attention, use_mask=plus, masked_block=masked_block, arch=rvt_name(size, plus, attention),
               **cfg)


def load_official_checkpoint(model: nn.Module, path: Any) -> nn.Module:
    """Load an official VARS/RVT checkpoint (``{"model": …}`` or a bare state dict, ``module.`` or not) strictly."""
    load_strict(model, read_state_dict(path), path)
    return model


# ---------------------------------------------------------------------------------------------- registry
#: The official evaluation transform (timm's for RVT/DeiT: crop_pct 0.875, bicubic) and ImageNet normalisation.
IMAGENET_BICUBIC = InputCard(name="image", shape=(3, IMAGE_SIZE, IMAGE_SIZE), colour="rgb",
                             resize="shorter-side-crop", crop_ratio=224 / 256, interpolation="bicubic",
                             mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
_ATTENTION_TEXT = {"softmax": "softmax attention", "vars-d": "VARS-D attention (5 learned ISTA steps)",
                   "vars-sd": "VARS-SD attention (VARS-D + learned static atoms)"}


def _register(size: str, plus: bool, attention: Attention) -> None:
    name = rvt_name(size, plus, attention)
    card = dict(task=tasks.CLASSIFICATION, output="logits", input=IMAGENET_BICUBIC, labels=None,
                data=dict(train="photo-crops-calibration", validation="photo-crops-validation", test="photos",
                          gate="validation"), trt_profile=dict(batch=(1, 8, 32)),
                description=f"RVT-{size.capitalize()}{'*' if plus else ''} with {_ATTENTION_TEXT[attention]}; "
                            "official VARS checkpoints load (checkpoint=PATH)")
    register_model(name, input_shape=(3, IMAGE_SIZE, IMAGE_SIZE), checkpoint_loader=load_official_checkpoint,
                   defaults={"size": size, "attention": attention, "plus": plus}, card=card)(build)


for _size in ARCHS:
    for _plus in (False, True):
        for _attention in ("softmax", "vars-d", "vars-sd"):
            _register(_size, _plus, _attention)
