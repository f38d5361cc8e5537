"""Training and evaluation of ``csc-denoiser`` on scikit-image's bundled images.

Patches come from the training images only (``unroll.data.DENOISE_TRAIN_IMAGES``); the held-out
images are used for evaluation alone. Runs on CPU or CUDA (``device``); everything is seeded.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from unroll import data
from unroll.models.denoiser import CSCDenoiser

EVAL_SIGMAS = (15.0, 25.0, 50.0)


class PatchSampler:
    """Random training patches, sampled on the training device in one gather per batch.

    The pool holds the training images plus 0.5× and 0.75× rescaled copies (more scales of texture),
    flattened into one buffer; each batch picks images ∝ area, offsets uniformly, and one of the 8
    dihedral transforms per eighth of the batch.
    """

    def __init__(self, patch: int, device: torch.device, gen: torch.Generator) -> None:
        imgs = []
        for img in data.denoise_train_set().values():
            t = torch.from_numpy(img)[None, None]
            imgs.append(t)
            for scale in (0.5, 0.75):
                if min(img.shape) * scale >= 2 * patch:
                    imgs.append(F.interpolate(t, scale_factor=scale, mode="bicubic", antialias=True,
                                              align_corners=False).clamp(0, 1))
        self.patch, self.device, self.gen = patch, device, gen
        self.flat = torch.cat([i.flatten() for i in imgs]).to(device)
        sizes = torch.tensor([i.numel() for i in imgs])
        self.start = torch.cumsum(sizes, 0) - sizes
        self.h = torch.tensor([i.shape[-2] for i in imgs])
        self.w = torch.tensor([i.shape[-1] for i in imgs])
        self.weights = sizes.double()
        ar = torch.arange(patch)
        self.grid_y, self.grid_x = ar.view(1, -1, 1), ar.view(1, 1, -1)

    def __call__(self, batch: int) -> torch.Tensor:
        g = self.gen
        idx = torch.multinomial(self.weights, batch, replacement=True, generator=g)
        y = (torch.rand(batch, generator=g) * (self.h[idx] - self.patch + 1)).long()
        x = (torch.rand(batch, generator=g) * (self.w[idx] - self.patch + 1)).long()
        w = self.w[idx].view(-1, 1, 1)
        rows = (y.view(-1, 1, 1) + self.grid_y) * w
        flat_idx = self.start[idx].view(-1, 1, 1) + rows + x.view(-1, 1, 1) + self.grid_x
        p = self.flat[flat_idx.to(self.device)].unsqueeze(1)
        chunks = p.chunk(8)
        out = [torch.rot90(c, k % 4, dims=(-2, -1)).flip(-1) if k >= 4 else torch.rot90(c, k, dims=(-2, -1))
               for k, c in enumerate(chunks)]
        return torch.cat(out)


def train_denoiser(
    steps: int = 20000, batch: int = 64, patch: int = 64, lr: float = 1e-3, sigma_max: float = 55.0,
    seed: int = 0, device: str = "cpu", minutes: float | None = None, balanced: bool = True,
    init: str | None = None, progress: Callable[[int, int, float], None] | None = None, **model_kw,
) -> tuple[CSCDenoiser, dict]:
    """Train on noisy patches, σ ~ U[0, sigma_max] (0–255), Adam + cosine decay.

    ``balanced`` weights each sample's MSE by ``1/(σ² + σ₀²)`` (σ₀ = 5/255) so that every noise level
    counts alike in PSNR terms (plain MSE lets the high-σ samples dominate). ``init`` fine-tunes from
    a saved state dict.

    ``minutes`` caps the wall time (the schedule is then stretched over the steps reached).
    """
    torch.manual_seed(seed)
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    model = CSCDenoiser(seed=seed, **model_kw)
    if init is not None:
        model.load_state_dict(torch.load(init, map_location="cpu", weights_only=True))
    model = model.to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sampler = PatchSampler(patch, dev, gen)
    noise_gen = torch.Generator(device=dev).manual_seed(seed + 1)
    t0, losses = time.perf_counter(), []
    step = 0
    for step in range(1, steps + 1):
        frac = step / steps
        if minutes is not None:
            frac = max(frac, (time.perf_counter() - t0) / (60 * minutes))
        for g in opt.param_groups:
            g["lr"] = 1e-5 + 0.5 * (lr - 1e-5) * (1 + math.cos(math.pi * min(frac, 1.0)))
        clean = sampler(batch)
        sigma = torch.rand(batch, device=dev, generator=noise_gen) * (sigma_max / 255.0)
        noisy = clean + sigma.view(-1, 1, 1, 1) * torch.randn(clean.shape, device=dev, generator=noise_gen)
        err = (model(noisy, sigma) - clean).pow(2).mean(dim=(1, 2, 3))
        loss = (err / (sigma**2 + (5.0 / 255) ** 2)).mean() if balanced else err.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()) if step % 50 == 0 else float("nan"))
        if progress is not None:
            progress(step, steps, float(loss.detach()) if step % 50 == 0 else float("nan"))
        if frac >= 1.0:
            break
    wall = time.perf_counter() - t0
    model = model.cpu().eval()
    recipe = {
        "steps": step, "batch": batch, "patch": patch, "lr": lr, "schedule": "cosine to 1e-5",
        "sigma_train_range_255": [0.0, sigma_max],
        "loss": "mse / (sigma^2 + (5/255)^2) per sample" if balanced else "mse", "init": init,
        "optimizer": "adam", "seed": seed,
        "augmentation": "8 dihedral transforms; 0.5x/0.75x bicubic rescaled copies",
        "train_images": list(data.DENOISE_TRAIN_IMAGES) + ["stereo_motorcycle_right"],
        "device": str(dev) if dev.type == "cpu" else f"{dev} ({torch.cuda.get_device_name(dev)})",
        "torch": torch.__version__, "wall_time_s": round(wall, 1),
        "model": {"num_atoms": model.num_atoms, "kernel_size": model.kernel_size,
                  "n_steps": model.n_steps, "border": model.border},
    }
    return model, recipe


def psnr(clean: np.ndarray, estimate: np.ndarray) -> float:
    from skimage.metrics import peak_signal_noise_ratio

    return float(peak_signal_noise_ratio(clean, np.clip(estimate, 0, 1), data_range=1.0))


@torch.inference_mode()
def denoise_array(model: torch.nn.Module, noisy: np.ndarray, sigma255: float) -> np.ndarray:
    x = torch.from_numpy(noisy)[None, None]
    return model(x, torch.tensor([sigma255 / 255.0])).numpy()[0, 0]


def evaluate(model: torch.nn.Module, sigmas: tuple[float, ...] = EVAL_SIGMAS,
             images: dict[str, np.ndarray] | None = None) -> dict[str, dict[str, float]]:
    """Per-σ PSNR on the held-out images (same seeded noise as every other method)."""
    images = images if images is not None else data.denoise_test_set()
    out: dict[str, dict[str, float]] = {}
    for s in sigmas:
        per = {n: psnr(img, denoise_array(model, data.add_noise(img, s, data.noise_seed(n, s)), s))
               for n, img in images.items()}
        out[f"{s:g}"] = {"mean": float(np.mean(list(per.values()))), **per}
    return out


def main() -> None:
    """Standalone entry (``python -m unroll.train.denoiser``) for training on another machine."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--minutes", type=float, default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--patch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--atoms", type=int, default=64)
    ap.add_argument("--kernel", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", default=None)
    ap.add_argument("--plain-mse", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    model, recipe = train_denoiser(a.steps, a.batch, a.patch, a.lr, seed=a.seed, device=a.device,
                                   minutes=a.minutes, balanced=not a.plain_mse, init=a.init,
                                   num_atoms=a.atoms, kernel_size=a.kernel, n_steps=a.iters)
    metrics = evaluate(model)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), out.with_suffix(".pt"))
    out.with_suffix(".json").write_text(json.dumps({"recipe": recipe, "psnr": metrics}, indent=2))
    print(json.dumps({"recipe": recipe, "psnr": {k: v["mean"] for k, v in metrics.items()}}))


if __name__ == "__main__":
    main()
