"""The results of ``unroll bench models`` (CPU and CUDA) as Markdown tables."""

from __future__ import annotations

from unroll.benchmarks.common import load_note
from unroll.benchmarks.models_inputs import CUDA_PRECISIONS, ENGINES, OPENVINO
from unroll.gates import METRICS


def _cell(t: dict | None, ratio: float | None, note: str | None = None) -> str:
    if t is None:
        return note if note and note.startswith("skipped") else "-"
    return f"{t['median_ms']:.2f} ({ratio:.2f}×)"


def markdown(payload: dict) -> str:
    m, cfg = payload["machine"], payload["config"]
    engines = [e for e in ENGINES if any(e in r["timings"] or (e == OPENVINO and OPENVINO in r["notes"])
                                         for r in payload["rows"])]
    lines = [f"# Engines per model ({m['cpu']}, {cfg['threads']} threads, torch {m['versions'].get('torch')}, "
             f"onnxruntime {m['versions'].get('onnxruntime')}"
             + (f", openvino {m['versions']['openvino']}" if m["versions"].get("openvino") else "") + ")", "",
             f"Median latency in ms per call ({cfg['timing']}); in parentheses the speed-up vs PyTorch eager in "
             "the same run. Models without committed weights run a seeded random initialisation (same cost). "
             + ("" if cfg["torch_compile"] else "torch.compile skipped (pass --compile; slow to compile). ")
             + load_note(m), "",
             "| model | case | " + " | ".join(engines) + " |", "|---|---|" + "---|" * len(engines)]
    for r in payload["rows"]:
        cells = [_cell(r["timings"].get(e), r["speedup_vs_eager"].get(e), r["notes"].get(e)) for e in engines]
        lines.append(f"| {r['model']} | {r['case']} | " + " | ".join(cells) + " |")
    notes = sorted({f"{r['model']} {k}: {v}" for r in payload["rows"] for k, v in r["notes"].items()
                    if not v.startswith("skipped")})
    if notes:
        lines += ["", "Not measured: " + "; ".join(notes) + "."]
    if payload["precision"]:
        lines += ["", "## ONNX Runtime CPU: FP32 vs FP16 vs INT8, speed and accuracy", "",
                  "Accuracy figures are the quantization gates' (`build/onnx/NAME.<precision>.report.json`), on "
                  "the data each model's card names for its gate: classifiers' accuracy, denoisers' mean PSNR.", "",
                  "| model | case | precision | median ms | speed vs FP32 | accuracy / PSNR σ=15, 25, 50 (dB) "
                  "| change vs FP32 |", "|---|---|---|---|---|---|---|"]
        for e in payload["precision"]:
            q = e.get("quality") or {}
            if "accuracy" in q:
                qual = "-" if q["accuracy"] is None else f"{100 * q['accuracy']:.1f} %"
                diff = "-" if q.get("top1_agreement") is None else f"top-1 agreement {100 * q['top1_agreement']:.1f} %"
            elif "psnr_db" in q:
                qual = ", ".join(f"{v:.2f}" for v in q["psnr_db"].values())
                diff = ", ".join(f"{-v:+.3f}" for v in q["psnr_loss_db"].values()) + " dB"
            else:
                qual = diff = "-"
            ms = "-" if e["median_ms"] is None else f"{e['median_ms']:.2f}"
            sp = "-" if e["speedup_vs_fp32"] is None else f"{e['speedup_vs_fp32']:.2f}×"
            if e["median_ms"] is None and e.get("note"):
                ms = e["note"]
            lines.append(f"| {e['model']} | {e['case']} | {e['precision'].upper()} | {ms} | {sp} | {qual} | {diff} |")
    sc = payload.get("scaling") or {}
    for engine, d in sc.get("denoiser", {}).items():
        lines += ["", f"## Scaling: {d.get('model', 'denoiser')} latency vs image size ({engine})", "",
                  f"Fitted power law: latency ∝ pixels^**{d['fit']['exponent']:.2f}** (1.0 = linear in pixels).", "",
                  "| size | pixels | median ms | µs / pixel |", "|---|---|---|---|"]
        for p in d["points"]:
            lines.append(f"| {p['side']}×{p['side']} | {p['pixels']:,} | {p['median_ms']:.1f} | "
                         f"{1e3 * p['median_ms'] / p['pixels']:.3f} |")
    cl = sc.get("classifier", {}).get("engines", {})
    if cl:
        batches = [p["batch"] for p in next(iter(cl.values()))]
        lines += ["", f"## Scaling: {sc['classifier']['model']} throughput vs batch size (images/s)", "",
                  "| engine | " + " | ".join(f"batch {b}" for b in batches) + " |", "|---|" + "---|" * len(batches)]
        for engine, pts in cl.items():
            lines.append(f"| {engine} | " + " | ".join(f"{p['images_per_s']:.0f}" for p in pts) + " |")
    if sc:
        lines += ["", "Plot: `models_scaling.png`."]
    return "\n".join(lines) + "\n"


