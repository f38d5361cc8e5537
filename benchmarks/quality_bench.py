"""Quality beside speed: denoising PSNR/SSIM vs classical denoisers, and a classifier's accuracy per precision.

The models are the trained ones of each task (registered with committed weights, see
``unroll.benchmarks.common.demo_model``); their data, input names and λ/σ inputs come from their cards.

Denoising: the card's test images at σ = 15/25/50 with the seeded noise every method shares
(``add_noise(img, σ, noise_seed(name, σ))``): the denoiser through ONNX Runtime in FP32/FP16/INT8
beside BM3D and scikit-image's non-local means, TV (Chambolle) and wavelet (BayesShrink) denoisers,
with each method's wall time per image.

Classification: accuracy per precision (ONNX Runtime FP32/FP16/INT8) on the card's test data, clean
and under Gaussian noise σ = 0.1 … 0.5 (the noise of the training recipe's robustness evaluation),
with the trained λ fixed vs ``lam=auto`` (λ per image from the card's λ-rule graph, ``card.lam.auto``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from unroll import artifacts, data, pipeline, tasks
from unroll.baselines import bm3d_denoise
from unroll.benchmarks import plots
from unroll.benchmarks.common import (
    classify_noise_seed,
    demo_model,
    gaussian_noise,
    load_note,
    machine_info,
    ort_session,
    progress_bars,
    write_results,
)
from unroll.benchmarks.models_inputs import ensure_export, lam_default, quantized_graphs
from unroll.metrics import psnr
from unroll.registry import get_spec

SIGMAS = (15.0, 25.0, 50.0)
PRECISIONS = ("fp32", "fp16", "int8")
#: TV weight = TV_WEIGHT_PER_SIGMA × σ (σ on the 0–1 scale): best of 0.5/0.75/1/1.5/2 on *training* images
#: (astronaut, coffee, page) at σ = 15/25/50.
TV_WEIGHT_PER_SIGMA = 0.75
NOISE_SIGMAS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)
QUICK = {"images": 2, "crop": 128, "sigmas": (25.0,), "digits": 200, "noise": (0.0, 0.3)}
BATCH = 500


# ----------------------------------------------------------------------------------------------- denoisers


def _classical() -> dict[str, Callable[[np.ndarray, float], np.ndarray]]:
    from skimage.restoration import denoise_nl_means, denoise_tv_chambolle, denoise_wavelet, estimate_sigma

    def nlm(noisy: np.ndarray, s255: float) -> np.ndarray:
        est = float(np.mean(estimate_sigma(noisy)))  # scikit-image's recipe: h from the estimated σ
        return denoise_nl_means(noisy, h=0.8 * est, sigma=est, fast_mode=True, patch_size=5, patch_distance=6)

    return {
        "BM3D": bm3d_denoise,
        "NL-means": nlm,
        "TV (Chambolle)": lambda noisy, s255: denoise_tv_chambolle(noisy, weight=TV_WEIGHT_PER_SIGMA * s255 / 255),
        "wavelet (BayesShrink)": lambda noisy, s255: denoise_wavelet(noisy, sigma=s255 / 255, method="BayesShrink",
                                                                     mode="soft", rescale_sigma=True),
    }


def _onnx_denoiser(session, card) -> Callable[[np.ndarray, float], np.ndarray]:
    """A gray image in, a gray image out, through the graph's own input names and σ scale (from its card)."""
    channels = card.input.shape[0]

    def run(noisy: np.ndarray, s255: float) -> np.ndarray:
        x = np.repeat(noisy[None, None].astype(np.float32), channels, axis=1)
        out = session.run(None, {card.input.name: x,
                                 card.sigma.input: np.array([s255 / card.sigma.scale], np.float32)})[0]
        return out[0].mean(0)

    return run


def _graphs(name: str, onnx_dir: Path) -> tuple[dict[str, Path], dict[str, str]]:
    graphs = {"fp32": ensure_export(name, onnx_dir)}
    q, why = quantized_graphs(name, onnx_dir)
    return {**graphs, **q}, why


def _images(card, quick: bool, images: tuple[str, ...] | None) -> dict[str, np.ndarray]:
    """The card's test images (``images``: only these; quick: the first two, centre-cropped)."""
    test = data.dataset(card.data.test).load()
    unknown = set(images or ()) - set(test)
    if unknown:
        raise KeyError(f"{card.data.test} has no image(s) {sorted(unknown)}; it has {', '.join(test)}")
    chosen = {n: test[n] for n in images} if images else test
    if not quick:
        return chosen
    c = QUICK["crop"]
    out = {}
    for n, img in list(chosen.items())[:QUICK["images"]]:
        y, x = (img.shape[0] - c) // 2, (img.shape[1] - c) // 2
        out[n] = np.ascontiguousarray(img[y:y + c, x:x + c])
    return out


