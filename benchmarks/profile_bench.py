"""``unroll profile`` on the demo models under ``unroll serve``: the capacity at a stated p99 objective.

Per workload — the demo classifier on its card's test digits, the demo denoiser on its card's test photos cropped to
256² and 512² — and per way in (the gateway's ``/v1`` route with the images; Triton direct over gRPC with binary tensors
of the same size, the Triton key ``unroll serve`` wrote), the command users run, ``unroll profile MODEL --search
--slo p99<=…`` with Poisson arrivals: the highest rate meeting the objective, the level that first failed and why,
the client's own CPU per request and the serve tree's (by process kind) at the highest rate met, and the profile's
latency-against-load plot. One ``unroll serve`` (two gateway workers, spare ports, an API key) serves them all.

The objectives are stated per workload (:func:`workloads`), not fitted to the results. ``python -m
unroll.benchmarks.profile_bench [--out DIR]`` writes ``profile_bench.json``, ``.md`` and the plots into
``benchmarks/results`` and rewrites the pages' generated block (:data:`BLOCK`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from unroll import artifacts, pipeline
from unroll.benchmarks.common import RESULTS, machine_info, unroll_command, write_docs_blocks, write_results
from unroll.benchmarks.soak import start_serve, stop_serve
from unroll.errors import BenchError


def workloads() -> tuple[tuple[str, int | None, str, float], ...]:
    """(model, crop side or None for the card's own size, p99 objective, search start rate req/s), the demo models
    from the registry."""
    from unroll.benchmarks.serve_load import served_models

    served = served_models()
    return ((served.classifier, None, "p99<=50ms", 10.0), (served.denoiser, 256, "p99<=500ms", 2.0),
            (served.denoiser, 512, "p99<=2s", 0.5))
WAYS = ("v1", "triton-grpc")
KEY = "profile-bench"
LEVEL_S, WARMUP_S, RESOLUTION = 4.0, 1.0, 0.1
BLOCK = ("<!-- profile-bench: generated from benchmarks/results/profile_bench.json -->", "<!-- /profile-bench -->")
ROOT = Path(__file__).resolve().parents[1]


def _args(way: str, serve, model: str, size: int | None, key: str) -> list[str]:
    sized = ["--size", str(size)] if size else []
    if way == "v1":
        return ["--url", serve.base, "--key", KEY, "--target", "v1", "--inputs", "card", *sized]
    side = size or 28
    return ["--url", f"grpc://127.0.0.1:{serve.triton_ports[1]}", "--key", key, "--target", "triton",
            "--size", str(side)]


def _profile(args: list[str], model: str, slo: str, start: float, out: Path) -> dict:
    cmd = [unroll_command(), "profile", model, *args, "--search", "--slo", slo, "--start-rate", f"{start:g}",
           "--resolution", f"{RESOLUTION:g}", "--arrivals", "poisson", "--duration", f"{LEVEL_S:g}", "--warmup",
           f"{WARMUP_S:g}", "--no-progress", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        return {"command": " ".join(cmd[1:]), "error": (p.stderr.strip().splitlines() or ["no message"])[-1]}
    result = json.loads((out / f"{model}-profile.json").read_text())
    s = result["search"]
    met = [lv for lv in result["levels"] if lv.get("slo_met")]
    best = max(met, key=lambda lv: lv["offered_rps"]) if met else None
    return {"command": "unroll " + " ".join(cmd[1:]).replace(str(out), "OUT"), "inputs":
            result["deployment"]["inputs"], "highest_rate_met_rps": s["highest_rate_met_rps"],
            "first_failed_rps": s["first_failed_rps"], "first_failed_why": s["first_failed_why"],
            "reached_max_rate": s["reached_max_rate"], "levels": len(result["levels"]),
            "best": None if best is None else {k: best.get(k) for k in (
                "offered_rps", "throughput_rps", "p50_ms", "p99_ms", "client_cpu_ms_per_request", "service_cpu",
                "triton")}}


def run(out_dir: Path, log: Callable[[str], None] = print, chosen: Sequence[tuple] | None = None) -> dict:
    """One ``unroll serve`` on the demo models; each workload searched through each way in."""
    chosen = workloads() if chosen is None else chosen
    models = sorted({w[0] for w in chosen})
    onnx_dir = artifacts.ONNX_DIR.resolve()  # unroll serve runs from a folder of its own
    pipeline.run(pipeline.plan(models, onnx_dir=onnx_dir))
    rows = []
    with tempfile.TemporaryDirectory(prefix="unroll-profile-bench-") as tmp:
        root = Path(tmp)
        serve = start_serve(root, models, log, settings={"UNROLL_API_KEY": KEY}, onnx_dir=onnx_dir,
                            args=("--workers", "2"))
        try:
            triton_key = (onnx_dir.parent / "triton.key").read_text().strip()
            for model, size, slo, start in chosen:
                for way in WAYS:
                    name = f"{model}{f'-{size}' if size else ''}-{way}"
                    log(f"{name}: searching the rate meeting {slo}")
                    got = _profile(_args(way, serve, model, size, triton_key), model, slo, start, root / name)
                    plot = root / name / f"{model}-profile-latency.png"
                    if plot.exists():
                        out_dir.mkdir(parents=True, exist_ok=True)
                        shutil.copy(plot, out_dir / f"profile_bench-{name}.png")
                        got["plot"] = f"profile_bench-{name}.png"
                    rows.append({"workload": name, "model": model, "size": size, "way": way, "slo": slo, **got})
        finally:
            stop_serve(serve)
    return {"benchmark": "profile_bench", "machine": machine_info(threads=2), "serve": "unroll serve --workers 2, "
            "spare ports, an API key, one tritonserver", "level_s": LEVEL_S, "warmup_s": WARMUP_S,
            "resolution": RESOLUTION, "arrivals": "poisson", "rows": rows}


def _f(v: float | None, spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec)


def markdown(payload: dict) -> str:
    """The capacity table (every number from ``payload``)."""
    lines = ["| workload | way in | objective | highest rate met, req/s | first failed, req/s | why | p99 ms at the "
             "rate met | client CPU ms/req | serve CPU ms/req (gateway / tritonserver / backends) |",
             "| --- | --- | --- | --: | --: | --- | --: | --: | --- |"]
    for r in payload["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} {r['size'] or ''} | {r['way']} | {r['slo']} | - | - | {r['error']} | - "
                         "| - | - |")
            continue
        b = r["best"] or {}
        cpu = (b.get("service_cpu") or {}).get("cpu_ms_per_request") or {}
        split = " / ".join(_f(cpu.get(k), ".2f") for k in ("gateway", "tritonserver", "backends"))
        why = "; ".join(r["first_failed_why"] or []) or ("reached --max-rate" if r["reached_max_rate"] else "-")
        lines.append(f"| {r['model']} {r['size'] or ''} | {r['way']} | {r['slo']} | "
                     f"{_f(r['highest_rate_met_rps'])} | {_f(r['first_failed_rps'])} | {why} | "
                     f"{_f(b.get('p99_ms'), '.1f')} | {_f(b.get('client_cpu_ms_per_request'), '.2f')} | {split} |")
    lines += ["", f"Poisson arrivals, {payload['level_s']:g} s per level after {payload['warmup_s']:g} s of warm-up, "
              f"search resolution {100 * payload['resolution']:g} %; {payload['serve']}. Plots: "
              + ", ".join(f"[{r['workload']}]({r['plot']})" for r in payload["rows"] if r.get("plot")) + "."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder for profile_bench.json, .md and the plots")
    args = ap.parse_args(argv)
    payload = run(args.out)
    if not any("error" not in r for r in payload["rows"]):
        raise BenchError("every search failed:\n" + "\n".join(r["error"] for r in payload["rows"]))
    md = markdown(payload)
    for path in write_results("profile_bench", payload, md, args.out):
        print(f"wrote {path}")
    if args.out == RESULTS:
        write_docs_blocks(ROOT, *BLOCK, md.replace("](profile_bench-", "](benchmarks/results/profile_bench-"))


if __name__ == "__main__":
    main()
