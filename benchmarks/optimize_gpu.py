"""``unroll optimize --target gpu``: the GPU check's candidates for one model, and the fastest that passed its gate.

On a CUDA machine it runs :func:`unroll.benchmarks.gpu_check.run_check` for the model (PyTorch eager, TF32,
autocast, ``torch.compile``, AOTInductor; each parity-gated against the FP32 CPU model, then timed) and records the
fastest passing candidate per case. Candidates it cannot reach are listed with the reason (ONNX Runtime's CUDA and
TensorRT providers need ``onnxruntime-gpu``; TensorRT plans need TensorRT). The GPU repository serves TensorRT
(plans, or ONNX Runtime's TensorRT provider), so this choice is measured, not applied by ``unroll repo``.
Without CUDA it raises :class:`OptimizeError` with the reason and writes nothing.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

from unroll import artifacts
from unroll.benchmarks import gpu_check
from unroll.errors import OptimizeError


def unreachable() -> list[dict]:
    """The GPU candidates outside PyTorch, and why each cannot run here (empty reason: it can)."""
    out = []
    try:
        import onnxruntime as ort

        providers = set(ort.get_available_providers())
    except ImportError:
        providers = set()
    for provider, what in (("CUDAExecutionProvider", "ONNX Runtime CUDA"),
                           ("TensorrtExecutionProvider", "ONNX Runtime TensorRT")):
        if provider not in providers:
            out.append({"candidate": what, "reason": f"{provider} is not in this onnxruntime build "
                                                     "(install onnxruntime-gpu)"})
    if importlib.util.find_spec("tensorrt") is None:
        out.append({"candidate": "TensorRT plan", "reason": "tensorrt is not installed"})
    return out


def run_gpu(name: str, budget_s: float, fresh: bool = False, device: str = "cuda",
            candidates: list[str] | None = None, optimize_dir: Path | None = None) -> dict:
    """Measure ``name``'s GPU candidates and write ``optimize_dir/NAME.gpu.{json,md}``; returns the record.
    ``device="cpu"`` runs the same code on the CPU (the tests' dry run, as ``gpu_check --device cpu``)."""
    why = gpu_check.cuda_unavailable() if device == "cuda" else None
    skipped = unreachable()
    if why:
        others = "; ".join(f"{s['candidate']}: {s['reason']}" for s in skipped)
        raise OptimizeError(f"--target gpu needs a CUDA GPU: {why}. Nothing was measured or written"
                            + (f" (also unreachable here: {others})" if others else ""))
    optimize_dir = Path(artifacts.OPTIMIZE_DIR if optimize_dir is None else optimize_dir)
    out = optimize_dir / f"{name}.gpu_check"
    cases = gpu_check.run_check(out, device=device, models=[name], candidates=candidates, budget_s=budget_s,
                                resume=not fresh and (out / f"{gpu_check.STEM}.json").exists())
    best = {}
    for case in cases or []:
        ok = [r for r in case.rows.values() if r.get("status") == "ok"]
        if ok:
            winner = min(ok, key=lambda r: r["p50_ms"])
            best[case.label] = {"candidate": winner["candidate"], "p50_ms": winner["p50_ms"],
                                "p99_ms": winner["p99_ms"], "speedup_vs_eager": winner.get("speedup_vs_eager")}
    record = {"model": name, "target": "gpu", "device": device,
              "written_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "choice": {}, "best": best,
              "skipped": skipped, "evidence": str(out / f"{gpu_check.STEM}.md")}
    path = artifacts.choice(name, "gpu", optimize_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    lines = [f"# `unroll optimize {name} --target gpu`", "", "| case | fastest passing candidate | p50 ms | p99 ms |",
             "|---|---|---|---|"]
    lines += [f"| {k} | {v['candidate']} | {v['p50_ms']:.3f} | {v['p99_ms']:.3f} |" for k, v in best.items()]
    lines += ["", *(f"- skipped {s['candidate']}: {s['reason']}" for s in skipped), "",
              f"Every candidate's row (parity, gate, timings): {record['evidence']}. Measured only: the GPU repository "
              "serves TensorRT.", ""]
    path.with_suffix(".md").write_text("\n".join(lines))
    return record