def run_denoise(threads: int = 2, sigmas: tuple[float, ...] = SIGMAS, quick: bool = False,
                images: tuple[str, ...] | None = None, with_bm3d: bool = True, onnx_dir: Path = artifacts.ONNX_DIR,
                progress: bool = True, out_dir: Path | None = None) -> dict:
    """PSNR/SSIM and wall time per image for every method on the same noisy images."""
    from skimage.metrics import structural_similarity

    onnx_dir = Path(onnx_dir)
    model = demo_model(tasks.DENOISING)
    card = get_spec(model).card
    if quick:
        sigmas = tuple(s for s in sigmas if s in QUICK["sigmas"]) or QUICK["sigmas"]
    imgs = _images(card, quick, images)
    graphs, missing = _graphs(model, onnx_dir)
    methods: dict[str, Callable[[np.ndarray, float], np.ndarray]] = {}
    for p in PRECISIONS:
        if p in graphs:
            sess = ort_session(graphs[p], threads)
            methods[f"{model} {p.upper()}"] = _onnx_denoiser(sess, card)
    for k, f in _classical().items():
        if k != "BM3D" or with_bm3d:
            methods[k] = f
    warm = data.add_noise(np.full((48, 48), 0.5, np.float32), 25.0, 0)
    for f in methods.values():  # imports and first-call set-up stay outside the timings
        f(warm, 25.0)
    per_image = []
    with progress_bars(progress) as bars:
        task = bars.add_task("denoising quality", total=len(methods) * len(sigmas) * len(imgs), info="")
        for s in sigmas:
            for name, clean in imgs.items():
                noisy = data.add_noise(clean, s, data.noise_seed(name, s))
                for m, f in methods.items():
                    bars.update(task, info=f"σ={s:g} {name} {m}")
                    t0 = time.perf_counter()
                    est = np.asarray(f(noisy, s), dtype=np.float32)
                    dt = time.perf_counter() - t0
                    per_image.append({"method": m, "sigma": s, "image": name, "shape": list(clean.shape),
                                      "psnr": psnr(clean, est),
                                      "ssim": float(structural_similarity(clean, np.clip(est, 0, 1), data_range=1.0)),
                                      "time_s": dt})
                    bars.advance(task)
    names = list(methods)
    summary = {m: {f"{s:g}": {k: float(np.mean([r[k] for r in per_image if r["method"] == m and r["sigma"] == s]))
                              for k in ("psnr", "ssim", "time_s")} for s in sigmas} for m in names}
    times = {}
    for m in names:
        rs = [r for r in per_image if r["method"] == m]
        r512 = [r["time_s"] for r in rs if r["shape"] == [512, 512]]
        times[m] = {"mean": float(np.mean([r["time_s"] for r in rs])),
                    "mean_512x512": float(np.mean(r512)) if r512 else None}
    ours, bm = times.get(f"{model} FP32", {}).get("mean_512x512"), times.get("BM3D", {}).get("mean_512x512")
    payload = {"benchmark": "quality: denoising", "model": model, "machine": machine_info(threads),
               "config": {"threads": threads, "quick": quick, "onnx_dir": str(onnx_dir),
                          "noise": "unroll.data.add_noise(img, σ, noise_seed(name, σ)), not clipped",
                          "parameters": {"BM3D": "bm3d.bm3d(noisy, sigma_psd=σ) (true σ)",
                                         "NL-means": "h = 0.8·σ̂, sigma = σ̂ with σ̂ = estimate_sigma(noisy); "
                                                     "fast mode, 5×5 patches, distance 6",
                                         "TV (Chambolle)": f"weight = {TV_WEIGHT_PER_SIGMA}·σ (true σ; tuned on "
                                                           "training images)",
                                         "wavelet (BayesShrink)": "sigma = true σ, soft thresholding, rescale_sigma",
                                         model: f"ONNX Runtime, true σ, {threads} threads"},
                          "missing_precisions": missing},
               "methods": names, "sigmas": list(sigmas), "n_images": len(imgs),
               "images": {n: list(v.shape) for n, v in imgs.items()}, "summary": summary, "time_s": times,
               "speed_512": {"csc_fp32_s": ours, "bm3d_s": bm, "bm3d_over_csc": bm / ours if ours and bm else None},
               "per_image": per_image}
    if out_dir is not None:
        write_results("quality_denoise", payload, markdown_denoise(payload), Path(out_dir))
        plots.quality_denoise_plot(payload, Path(out_dir))
    return payload


