"""``unroll bench stress``: what each reduced precision loses on the synthetic stress patterns, per runtime.

For every denoiser whose card gates on a stress set, every precision its card lists beyond FP32 (the graph
``unroll quantize`` made behind its gate) runs on ONNX Runtime and on OpenVINO (dynamic and static shapes),
against the FP32 graph on ONNX Runtime, on two disjoint sets of seeded patterns (:mod:`unroll.stress_patterns`):
the *gate* seeds (part of the card's stress set: the quantizer chose on them) and the *report* seeds (never chosen
on). Each image is denoised at every σ the card gates at, and at σ 5 (light noise, below the gate's levels:
reported, not gated). The table gives the worst image and σ of each set and whether the card's worst-image
tolerance holds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from unroll import artifacts, gates, stress_patterns
from unroll.benchmarks.common import machine_info, write_results
from unroll.card import ModelCard, from_onnx
from unroll.data import add_noise
from unroll.metrics import psnr
from unroll.serving import runtimes

#: Light noise, below the cards' gate levels: reported beside them, never gated.
EXTRA_SIGMAS = (5.0,)
#: (runtime, static shapes): OpenVINO both ways, as ``unroll optimize`` measures it (the card says which one serves).
RUNTIMES = (("onnxruntime", False), ("openvino", False), ("openvino", True))
NOISE_SEED = 0


def _cases(card: ModelCard, which: str) -> list[tuple[str, float, dict[str, np.ndarray], np.ndarray]]:
    assert card.sigma is not None
    sigmas = sorted({*EXTRA_SIGMAS, *card.sigma.gate_levels})
    channels = card.input.shape[0]
    return [(name, s, {card.input.name: np.repeat(add_noise(img, s, NOISE_SEED + k)[None, None], channels, 1),
                       card.sigma.input: np.array([s / card.sigma.scale], np.float32)}, img)
            for k, (name, img) in enumerate(stress_patterns.pattern_set(which).items()) for s in sigmas]


def _losses(run, cases, refs) -> list[dict]:
    out = []
    for (name, s, feeds, clean), ref in zip(cases, refs, strict=True):
        got = run(feeds)
        out.append({"image": name, "sigma": s, "loss_db": round(float(psnr(clean, ref[0, 0]) - psnr(clean, got[0, 0])),
                                                                   4)})
    return out


def measure(name: str, onnx_dir: Path, threads: int = 2, log=print) -> dict:
    """One denoiser's rows: per precision × runtime, per set, the worst loss per σ and the worst image."""
    fp32 = artifacts.graph(name, onnx_dir=onnx_dir)
    card = from_onnx(fp32)
    sets = {w: _cases(card, w) for w in ("gate", "report")}
    ref_run = gates.onnxruntime_run(fp32, card.output, threads)
    refs = {w: [ref_run(c[2]) for c in cs] for w, cs in sets.items()}
    rows = []
    for precision in [p for p in card.precisions if p != "fp32"]:
        graph = artifacts.graph(name, precision, onnx_dir)
        if not graph.exists():
            rows.append({"precision": precision, "skipped": f"no {graph.name}: its quantize gate refused it or it was "
                                                              "not built (`unroll quantize`)"})
            continue
        tol = card.gate(precision).get("psnr_loss_db_worst")
        for runtime, static in RUNTIMES:
            label = runtime + (" (static shapes)" if static else "")
            why = runtimes.unavailable_reason(runtime)
            if why:
                rows.append({"precision": precision, "runtime": label, "skipped": why})
                continue
            log(f"{name}: {precision} on {label}")
            session = runtimes.open_session(graph, runtime, threads, static_shapes=static)

            def run(feeds: dict[str, np.ndarray], session=session) -> np.ndarray:
                return session(feeds)[card.output]

            served = runtime == card.cpu_runtime and (runtime != "openvino" or static == card.cpu_static_shapes)
            row: dict = {"precision": precision, "runtime": label, "served_by_card": served, "tolerance_db": tol,
                         "sets": {}}
            for which, cases in sets.items():
                losses = _losses(run, cases, refs[which])
                gated = [r for r in losses if r["sigma"] in card.sigma.gate_levels]
                worst = max(gated, key=lambda r: r["loss_db"])
                row["sets"][which] = {
                    "images": len({r["image"] for r in losses}),
                    "worst_by_sigma": {f"{s:g}": max((r for r in losses if r["sigma"] == s), key=lambda r: r["loss_db"])
                                       for s in sorted({r["sigma"] for r in losses})},
                    "worst_at_gate_levels": worst,
                    "holds": tol is None or worst["loss_db"] <= tol}
            rows.append(row)
    return {"model": name, "gate_levels": list(card.sigma.gate_levels), "extra_sigmas": list(EXTRA_SIGMAS),
            "reference": "FP32 graph on ONNX Runtime", "rows": rows}


def run(names: list[str], onnx_dir: Path = artifacts.ONNX_DIR, out: Path | None = None, threads: int = 2,
        log=print) -> dict:
    """Measure ``names`` (denoisers with a stress set; their graphs must exist) and write ``precision_stress``."""
    payload = {"machine": machine_info(threads), "patterns": {
        "kinds": list(stress_patterns.KINDS), "per_kind": stress_patterns.PER_KIND, "side": stress_patterns.SIDE,
        "seeds": stress_patterns.SEEDS}, "models": [measure(n, onnx_dir, threads, log) for n in names]}
    if out is not None:
        write_results("precision_stress", payload, markdown(payload), out)
    return payload


def markdown(payload: dict) -> str:
    p = payload["patterns"]
    lines = ["# Reduced precision on synthetic stress patterns", "",
             f"{len(p['kinds'])} kinds ({', '.join(p['kinds'])}), {p['per_kind']} images each of {p['side']}² per set. "
             "**gate** seeds are part of the card's stress set (the quantizer chose its INT8 placement on them); "
             "**report** seeds were never chosen or calibrated on. Loss: PSNR of the FP32 graph (ONNX Runtime) minus "
             "the candidate's, per image; worst over the set.", ""]
    for m in payload["models"]:
        levels = ", ".join(f"{s:g}" for s in m["gate_levels"])
        extra = ", ".join(f"{s:g}" for s in m["extra_sigmas"])
        lines += [f"## {m['model']}", "",
                  f"Gated at σ {levels}; σ {extra} is reported only (light noise, below the gate's levels).", "",
                  "| precision | runtime | set | worst at the gate's σ (image, σ) | holds ≤ tolerance "
                  "| worst per σ (dB) |",
                  "|---|---|---|---|---|---|"]
        for r in m["rows"]:
            if "skipped" in r:
                lines.append(f"| {r['precision']} | {r.get('runtime', '–')} | – | skipped: {r['skipped']} | – | – |")
                continue
            for which, s in r["sets"].items():
                w = s["worst_at_gate_levels"]
                per = ", ".join(f"σ{k}: {v['loss_db']:.3f}" for k, v in s["worst_by_sigma"].items())
                holds = "yes" if s["holds"] else f"**no** (> {r['tolerance_db']} dB)"
                runtime = r["runtime"] + (" **(the card's)**" if r.get("served_by_card") else "")
                lines.append(f"| {r['precision']} | {runtime} | {which} ({s['images']} images) | "
                             f"{w['loss_db']:.3f} dB ({w['image']}, σ {w['sigma']:g}) | {holds} | {per} |")
        lines.append("")
    return "\n".join(lines)