def _cuda_cell(r: dict | None) -> str:
    if r is None:
        return "-"
    ratio = r.get("speedup_vs_eager_fp32")
    return f"{r['median_ms']:.3f}" + (f" ({ratio:.2f}×)" if ratio else "")


def markdown_cuda(payload: dict) -> str:
    m, cfg = payload["machine"], payload["config"]
    dry = payload.get("device") != "cuda"
    versions = m.get("versions") or {}
    torch_v, ort_v = m.get("torch") or versions.get("torch"), m.get("onnxruntime") or versions.get("onnxruntime")
    where = (f"a CPU dry run of its code on {m.get('cpu')}: not GPU results" if dry else
             f"{m.get('gpu')}, {m.get('gpu_memory_gib')} GiB, compute capability {m.get('compute_capability')}; "
             f"driver {m.get('driver')}, CUDA {m.get('cuda_runtime')}, cuDNN {m.get('cudnn')}")
    runtimes = list(dict.fromkeys(r["runtime"] for r in payload["rows"]))
    cols = [(rt, p) for rt in runtimes for p in CUDA_PRECISIONS if any(
        r["runtime"] == rt and r["precision"] == p for r in payload["rows"])]
    lines = [f"# Engines per model on CUDA ({where}; torch {torch_v}, onnxruntime {ort_v})", "",
             f"Median latency in ms per call ({cfg['timing']}); inputs and outputs stay on the device (ONNX "
             "Runtime through IOBinding). In parentheses the speed-up vs PyTorch eager FP32 at the same batch. "
             "FP16: PyTorch under `torch.autocast(float16)`; ONNX Runtime runs the FP16 graph `unroll quantize` "
             f"wrote ({cfg['ort_provider']}). Models without committed weights run a seeded random "
             f"initialisation (same cost). Measured {m.get('date_utc')} UTC.", "",
             "| model | case | " + " | ".join(f"{rt} {p}" for rt, p in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    cases = list(dict.fromkeys((r["model"], r["case"]) for r in payload["rows"]))
    for model, case in cases:
        here = {(r["runtime"], r["precision"]): r for r in payload["rows"] if r["model"] == model
                and r["case"] == case}
        lines.append(f"| {model} | {case} | " + " | ".join(_cuda_cell(here.get(c)) for c in cols) + " |")
    if payload["gates"]:
        lines += ["", "## Accuracy gates with the candidate on the device", "",
                  "The card's gate data and tolerances (`unroll.gates`); reference: the FP32 graph in ONNX "
                  "Runtime on the CPU. Last column: the same metric from `unroll quantize`'s CPU gate.", "",
                  "| model | precision | metric | measured | tolerance | passed | CPU gate |",
                  "|---|---|---|---|---|---|---|"]

        for g in payload["gates"]:
            for metric, tol in g["tolerances"].items():
                v, cpu = g["metrics"].get(metric), g["cpu_gate"].get(metric)
                fmt = METRICS[metric].format
                lines.append(f"| {g['model']} | {g['precision'].upper()} | {metric} | "
                             f"{'-' if v is None else fmt(v)} | {fmt(tol)} | {'yes' if g['passed'] else 'no'} | "
                             f"{'-' if cpu is None else fmt(cpu)} |")
    if payload["skipped"]:
        lines += ["", "## Not measured", ""]
        by: dict[str, list[str]] = {}
        for s in payload["skipped"]:
            what = f"{s['model']} {s['runtime']} {s['precision']}" + (f" b{s['batch']}" if s["batch"] else "")
            by.setdefault(s["reason"], []).append(what)
        for why, items in by.items():
            lines.append(f"- {why}: {', '.join(items)}")
    return "\n".join(lines) + "\n"