def markdown_denoise(payload: dict) -> str:
    m, sig = payload["machine"], payload["sigmas"]
    model = _denoiser_name(payload)
    lines = [f"# Denoising quality and speed ({m['cpu']}, {payload['n_images']} held-out images"
             + (", quick run" if payload["config"]["quick"] else "") + ")", "",
             "Mean PSNR (dB) / SSIM over the same seeded noisy images for every method; wall time per image "
             f"(mean over all images and σ). {load_note(m)}", "",
             "| method | " + " | ".join(f"σ={s:g} PSNR / SSIM" for s in sig) + " | s / image | s / 512² image |",
             "|---|" + "---|" * (len(sig) + 2)]
    best = {f"{s:g}": max(payload["summary"][k][f"{s:g}"]["psnr"] for k in payload["methods"]) for s in sig}
    for k in payload["methods"]:
        cells = []
        for s in sig:
            v = payload["summary"][k][f"{s:g}"]
            p = f"{v['psnr']:.2f}"
            cells.append(f"{'**' + p + '**' if v['psnr'] == best[f'{s:g}'] else p} / {v['ssim']:.3f}")
        t = payload["time_s"][k]
        t512 = "-" if t["mean_512x512"] is None else f"{t['mean_512x512']:.3g}"
        lines.append(f"| {k} | " + " | ".join(cells) + f" | {t['mean']:.3g} | {t512} |")
    sp = payload["speed_512"]
    lines += [""]
    if sp["bm3d_over_csc"]:
        lines.append(f"On 512×512 images {model} (ONNX Runtime FP32) takes {sp['csc_fp32_s']:.3g} s and BM3D "
                     f"{sp['bm3d_s']:.3g} s: **{sp['bm3d_over_csc']:.1f}× faster**.")
    else:
        lines.append("512×512 speed ratio vs BM3D: not measured in this run (no 512×512 image, or BM3D skipped).")
    missing = payload["config"].get("missing_precisions") or {}
    if missing:
        lines.append("Not measured: " + "; ".join(f"{model} {p.upper()}: {w}" for p, w in missing.items()) + ".")
    lines += ["", "Parameters:", ""]
    lines += [f"- {k}: {v}" for k, v in payload["config"]["parameters"].items()]
    lines += ["", "Images: " + ", ".join(f"{n} {s[1]}×{s[0]}" for n, s in payload["images"].items()) + ".",
              "", "Plot: `quality_denoise.png`.", ""]
    return "\n".join(lines)


def _denoiser_name(payload: dict) -> str:
    """The benchmarked denoiser (results written before ``model`` was recorded: the FP32 method's name)."""
    if "model" in payload:
        return payload["model"]
    return next((k[:-len(" FP32")] for k in payload["methods"] if k.endswith(" FP32")), "the denoiser")


# ----------------------------------------------------------------------------------------------- classification


def _predict(session, card, x: np.ndarray, lam: np.ndarray | None) -> np.ndarray:
    out = []
    for i in range(0, len(x), BATCH):
        feeds = {card.input.name: x[i:i + BATCH]}
        if lam is not None:
            feeds[card.lam.input] = lam[i:i + BATCH]
        out.append(session.run(None, feeds)[0].argmax(1))
    return np.concatenate(out)


def _auto_lam(session, card, x: np.ndarray) -> np.ndarray:
    return np.concatenate([session.run(None, {card.input.name: x[i:i + BATCH]})[0] for i in range(0, len(x), BATCH)])


def _lam_rule(name: str, card, onnx_dir: Path, threads: int):
    """A session of the card's λ-rule graph (``card.lam.auto``), exported first when the pipeline finds the model's
    graphs missing or stale."""
    pipeline.run(pipeline.plan([name], onnx_dir=onnx_dir), progress=None)
    return ort_session(artifacts.graph(card.lam.auto, onnx_dir=onnx_dir), threads)


