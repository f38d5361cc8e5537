"""The GPU serving check (issue 37): ``unroll serve --target gpu`` on a CUDA machine — the real tritonserver running
each model's PyTorch module on the GPU, and the gateway — measured from outside, as a client sees it.

Per workload (the demo classifier's digits; the demo denoiser's photos at 256² and 512², σ=25) and per path — Triton
direct with binary tensors, Triton direct with the encoded image (``image_bytes``), the gateway (PNG) — it runs
closed-loop levels on the project's load engine (:mod:`~unroll.benchmarks.gpu_serve_load`, over
:mod:`~unroll.benchmarks.loadgen`): concurrency 1 (p50/p99) and 64 and 256 in flight (throughput). Per level: the
batch sizes Triton formed (its statistics extension), the GPU's utilisation (NVML, sampled), CPU ms per request of
each of the service's processes (gateway, tritonserver, backend stubs; ``/proc``) and of the client. Beside them:
the same model in-process on the same device at batch 1 and at the batch Triton formed (eager, and a CUDA graph's
replay on a GPU), and the parity gate: the card's gate data through Triton within the card's FP32 tolerance of the
CPU FP32 model (:mod:`~unroll.benchmarks.gpu_check_run`). ``--timed-only NAME:SIDE`` adds a model that has no
committed weights, which the torch runtime therefore does not serve: on a GPU its module (random weights) is timed
in-process at SIDE² (the script names the VARS RVT at 224²).

Without CUDA it says why and writes nothing. ``--device cpu`` runs the same check with ``unroll serve --target cpu``
(the card's CPU runtime through the same real tritonserver and gateway): the tests' dry run. Usage:
``scripts/gpu_serve_check.sh [--device cpu] [--quick] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from unroll import artifacts, tasks
from unroll.benchmarks.common import RESULTS, demo_model, latency_summary
from unroll.benchmarks.gpu_check_device import cuda_unavailable, machine
from unroll.benchmarks.gpu_serve_decode import decode_times
from unroll.benchmarks.gpu_serve_load import ceiling, default_processes, level
from unroll.benchmarks.gpu_serve_report import STEM, write
from unroll.benchmarks.gpu_serve_triton import (
    TritonHttp,
    batch_histogram,
    inprocess_times,
    parity_rows,
    workloads,
)
from unroll.benchmarks.loadgen import Payload
from unroll.benchmarks.nvml import GpuSampler
from unroll.benchmarks.processes import cpu_by_pid, cpu_ms_per_request
from unroll.benchmarks.serve_triton import stats_delta
from unroll.benchmarks.soak import ServeProcess, start_serve, stop_serve
from unroll.errors import BenchError
from unroll.serving.torch_runtime import set_tf32
from unroll.serving.triton import free_ports

LEVELS, QUICK_LEVELS = (1, 64, 256), (1, 8)
PATHS = ("triton-tensors", "triton-image", "gateway")
#: Seconds: warm-up and measured time per level (full, quick).
TIMING = {False: (1.0, 3.0), True: (0.5, 2.0)}
READY_TIMEOUT_S = 360.0


def default_models() -> tuple[str, ...]:
    """The demo classifier and the demo denoiser (the first trained model of each task)."""
    return demo_model(tasks.CLASSIFICATION), demo_model(tasks.DENOISING)


def _level(svc: ServeProcess, triton: TritonHttp, sampler: GpuSampler | None, model: str, payloads: list[Payload],
           base_url: str, concurrency: int, quick: bool, client_procs: int | None) -> dict:
    """One level through ``base_url``; the service's CPU, Triton's statistics and the GPU sampled over its measured
    window."""
    warmup_s, duration_s = TIMING[quick]
    before: dict = {}

    def measure_start() -> None:  # the engine calls it when its processes' measured window opens
        before.update(stats=triton.stats(model), cpu=cpu_by_pid(svc.proc.pid))
        if sampler is not None:
            sampler.start()

    res = level(base_url, payloads, concurrency, duration_s, warmup_s, client_procs or default_processes(concurrency),
                measure_start)
    gpu = sampler.stop() if sampler is not None else None
    stats1, cpu1 = triton.stats(model), cpu_by_pid(svc.proc.pid)
    cpu = cpu_ms_per_request(before.get("cpu", {}), cpu1, res.ok) or {}
    cpu["client"] = res.cpu_ms_per_request if res.client_requests else None
    stats0 = before.get("stats")
    return {"concurrency": concurrency, "requests": res.ok, "errors": res.errors_total,
            "errors_by_cause": dict(res.errors), "error_samples": res.error_samples, "elapsed_s": res.duration_s,
            "throughput": res.throughput, "latency_ms": latency_summary(res.latencies_ms),
            "client_processes": res.processes, "client_cpu_share": res.client_cpu_share, "cpu_ms_per_request": cpu,
            "gpu": gpu, "triton": stats_delta(stats0, stats1), "batches": batch_histogram(stats0, stats1)}


def run_check(out: Path, device: str = "cuda", quick: bool = False, onnx_dir: Path = artifacts.ONNX_DIR,
              workers: int | None = None, client_procs: int | None = None,
              models: tuple[str, ...] | None = None, timed_only: tuple[str, int] | None = None) -> dict | None:
    """Serve ``models`` (default :func:`default_models`), measure, stop; the results (also written to ``out``), or
    ``None`` (nothing written) without CUDA. ``timed_only``: (a model without weights, its side), timed in-process."""
    models = models or default_models()
    if device == "cuda" and (why := cuda_unavailable()):
        print(f"gpu_serve: skipped, no CUDA GPU here: {why}. Nothing written.")
        return None
    if device == "cuda":
        set_tf32(False)  # the in-process times in FP32, as the torch runtime serves (serving/torch_runtime.py)
    t0 = time.perf_counter()
    cores = os.cpu_count() or 1
    workers = workers or max(1, cores // 4)
    info = machine(device)
    info.update(cores=cores, gateway_workers=workers, load_avg_at_start=list(os.getloadavg()))
    print(f"gpu_serve: {info.get('gpu', device)}, torch {info['torch']}, {cores} cores, {workers} gateway workers",
          flush=True)
    ceil = ceiling(free_ports(1)[0], 64, 1, 0.8 if quick else 2.0)
    print(f"  load engine's ceiling: {ceil.throughput:,.0f} req/s per client process", flush=True)
    levels = QUICK_LEVELS if quick else LEVELS
    sizes = (256,) if quick else (256, 512)
    rows, parity, inproc = [], [], []
    result = {"machine": info, "quick": quick, "levels": rows, "parity": parity, "inprocess": inproc,
              "load_generator": {"req_per_s_per_process": ceil.throughput, "client_cpu_share": ceil.client_cpu_share,
                                 "cpu_ms_per_request": ceil.cpu_ms_per_request, "errors": ceil.errors_total},
              "complete": False}

    def save() -> None:  # after each workload: a run stopped at its time limit keeps what it measured
        result["elapsed_s"] = time.perf_counter() - t0
        write(out, result)

    with tempfile.TemporaryDirectory(prefix="gpu_serve-") as tmp:
        graphs = Path(tmp) / "build" / "onnx"  # the Triton key goes beside it
        graphs.mkdir(parents=True)
        for f in onnx_dir.resolve().iterdir():
            if f.suffix in (".onnx", ".json", ".data"):
                shutil.copy2(f, graphs / f.name)
        args = ("--target", "gpu" if device == "cuda" else "cpu", "--workers", str(workers))
        svc = start_serve(Path(tmp), list(models), lambda m: print(f"  {m}", flush=True), onnx_dir=graphs,
                          args=args, ready_timeout_s=READY_TIMEOUT_S)
        http = svc.triton_ports[0]
        try:
            triton = TritonHttp(f"127.0.0.1:{http}", (graphs.parent / artifacts.TRITON_KEY.name).read_text().strip())
            info["tritonserver"] = triton.version()
            info["served_as"] = triton.runtimes(models)
            print(f"  served: tritonserver {info['tritonserver']}; {info['served_as']}", flush=True)
            sampler = GpuSampler(period_s=0.02) if device == "cuda" else None
            if sampler is not None and sampler.why_absent:
                print(f"  GPU utilisation not sampled: {sampler.why_absent}", flush=True)
            for w in workloads(models, sizes, quick):
                for path in PATHS:
                    base = svc.base if path == "gateway" else f"http://127.0.0.1:{http}"
                    for c in levels:
                        row = {"workload": w.key, "model": w.model, "label": w.label, "path": path,
                               **_level(svc, triton, sampler, w.model, triton.requests(w, path), base, c, quick,
                                        client_procs)}
                        rows.append(row)
                        print(f"  {w.key:12s} {path:15s} c={c:<4d} {row['throughput']:9.1f}/s p50 "
                              f"{row['latency_ms']['p50']:8.2f} ms errors {row['errors']}", flush=True)
                formed = [r["triton"]["avg_batch"] for r in rows if r["workload"] == w.key and r["triton"]
                          and r["path"] == "triton-tensors" and r["triton"].get("avg_batch")]
                inproc += inprocess_times(w, device, max(1, round(formed[-1])) if formed else 1, quick)
                save()
            parity += parity_rows(triton, models, quick)
        finally:
            stop_serve(svc)
    if device == "cuda" and not quick and timed_only is not None:
        inproc += inprocess_times(None, device, 1, quick, timed_only)  # not served (no weights): timed alone
    try:  # in-process, with the service stopped; its torchvision path has not run before the first GPU run, so a
        # failure there is recorded in the results instead of costing the check what it measured
        result["decode"] = decode_times(device, quick)
    except Exception as e:  # noqa: BLE001
        result["decode"] = {"rows": [], "note": f"not measured: {type(e).__name__}: {e}"}
    result["complete"] = True
    save()
    print(f"gpu_serve: wrote {out / (STEM + '.json')} and {out / (STEM + '.md')} in {result['elapsed_s']:.0f} s")
    return result


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(124)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu_serve_check.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=RESULTS, help="results folder (default: benchmarks/results)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (skips with the reason when absent); cpu: the same check on `unroll serve --target cpu`")
    p.add_argument("--quick", action="store_true", help="the 256² denoiser only, levels 1 and 8, short levels")
    p.add_argument("--onnx-dir", type=Path, default=artifacts.ONNX_DIR, help="the exported graphs to serve")
    p.add_argument("--workers", type=int, default=None, help="gateway workers (default: a quarter of the cores)")
    p.add_argument("--client-procs", type=int, default=None, help="load-client processes (default: by level)")
    p.add_argument("--models", default=",".join(default_models()), help="served models (default: %(default)s)")
    p.add_argument("--timed-only", default=None, metavar="NAME:SIDE",
                   help="a model without committed weights to time in-process only, at SIDE×SIDE (on a GPU)")
    a = p.parse_args(argv)
    timed_only = None
    if a.timed_only:
        name, _, side = a.timed_only.partition(":")
        if not side.isdigit():
            p.error(f"--timed-only {a.timed_only!r}: expected NAME:SIDE, e.g. a model name and 224")
        timed_only = (name, int(side))
    signal.signal(signal.SIGTERM, _stop)  # a time limit's SIGTERM still stops the service (finally-blocks run)
    try:
        run_check(a.out, a.device, a.quick, a.onnx_dir, a.workers, a.client_procs,
                  tuple(m for m in a.models.split(",") if m), timed_only)
    except BenchError as e:
        print(f"gpu_serve: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
