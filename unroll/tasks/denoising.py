"""Image denoising: ``forward(noisy, sigma)`` → an image of the same size, gated on PSNR, served as a PNG."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unroll.data import add_noise, noise_seed
from unroll.tasks.base import ModelCard, Route, Task, register

if TYPE_CHECKING:
    import numpy as np

NAME = "denoising"
#: Noise level (0–255 scale) of the banner's denoising samples and their ``curl`` lines.
SAMPLE_SIGMA = 25.0


class Denoising(Task):
    """A noise-level input (``card.sigma``), noisy-image data, PSNR gates and a PNG answer."""

    def check(self, card: ModelCard) -> None:
        if card.sigma is None:
            raise ValueError("a denoising card needs sigma (its noise-level input)")

    def card_defaults(self, shape: tuple[int, ...]) -> dict[str, Any]:
        return {"sigma": {"input": "sigma"}}

    def listing(self, card: ModelCard, output_shape: tuple[int, ...]) -> dict[str, Any]:
        return {"params": {"sigma": "0…255 (omit to estimate)"}}

    def sample(self, card: ModelCard, image: np.ndarray, label: int | None, out: Path) -> np.ndarray:
        return add_noise(image, SAMPLE_SIGMA, noise_seed(card.name, SAMPLE_SIGMA))

    def banner(self, base: str, card: ModelCard, sample: Path, auth: str) -> list[str]:
        post = f"  curl{auth} --data-binary {shlex.quote(f'@{sample}')} -H 'Content-Type: image/png'"
        url = f"{base}/v1{self.route.path}?model={card.name}"
        return [f"{post} '{url}&sigma={SAMPLE_SIGMA:g}' -o denoised.png",
                f"{post} '{url}' -D - -o denoised.png   # σ estimated: see X-Sigma-Used"]


TASK = register(Denoising(
    name=NAME, description="noisy image, σ → clean image",
    gates={"fp32": {"psnr_loss_db": 0.01}, "fp16": {"psnr_loss_db": 0.02}, "int8": {"psnr_loss_db": 0.15}},
    metrics=("psnr_loss_db", "psnr_loss_db_worst"), data="noisy", same_shape_output=True,
    io=("noisy", "denoised"), image_input=True, cpu_max_batch=4, order=1,
    route=Route("/denoise", "image", "denoiser", "Denoise an image (PNG of the same size and mode)",
                setting="denoise_models", sigma=True)))