def run_classify(threads: int = 2, quick: bool = False, noise: tuple[float, ...] = NOISE_SIGMAS,
                 onnx_dir: Path = artifacts.ONNX_DIR, progress: bool = True, out_dir: Path | None = None) -> dict:
    """The trained classifier's accuracy per precision, clean and noisy, λ fixed vs λ auto (where its card has one)."""
    onnx_dir = Path(onnx_dir)
    name = demo_model(tasks.CLASSIFICATION)
    spec = get_spec(name)
    card = spec.card
    graphs, missing = _graphs(name, onnx_dir)
    has_auto = card.lam is not None and card.lam.auto is not None
    auto = _lam_rule(name, card, onnx_dir, threads) if has_auto else None
    sessions = {p: ort_session(graphs[p], threads) for p in PRECISIONS if p in graphs}
    x, y = data.dataset(card.data.test).load()
    if y is None:
        raise ValueError(f"{name}: its card's test data {card.data.test!r} has no labels to measure accuracy on")
    if quick:
        x, y, noise = x[:QUICK["digits"]], y[:QUICK["digits"]], QUICK["noise"]
    lam0 = lam_default(name, onnx_dir)
    results: dict[str, list[dict]] = {p: [] for p in sessions}
    with progress_bars(progress) as bars:
        task = bars.add_task("classification accuracy", total=len(noise) * len(sessions), info="")
        for s in noise:
            xn = gaussian_noise(x, s, classify_noise_seed(s))  # the same noise as the recipe's evaluation
            lam_auto = _auto_lam(auto, card, xn).astype(np.float32) if auto is not None else None
            fixed = np.full(len(xn), lam0, np.float32) if lam0 is not None else None
            for p, sess in sessions.items():
                bars.update(task, info=f"σ={s:g} {p}")
                t0 = time.perf_counter()
                acc_fixed = float((_predict(sess, card, xn, fixed) == y).mean())
                dt = time.perf_counter() - t0
                acc_auto = float((_predict(sess, card, xn, lam_auto) == y).mean()) if auto is not None else None
                results[p].append({"sigma": s, "acc_fixed": acc_fixed, "acc_auto": acc_auto,
                                   "mean_auto_lam": float(lam_auto.mean()) if lam_auto is not None else None,
                                   "ms_per_digit": 1e3 * dt / len(xn)})
                bars.advance(task)
    record = spec.info().get("metrics", {})
    if not quick and record.get("robustness"):
        want = {round(s, 3) for s in noise}
        results["pytorch (record)"] = [{"sigma": r["sigma"], "acc_fixed": r["acc_train_lam"],
                                        "acc_auto": r.get("acc_auto_lam"), "mean_auto_lam": r.get("mean_auto_lam")}
                                       for r in record["robustness"] if round(r["sigma"], 3) in want]
    payload = {"benchmark": "quality: classification", "model": name, "machine": machine_info(threads),
               "config": {"threads": threads, "quick": quick, "onnx_dir": str(onnx_dir), "lam_fixed": lam0,
                          "noise": "x + σ·N(0, 1), seed 2000 + 100σ (as the training recipe's evaluation), "
                                   "not clipped",
                          "lam_auto": (f"per image from {card.lam.auto}.onnx (FP32) for every precision" if has_auto
                                       else None),
                          "missing_precisions": missing},
               "n_digits": len(x), "noise_sigmas": list(noise), "results": results}
    if out_dir is not None:
        write_results("quality_classify", payload, markdown_classify(payload), Path(out_dir))
        plots.quality_classify_plot(payload, Path(out_dir))
    return payload


def markdown_classify(payload: dict) -> str:
    m, cfg = payload["machine"], payload["config"]
    res = payload["results"]
    sig = payload["noise_sigmas"]
    model = payload.get("model", "classifier")
    lam = (f"λ fixed at the trained {cfg['lam_fixed']:g}" if cfg.get("lam_fixed") is not None else "the model's λ")
    lines = [f"# {model} accuracy per precision ({m['cpu']}, {payload['n_digits']} held-out samples"
             + (", quick run" if cfg["quick"] else "") + ")", "",
             f"Accuracy (%) with {lam}" + (" / with `lam=auto`" if cfg.get("lam_auto") else "")
             + f"; noise: {cfg['noise']}. ONNX Runtime CPU unless marked; `pytorch (record)` is the committed "
             f"training record (`unroll/weights/{model}.json`). {load_note(m)}", "",
             "| precision | " + " | ".join("clean" if s == 0 else f"σ={s:g}" for s in sig) + " |",
             "|---|" + "---|" * len(sig)]
    for p, rows in res.items():
        by = {round(r["sigma"], 3): r for r in rows}
        cells = []
        for s in sig:
            r = by.get(round(s, 3))
            auto = "" if r is None or r.get("acc_auto") is None else f" / {100 * r['acc_auto']:.1f}"
            cells.append("-" if r is None else f"{100 * r['acc_fixed']:.1f}{auto}")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    missing = cfg.get("missing_precisions") or {}
    if missing:
        lines += ["", "Not measured: " + "; ".join(f"{p.upper()}: {w}" for p, w in missing.items()) + "."]
    lines += ["", "Plot: `quality_classify.png`.", ""]
    return "\n".join(lines)


def run(threads: int = 2, quick: bool = False, with_bm3d: bool = True, onnx_dir: Path = artifacts.ONNX_DIR,
        progress: bool = True, out_dir: Path | None = None) -> dict:
    """Both quality benchmarks; returns ``{"denoise": …, "classify": …}``."""
    return {"denoise": run_denoise(threads, quick=quick, with_bm3d=with_bm3d, onnx_dir=onnx_dir, progress=progress,
                                   out_dir=out_dir),
            "classify": run_classify(threads, quick=quick, onnx_dir=onnx_dir, progress=progress, out_dir=out_dir)}
