"""Five small digit classifiers on 1×28×28 (issue 27): the solver attentions and the Hamburger beside plain baselines.

Two skeletons, shared by the models that compare with each other, so that the solver layer is the one difference:

* :class:`DigitViT` — an RVT-style vision transformer (:mod:`unroll.models.rvt`): a convolutional stem (two 3×3
  stride-2 convs, 28² → 7², 49 tokens), one stage of RVT's pre-norm blocks (LayerNorm → attention → LayerNorm →
  RVT's convolutional MLP on the 7×7 token grid, both residual), global average pooling, LayerNorm and a linear
  head, as RVT reads out. No position embedding: RVT has none (the MLP's depthwise 3×3 conv sees where a token is).
  The attention is RVT's softmax one (``vit-mnist``), the official VARS-D (:class:`~unroll.solvers.vars_attn.
  VARSAttention`, ``vars-vit-mnist``) or Dic-Attn (:class:`~unroll.solvers.dic_attn.DicAttention`,
  ``dic-vit-mnist``; it codes each token on its own, so the grid MLP is where its tokens meet, and the readout is
  the token mean, as in :mod:`unroll.models.dic_vit`).
* :class:`DigitCNN` — a residual CNN (the stem and :class:`~unroll.models.mnist._ResBlock` layers of ``sdnet-mnist``
  without its CSC front end, 28² → 14² → 7²), global average pooling and a linear head: ``cnn-mnist``; with
  Hamburger's block (:class:`~unroll.models.hamnet.Hamburger`: ``ham_in`` → NMF → ``ham_out`` + BN, residual)
  on the 7×7 map before the pooling: ``ham-cnn-mnist``, its NMF with seeded constant bases (the serving policy).

The weight-tied solvers run one iteration count each (every tied layer of a model the same, so ``iters=K`` can
change it: :mod:`unroll.solvers.iterations`): VARS-D and Dic-Attn 3 ISTA steps, the NMF 6 multiplicative updates
in training and in evaluation (the official Hamburger trains with 6 and evaluates with 7; one count here, so the
served default is the trained one). Their cards list the counts served per request.

Trained by :mod:`unroll.train.digits` (``unroll train NAME``); weights in ``unroll/weights/NAME.pt``.
"""

from __future__ import annotations

from typing import Any, Literal

from torch import Tensor, nn

from unroll import tasks
from unroll.card import InputCard, IterCard, OodCard
from unroll.models.dic_vit import _refresh_after_load
from unroll.models.hamnet import Hamburger
from unroll.models.mnist import _ResBlock
from unroll.models.rvt import Block, Stage
from unroll.registry import register_model
from unroll.solvers.dic_attn import DicAttention

Attention = Literal["softmax", "vars-d", "dic"]
#: 28² → 7² through two stride-2 convolutions.
SIDE = 7


