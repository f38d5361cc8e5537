"""``csc-denoiser``: a noise-level-aware convolutional sparse-coding denoiser (CDLNet/CSCNet style).

The encoder unrolls ``n_steps`` LISTA iterations with a stride-2 dictionary and untied analysis/synthesis filters,
``z ← shrink(z − A_k(B_k z − y), τ_k(σ))`` with ``τ_k(σ) = relu(a_k + b_k·σ/σ_ref)`` per atom, so one model serves
every σ up to 50 (0–255 scale); the decoder is ``x̂ = D z``. Stride-2 convolutions run as stride-1 ones on the four
polyphase components (same dictionary, better kernels). In ONNX the synthesis (96 codes → 4 phases) is written in
*taps* form: one 1×1 convolution to the 4·k² per-tap products, then k² shifted slices summed. Runtimes run a
4-channel-output 3×3 convolution far below their peak (its output fills a quarter of a 16-channel vector block);
the 1×1 convolution runs near it and the shifted sums fuse into one elementwise kernel, which OpenVINO with static
shapes, the served runtime, runs faster (``unroll optimize csc-denoiser`` measures every runtime on it). Grayscale
by design: the gateway sends colour channels as one batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unroll import tasks
from unroll.card import InputCard, SigmaCard, TileCard
from unroll.registry import register_model
from unroll.solvers.csc import normalize_atoms
from unroll.solvers.shrink import is_textbook, soft_threshold

#: σ (0–1 scale) is divided by this before entering the threshold affine map, for conditioning.
SIGMA_REF = 50.0 / 255.0
STRIDE = 2


@torch.no_grad()
def _lipschitz(atoms: Tensor, size: int = 48, iters: int = 50) -> float:
    """Largest eigenvalue of DᵀD for a stride-1 conv dictionary ``atoms`` ``[M, C, k, k]``."""
    p = atoms.shape[-1] // 2
    x = torch.randn(1, atoms.shape[1], size, size, generator=torch.Generator().manual_seed(0))
    eig = 0.0
    for _ in range(iters):
        x = x / x.norm()
        y = F.conv_transpose2d(F.conv2d(x, atoms, padding=p), atoms, padding=p)
        eig = float((x * y).sum())
        x = y
    return eig


def conv_by_taps(x: Tensor, w: Tensor, out_ch: int, k: int, padding: int) -> Tensor:
    """``conv2d(x, w, padding=padding)`` for ``w`` ``[out_ch, C, k, k]`` (given as ints: the tracer makes shapes
    tensors), as a 1×1 convolution to every (tap, output channel) product followed by the sum of the taps'
    shifted windows. Exact up to summation order."""
    taps = F.conv2d(x, w.permute(2, 3, 0, 1).reshape(k * k * out_ch, -1, 1, 1))  # channel (ky·k + kx)·O + o
    taps = F.pad(taps, (padding,) * 4)
    h, wd = taps.shape[-2] - k + 1, taps.shape[-1] - k + 1
    out = taps[:, :out_ch, :h, :wd]
    for t in range(1, k * k):
        ky, kx = divmod(t, k)
        out = out + taps[:, t * out_ch:(t + 1) * out_ch, ky:ky + h, kx:kx + wd]
    return out


class CSCDenoiser(nn.Module):
    #: Each LISTA step has its own learned filters and thresholds: no other iteration count without retraining.
    untied_steps = True

    def __init__(
        self, num_atoms: int = 96, kernel_size: int = 3, n_steps: int = 4, border: int = 8, seed: int = 0,
    ) -> None:
        super().__init__()
        if kernel_size % 2 != 1:
            raise ValueError("kernel_size (on the polyphase grid) must be odd")
        self.num_atoms, self.kernel_size, self.n_steps, self.border = num_atoms, kernel_size, n_steps, border
        self.padding = kernel_size // 2
        phases = STRIDE * STRIDE
        gen = torch.Generator().manual_seed(seed)
        d = normalize_atoms(torch.randn(num_atoms, phases, kernel_size, kernel_size, generator=gen))
        d = d / _lipschitz(d) ** 0.5  # so one LISTA step with A = Dᵀ, B = D is exactly an ISTA step
        analysis = d  # conv2d weight: image (4 phases) → codes (Dᵀ)
        synthesis = d.transpose(0, 1).flip(-1, -2).contiguous()  # conv2d weight: codes → image (D)
        self.analysis = nn.Parameter(analysis.repeat(n_steps, 1, 1, 1, 1))
        self.synthesis = nn.Parameter(synthesis.repeat(n_steps, 1, 1, 1, 1))
        self.decoder = nn.Parameter(synthesis.clone())
        self.tau_bias = nn.Parameter(torch.full((n_steps, num_atoms), 1e-3))
        self.tau_slope = nn.Parameter(torch.full((n_steps, num_atoms), 0.02))

    def _conv(self, x: Tensor, w: Tensor) -> Tensor:
        return F.conv2d(x, w, padding=self.padding)

    def _synthesize(self, z: Tensor, w: Tensor) -> Tensor:
        """``conv2d(z, w)`` with ``w`` ``[4, M, k, k]`` (codes → polyphase image); in taps form when exporting to
        ONNX (see the module docstring), unless in textbook mode."""
        if torch.onnx.is_in_onnx_export() and not is_textbook():
            return conv_by_taps(z, w, STRIDE * STRIDE, self.kernel_size, self.padding)
        return self._conv(z, w)

    def thresholds(self, sigma: Tensor) -> list[Tensor]:
        """τ_k(σ) per step, ``[B, M, 1, 1]`` each."""
        level = (sigma / SIGMA_REF).reshape(-1, 1, 1, 1)
        return [torch.relu(self.tau_bias[k].view(1, -1, 1, 1) + self.tau_slope[k].view(1, -1, 1, 1) * level)
                for k in range(self.n_steps)]

    def forward(self, noisy: Tensor, sigma: Tensor) -> Tensor:
        """Denoise ``noisy`` ``[B,1,H,W]`` (any H, W ≥ 16) given ``sigma`` ``[B]`` on the [0,1] scale."""
        h, w = noisy.shape[-2], noisy.shape[-1]
        b = self.border
        mean = noisy.mean(dim=(1, 2, 3), keepdim=True)
        # Pad with constants only (b each side, +1 bottom/right), then cut to even sizes: the cut uses
        # the traced input size, so the exported graph keeps height and width dynamic.
        y = F.pad(noisy - mean, (b, b + 1, b, b + 1), mode="reflect")
        y = y[..., : (h + 2 * b + 1) // STRIDE * STRIDE, : (w + 2 * b + 1) // STRIDE * STRIDE]
        y = F.pixel_unshuffle(y, STRIDE)
        taus = self.thresholds(sigma)
        z = soft_threshold(self._conv(y, self.analysis[0]), taus[0])
        for k in range(1, self.n_steps):
            z = soft_threshold(z - self._conv(self._synthesize(z, self.synthesis[k]) - y, self.analysis[k]), taus[k])
        out = F.pixel_shuffle(self._synthesize(z, self.decoder), STRIDE)
        return out[..., b:b + h, b:b + w] + mean


@register_model(
    "csc-denoiser", input_shape=(1, 64, 64), recipe="unroll.train.denoiser",
    card=dict(
        task=tasks.DENOISING,
        description="Noise-level-aware convolutional LISTA denoiser, stride-2 dictionary (trained demo, grayscale)",
        input=InputCard(name="noisy", shape=(1, -1, -1), min_size=16, colour="gray"),
        output="denoised", sigma=SigmaCard(),
        data=dict(train="denoise-train", calibration="denoise-calibration", validation="denoise-validation",
                  test="denoise-test", stress="denoise-stress", gate="validation"),
        gates={"fp16": {"psnr_loss_db_worst": 0.02}, "int8": {"psnr_loss_db_worst": 0.15}},
        trt_profile=dict(batch=(1, 4, 8), dims={"1": (16, 256, 1024), "2": (16, 256, 1024)}),
        # OpenVINO runs this graph faster than ONNX Runtime on CPUs: `unroll bench export` compares them
        # (benchmarks/results/export_speed.md, the "served" column)
        cpu_runtime="openvino",
        # its windows come in a few sizes (see tiling), so OpenVINO compiles each once (`unroll optimize` measures it)
        cpu_static_shapes=True,
        # Receptive radius 17 px (4 LISTA steps + decoder of 3×3 convs on the stride-2 phase grid; tests/test_tiling.py
        # checks it), so 20 px of margin; the mean removal makes it mean-centred. 448-px windows bound a batch's
        # runtime memory (`unroll bench memory` measures the whole service).
        tiling=TileCard(size=448, margin=20, align=STRIDE, mean_centred=True),
    ))
def csc_denoiser(**kw) -> CSCDenoiser:
    return CSCDenoiser(**kw)
