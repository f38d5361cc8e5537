"""``sdnet-mnist``: an SDNet-style classifier for 28×28 digits (CSC front end + small residual CNN).

The front end is SDNet's CSC layer (FISTA, K = 2, λ = 0.1, non-negative codes); its λ can be
overridden per sample at inference (``forward(x, lam)``), and :meth:`auto_lam` picks λ from the
front end's (median absolute) reconstruction error with the linear rule ``λ* = a·r + b`` fitted on noisy *training*
images (SDNet's robustness recipe). ``a``, ``b`` live in buffers so they travel with the weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unroll import tasks
from unroll.card import InputCard, IterCard, LamCard, OodCard
from unroll.registry import register_model
from unroll.solvers.csc import DictBlock, output_padding


class _ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class MNISTSDNet(nn.Module):
    input_size = (1, 28, 28)
    num_classes = 10

    def __init__(self, num_atoms: int = 32, lmbd: float = 0.1, n_steps: int = 2, width: int = 64) -> None:
        super().__init__()
        self.csc = DictBlock(1, num_atoms, kernel_size=3, stride=1, padding=1, lmbd=lmbd, n_steps=n_steps,
                             probe_size=28)
        self.bn0 = nn.BatchNorm2d(num_atoms)
        self.layer1 = _ResBlock(num_atoms, width, 2)
        self.layer2 = _ResBlock(width, 2 * width, 2)
        self.dropout = nn.Dropout(0.2)
        self.linear = nn.Linear(2 * width, self.num_classes)
        # λ*(r) = a·r + b, clamped to [lam_min, lam_max]; set by the robustness fit after training.
        self.register_buffer("lam_auto", torch.tensor([0.0, lmbd, lmbd, lmbd]))  # a, b, lam_min, lam_max

    def forward(self, x: Tensor, lam: Tensor | None = None) -> Tensor:
        out = self.bn0(self.csc(x, lam))
        out = self.layer2(self.layer1(out))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(self.dropout(out))

    def reconstruction_error(self, x: Tensor) -> Tensor:
        """Median absolute residual ``|x − D c|`` of the front end at its training λ, per sample ``[B]``.

        The median (not the RMS) ignores the few stroke pixels the sparse code models imperfectly and
        follows the noise on the background, so it separates noise levels cleanly (the λ rule is fitted on it).
        Computed with ``topk`` so it exports.
        """
        c = self.csc(x)
        blk = self.csc
        w = blk.weight if not blk.training else F.normalize(blk.weight.flatten(1), dim=1).view_as(blk.weight)
        recon = F.conv_transpose2d(c, w, stride=blk.stride, padding=blk.padding,
                                   output_padding=output_padding(blk.stride))
        res = (x - recon).abs().flatten(1)
        return res.topk(res.shape[1] // 2 + 1, dim=1).values[:, -1]

    def auto_lam(self, x: Tensor) -> Tensor:
        """Per-sample λ from the fitted rule λ* = a·r + b (``lam="auto"``)."""
        a, b, lo, hi = self.lam_auto
        return (a * self.reconstruction_error(x) + b).clamp(lo, hi)


@register_model(
    "sdnet-mnist", input_shape=(1, 28, 28), recipe="unroll.train.mnist",
    card=dict(
        task=tasks.CLASSIFICATION,
        description="SDNet-style MNIST classifier: CSC front end (FISTA K=2, λ=0.1) + residual CNN (trained demo)",
        input=InputCard(name="image", shape=(1, 28, 28), colour="gray", resize="pad-square", polarity="light-on-dark"),
        output="logits", labels=tuple(str(i) for i in range(10)),
        lam=LamCard(default=None, max=10.0, auto="sdnet-mnist-autolam"),
        iters=IterCard(served=(1, 2, 4, 8)),
        data=dict(train="mnist-train", validation="mnist-validation", test="mnist-test", gate="validation"),
        ood=OodCard(),  # the CSC front end's residual; its rule: `unroll bench ood`, kept in the training record
    ))
def sdnet_mnist(**kw) -> MNISTSDNet:
    return MNISTSDNet(**kw)