class DigitViT(nn.Module):
    """RVT-style ViT on ``[B, 1, 28, 28]`` in [0, 1] → logits ``[B, 10]`` (module docstring).

    ``n_steps`` is the ISTA step count of VARS-D (its ``num_step``) or Dic-Attn; ``lam`` VARS's λ; ``num_atoms``,
    ``beta``, ``mu`` Dic-Attn's dictionary size and elastic-net weights.
    """

    input_size = (1, 28, 28)
    num_classes = 10

    def __init__(self, attention: Attention = "softmax", dim: int = 64, depth: int = 3, heads: int = 2,
                 mlp_ratio: int = 2, n_steps: int = 3, lam: float = 0.3, num_atoms: int = 96, beta: float = 0.1,
                 mu: float = 0.1, seed: int = 0) -> None:
        super().__init__()
        if attention not in ("softmax", "vars-d", "dic"):
            raise ValueError(f"attention must be 'softmax', 'vars-d' or 'dic', got {attention!r}")
        self.attention = attention
        self.stem = nn.Sequential(nn.Conv2d(1, dim // 2, 3, stride=2, padding=1, bias=False),
                                  nn.BatchNorm2d(dim // 2), nn.GELU(),
                                  nn.Conv2d(dim // 2, dim, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(dim))
        vars_options: dict[str, Any] = dict(num_step=n_steps, lam=lam) if attention == "vars-d" else {}
        blocks = []
        for i in range(depth):
            blk = Block(dim, heads, SIDE, "softmax" if attention == "dic" else attention, False, mlp_ratio,
                        **vars_options)
            if attention == "dic":  # RVT's block around Dic-Attn (a dictionary seed per block, so blocks differ)
                blk.attn = DicAttention(dim, num_atoms=num_atoms, n_steps=n_steps, beta=beta, mu=mu, seed=seed + i)
            blocks.append(blk)
        self.stage = Stage(blocks, SIDE)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, self.num_classes)
        if attention == "dic":  # L of every Dic-Attn layer follows its loaded atoms (outside forward)
            self.register_load_state_dict_post_hook(_refresh_after_load)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stage(self.stem(x))
        return self.head(self.norm(x.mean(dim=(2, 3))))


class DigitCNN(nn.Module):
    """Residual CNN on ``[B, 1, 28, 28]`` in [0, 1] → logits ``[B, 10]``, optionally with a Hamburger (NMF) block.

    ``rank`` and ``n_steps`` are the NMF's rank and update count (training and evaluation alike).
    """

    input_size = (1, 28, 28)
    num_classes = 10

    def __init__(self, width: int = 24, ham: bool = False, rank: int = 8, n_steps: int = 6) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = _ResBlock(width, 2 * width, 2)
        self.layer2 = _ResBlock(2 * width, 3 * width, 2)
        self.hamburger = (Hamburger(3 * width, norm="bn", rank=rank, train_steps=n_steps, eval_steps=n_steps)
                          if ham else nn.Identity())
        self.dropout = nn.Dropout(0.2)
        self.linear = nn.Linear(3 * width, self.num_classes)

    def forward(self, x: Tensor) -> Tensor:
        out = self.hamburger(self.layer2(self.layer1(self.stem(x))))
        return self.linear(self.dropout(out.mean(dim=(2, 3))))


def parameter_count(model: nn.Module) -> int:
    """Learned parameters (VARS's fixed random features and official unused ``L`` are not learned)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ---------------------------------------------------------------------------------------------- registry
_DIGITS = dict(task=tasks.CLASSIFICATION, output="logits", labels=tuple(str(i) for i in range(10)),
               input=InputCard(name="image", shape=(1, 28, 28), colour="gray", resize="pad-square",
                               polarity="light-on-dark"),
               data=dict(train="mnist-train", validation="mnist-validation", test="mnist-test", gate="validation"))
RECIPE = "unroll.train.digits"


def _register(name: str, build, description: str, defaults: dict, served: tuple[int, ...] | None = None,
              ood: bool = False) -> None:
    card = {**_DIGITS, "description": description, **({"iters": IterCard(served=served)} if served else {}),
            **({"ood": OodCard()} if ood else {})}
    # trained for the robustness comparison: `unroll serve` serves them when named, not by default
    register_model(name, input_shape=(1, 28, 28), recipe=RECIPE, defaults=defaults, card=card,
                   served_by_default=False)(build)


def digit_vit(**kw: Any) -> DigitViT:
    return DigitViT(**kw)


def digit_cnn(**kw: Any) -> DigitCNN:
    return DigitCNN(**kw)


_register("vars-vit-mnist", digit_vit, "RVT-style digit ViT (49 tokens, 3 blocks, 64 wide) with the official VARS-D "
          "attention (3 learned ISTA steps, trained demo)", {"attention": "vars-d"}, served=(1, 2, 3, 5),
          ood=True)  # the first attention's sparse reconstruction (Dic-Attn's separates less than its softmax: ood.md)
_register("dic-vit-mnist", digit_vit, "RVT-style digit ViT (49 tokens, 3 blocks, 64 wide) with Dic-Attn (3 elastic-net "
          "ISTA steps over 96 atoms, trained demo)", {"attention": "dic"}, served=(1, 2, 3, 5))
_register("vit-mnist", digit_vit, "RVT-style digit ViT (49 tokens, 3 blocks, 64 wide) with softmax attention: the "
          "transformer baseline (trained demo)", {"attention": "softmax"})
_register("ham-cnn-mnist", digit_cnn, "residual digit CNN with a Hamburger block (NMF rank 8, 6 updates, seeded "
          "bases) on its 7×7 map (trained demo)", {"ham": True}, served=(2, 4, 6, 10),
          ood=True)  # the NMF's residual and coefficients' size (ood.md)
_register("cnn-mnist", digit_cnn, "residual digit CNN: the convolutional baseline (trained demo)", {"ham": False})

__all__ = ["DigitCNN", "DigitViT", "parameter_count"]
