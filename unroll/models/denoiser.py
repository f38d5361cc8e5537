"""``csc-denoiser``: a noise-level-aware convolutional sparse-coding denoiser (CDLNet/CSCNet style).

The encoder unrolls ``n_steps`` LISTA iterations of convolutional sparse coding with a *stride-2*
dictionary and untied analysis/synthesis filters per iteration:

    z ← shrink(z − A_k(B_k z − y), τ_k(σ)),   τ_k(σ) = relu(a_k + b_k·σ/σ_ref)   (per atom)

and the decoder is the synthesis ``x̂ = D z``. Thresholds scale with the given noise level σ, so one
model serves σ ∈ [0, 50] (0–255 scale).

A stride-2 convolution with ``2k×2k`` atoms is computed exactly as a stride-1 ``k×k`` convolution on
the image's four polyphase components (``pixel_unshuffle``), and the stride-2 synthesis as a stride-1
convolution followed by ``pixel_shuffle``. Same dictionary, far better kernels on CPUs and GPUs.

The synthesis convolutions (``M`` codes → 4 polyphase channels) are written differently in PyTorch and
in the exported graph. PyTorch runs them as ``conv2d`` (oneDNN is fast at it). In an ONNX export they
are the same linear map written as a ``ConvTranspose`` with the adjoint weight (swap in/out, flip the
kernel): ONNX Runtime's CPU convolution (NCHWc) pads a 4-channel output to its 16-channel block and
runs 4× the arithmetic, while its ``ConvTranspose`` is one GEMM (``[4·k², M] × [M, pixels]``) and a
col2im: the whole graph ran 1.37× faster on ONNX Runtime 1.32 at 256² and 512² (2 threads; the README's Speed
section has the numbers). OpenVINO, the runtime this model's card picks, runs both forms at the same speed.
Exact up to float summation order; the export's parity check covers it.

The image mean is removed first (the dictionary codes the zero-mean part) and the input is
reflect-padded so borders are coded like the interior. Grayscale by design: colour images are
denoised per channel (the gateway sends the channels as one batch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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


class CSCDenoiser(nn.Module):
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
        """``conv2d(z, w)`` with ``w`` ``[4, M, k, k]`` (codes → polyphase image); as ``ConvTranspose`` with
        the adjoint weight when exporting to ONNX (see the module docstring), unless in textbook mode."""
        if torch.onnx.is_in_onnx_export() and not is_textbook():
            return F.conv_transpose2d(z, w.transpose(0, 1).flip(-1, -2), padding=self.padding)
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
        task="denoising",
        description="Noise-level-aware convolutional LISTA denoiser, stride-2 dictionary (trained demo, grayscale)",
        input=InputCard(name="noisy", shape=(1, -1, -1), min_size=16, colour="gray"),
        output="denoised", sigma=SigmaCard(),
        data=dict(train="denoise-train", validation="denoise-validation", test="denoise-test", stress="denoise-stress",
                  gate="validation"),
        gates={"fp16": {"psnr_loss_db_worst": 0.02}, "int8": {"psnr_loss_db_worst": 0.15}},
        trt_profile=dict(batch=(1, 4, 8), dims={"1": (16, 256, 1024), "2": (16, 256, 1024)}),
        # OpenVINO runs this graph 1.15-1.26x faster than ONNX Runtime at 256-512 px on 2 threads
        # (benchmarks/results/export_speed.md, `unroll bench export`: the "served" column)
        cpu_runtime="openvino",
        # Receptive radius 17 px (4 LISTA steps + decoder of 3×3 convs on the stride-2 phase grid; measured by
        # tests/test_tiling.py), so 20 px of margin; the mean removal makes it mean-centred. 448-px windows: a
        # batch of 4 stays near 0.4 GiB of runtime memory on the CPU target.
        tiling=TileCard(size=448, margin=20, align=STRIDE, mean_centred=True),
    ))
def csc_denoiser(**kw) -> CSCDenoiser:
    return CSCDenoiser(**kw)
