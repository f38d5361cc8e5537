"""Recipe for the convolutional LISTA denoiser: training and evaluation on scikit-image's bundled images.

Patches come from the training images only (``unroll.data.DENOISE_TRAIN_IMAGES``). Evaluation reports
per-image PSNR on the test images (the docs' numbers: nothing is chosen on them), the validation images
(where choices are made) and the stress set (synthetic/graphic content), all from :mod:`unroll.data`.
Runs on CPU or CUDA (``device``); everything is seeded. The
recipe interface (``TRAIN_OPTIONS``, ``train``, ``EVAL_OPTIONS``, ``evaluate``) is :mod:`unroll.train`'s.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from unroll import data
from unroll.baselines import bm3d_psnr
from unroll.errors import RecipeError
from unroll.metrics import psnr
from unroll.models.denoiser import CSCDenoiser
from unroll.train import Evaluation, Option, ProgressFactory, Table, TrainRun, counted, slice_option

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
    init: dict | None = None, progress: Callable[[int, int, float], None] | None = None, **model_kw,
) -> tuple[CSCDenoiser, dict]:
    """Train on noisy patches, σ ~ U[0, sigma_max] (0–255), Adam + cosine decay.

    ``balanced`` weights each sample's MSE by ``1/(σ² + σ₀²)`` (σ₀ = 5/255) so that every noise level
    counts alike in PSNR terms (plain MSE lets the high-σ samples dominate). ``init`` fine-tunes from
    a state dict (the previous stage's weights).

    ``minutes`` caps the wall time (the schedule is then stretched over the steps reached).
    """
    torch.manual_seed(seed)
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    model = CSCDenoiser(seed=seed, **model_kw)
    if init is not None:
        model.load_state_dict(init)
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
        "loss": "mse / (sigma^2 + (5/255)^2) per sample" if balanced else "mse",
        "optimizer": "adam", "seed": seed,
        "augmentation": "8 dihedral transforms; 0.5x/0.75x bicubic rescaled copies",
        "train_images": list(data.DENOISE_TRAIN_IMAGES) + ["stereo_motorcycle_right"],
        "device": str(dev) if dev.type == "cpu" else f"{dev} ({torch.cuda.get_device_name(dev)})",
        "torch": torch.__version__, "wall_time_s": round(wall, 1),
        "model": {"num_atoms": model.num_atoms, "kernel_size": model.kernel_size,
                  "n_steps": model.n_steps, "border": model.border},
    }
    return model, recipe


@torch.inference_mode()
def denoise_array(model: torch.nn.Module, noisy: np.ndarray, sigma255: float) -> np.ndarray:
    x = torch.from_numpy(noisy)[None, None]
    return model(x, torch.tensor([sigma255 / 255.0])).numpy()[0, 0]


#: The fixed slice of ``unroll eval NAME --slice``: every image of every set at every σ, cut to its central
#: window of at most this side after the whole image's seeded noise is added (the window is what is denoised).
SLICE_WINDOW = 96
SLICE_DESCRIPTION = (f"the central {SLICE_WINDOW}x{SLICE_WINDOW} window (or less) of every image of every set at "
                     "every sigma, cut from the whole image with its seeded noise")


def _centre(img: np.ndarray, side: int) -> np.ndarray:
    h, w = img.shape[-2:]
    y, x = (h - min(h, side)) // 2, (w - min(w, side)) // 2
    return img[..., y:y + min(h, side), x:x + min(w, side)]


def psnr_table(model: torch.nn.Module, sigmas: tuple[float, ...] = EVAL_SIGMAS,
               images: dict[str, np.ndarray] | None = None,
               tick: Callable[[], None] = lambda: None, window: int | None = None) -> dict[str, dict[str, float]]:
    """Per-σ PSNR on the held-out images (same seeded noise as every other method); ``tick()`` after each
    (σ, image) denoised, ``len(sigmas) × len(images)`` in all. ``window`` (:data:`SLICE_WINDOW`) denoises and
    measures only each image's central window of that side, cut after the whole image's noise is added."""
    images = images if images is not None else data.denoise_test_set()
    out: dict[str, dict[str, float]] = {}
    for s in sigmas:
        per = {}
        for n, img in images.items():
            noisy = data.add_noise(img, s, data.noise_seed(n, s))
            if window is not None:
                img, noisy = _centre(img, window), _centre(noisy, window)
            per[n] = psnr(img, denoise_array(model, noisy, s))
            tick()
        out[f"{s:g}"] = {"mean": float(np.mean(list(per.values()))), **per}
    return out



# ---------------------------------------------------------------------------------------------- recipe interface

#: The two stages: from scratch with plain MSE, then fine-tuning with the σ-balanced loss.
STAGES = ((False, 1e-3, "1: from scratch, plain MSE"), (True, 3e-4, "2: fine-tune from stage 1, sigma-balanced loss"))
MODEL = {"num_atoms": 96, "kernel_size": 3, "n_steps": 4}
PROTOCOL = ("mean PSNR (data_range 1, output clipped to [0,1]) over the {n} held-out images; unclipped Gaussian "
            "noise seeded per (image, sigma) by unroll.data.noise_seed; BM3D = bm3d.bm3d(noisy, sigma_psd) on the "
            "same noisy images; evaluated on {device}")

TRAIN_OPTIONS = (
    Option("minutes", 8.0, "wall-time budget per stage (the cosine schedule is stretched over the steps reached)"),
    Option("device", "cpu", "cpu or cuda"),
    Option("batch", 128, "patches per step"),
)
EVAL_OPTIONS = (Option("bm3d", False, "also run BM3D on the same noisy test images (minutes on a CPU)"),
                slice_option(SLICE_DESCRIPTION))
#: A test image where the denoiser trails BM3D by more than this (dB, at any σ) is listed by ``--bm3d``.
BM3D_SHORTFALL_DB = 0.5


def train(run: TrainRun, minutes: float = 8.0, device: str = "cpu", batch: int = 128) -> tuple[CSCDenoiser, dict]:
    """Two stages (plain MSE, then σ-balanced fine-tuning), each capped at ``minutes``; then measure."""
    stages, init, model = [], None, None
    for i, (balanced, lr, label) in enumerate(STAGES):
        budget = run.steps or 400_000
        with run.progress(f"training {run.name} stage {i + 1}/{len(STAGES)}", budget) as update:
            model, recipe = train_denoiser(steps=budget, batch=batch, patch=64, lr=lr, seed=run.seed, device=device,
                                           minutes=minutes, balanced=balanced, init=init, progress=update, **MODEL)
        init = model.state_dict()
        stages.append({**recipe, **({"init": "stage 1 weights"} if i else {}), "stage": label})
    assert model is not None
    recipe = {"stages": stages, "train_images": stages[0]["train_images"], "held_out": list(data.DENOISE_TEST_IMAGES),
              "wall_time_s": round(sum(s["wall_time_s"] for s in stages), 1)}
    record: dict = {"name": run.name, "model": {**MODEL, "border": model.border}, "recipe": recipe}
    if run.metrics:
        record["metrics"] = evaluate(run.name, model, record, run.progress).metrics
    return model, record


def evaluate(name: str, model: torch.nn.Module, record: dict, progress: ProgressFactory,
             bm3d: bool = False, slice: bool = False) -> Evaluation:
    """Mean and per-image PSNR on the test images (``metrics.psnr``, ``psnr_per_image``, ``protocol``), and on the
    validation and stress sets (``metrics.validation`` / ``metrics.stress``: ``psnr``, ``psnr_per_image``);
    with ``bm3d`` also BM3D's on the same noisy test images (``bm3d_psnr``, ``bm3d_psnr_per_image``) and the test
    images where the model trails it by more than :data:`BM3D_SHORTFALL_DB` (``bm3d_shortfall``). With ``slice``
    the same (BM3D aside) on each image's central window (:data:`SLICE_WINDOW`) only."""
    if slice and bm3d:
        raise RecipeError("--bm3d measures the whole test images: not with --slice")
    window = SLICE_WINDOW if slice else None
    images = data.denoise_test_set()
    n = len(EVAL_SIGMAS) * len(images)
    with counted(progress, f"denoising the held-out images ({name})", n) as tick:
        ours = psnr_table(model, EVAL_SIGMAS, images, tick, window)
    metrics: dict = {"psnr": _means(ours), "psnr_per_image": _per_image(ours),
                     "protocol": PROTOCOL.format(n=len(images), device="CPU")}
    others = {}
    for role, ds in (("validation", "denoise-validation"), ("stress", "denoise-stress")):
        role_images = data.dataset(ds).load()
        with counted(progress, f"denoising the {role} images ({name})", len(EVAL_SIGMAS) * len(role_images)) as tick:
            t = psnr_table(model, EVAL_SIGMAS, role_images, tick, window)
        others[role] = t
        metrics[role] = {"data": ds, "psnr": _means(t), "psnr_per_image": _per_image(t)}
    ref, source = record.get("metrics", {}).get("bm3d_psnr", {}), "from the committed record (--bm3d recomputes)"
    if bm3d:
        with progress("BM3D", n) as update:
            count = iter(range(1, n + 1))
            theirs = bm3d_psnr(EVAL_SIGMAS, images, progress=lambda: update(next(count), n))
        metrics["bm3d_psnr"], metrics["bm3d_psnr_per_image"] = _means(theirs), _per_image(theirs)
        ref, source = metrics["bm3d_psnr"], "measured now"
    theirs_per = metrics.get("bm3d_psnr_per_image") or record.get("metrics", {}).get("bm3d_psnr_per_image", {})
    if slice:  # the record's BM3D numbers are the whole images'
        ref, theirs_per, source = {}, {}, "not on the slice (whole images only)"
    if bm3d:
        metrics["bm3d_shortfall"] = {
            img: {s: round(metrics["psnr_per_image"][s][img] - theirs_per[s][img], 3) for s in theirs_per}
            for img in images
            if any(metrics["psnr_per_image"][s][img] - theirs_per[s][img] < -BM3D_SHORTFALL_DB for s in theirs_per)}
    rows = []
    for s, v in metrics["psnr"].items():
        b = ref.get(s)
        rows.append([s, f"{v:.2f} dB", f"{b:.2f} dB" if b else "-", f"{v - b:+.2f} dB" if b else "-"])
    table = Table(f"test set: mean PSNR over {len(images)} held-out images", ["σ (0–255)", f"{name} PSNR", "BM3D PSNR",
                                                                               "Δ"], rows)
    sig = list(metrics["psnr"])
    per = [[img, *(f"{metrics['psnr_per_image'][s][img]:.2f}" + (
        f" ({metrics['psnr_per_image'][s][img] - theirs_per[s][img]:+.2f})" if s in theirs_per else "") for s in sig)]
           for img in images]
    tables = [table, Table("test set per image: PSNR dB (Δ vs BM3D)", ["image", *(f"σ={s}" for s in sig)], per)]
    for role, t in others.items():
        tables.append(Table(f"{role} set per image (PSNR dB; {metrics[role]['data']})",
                            ["image", *(f"σ={s}" for s in sig)],
                            [[img, *(f"{t[s][img]:.2f}" for s in sig)] for img in t[sig[0]] if img != "mean"]
                            + [["mean", *(f"{t[s]['mean']:.2f}" for s in sig)]]))
    lines = [f"BM3D columns: {source}"]
    if "bm3d_shortfall" in metrics:
        short = metrics["bm3d_shortfall"]
        lines.append(f"test images trailing BM3D by more than {BM3D_SHORTFALL_DB} dB at some σ: " + (
            "; ".join(f"{img} (" + ", ".join(f"σ={s}: {d:+.2f}" for s, d in v.items()) + ")"
                      for img, v in short.items()) or "none"))
    return Evaluation(metrics=metrics, tables=tables, lines=lines, slice=SLICE_DESCRIPTION if slice else None)


def _means(table: dict[str, dict[str, float]]) -> dict[str, float]:
    return {s: v["mean"] for s, v in table.items()}


def _per_image(table: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    return {s: {k: round(x, 3) for k, x in v.items() if k != "mean"} for s, v in table.items()}
