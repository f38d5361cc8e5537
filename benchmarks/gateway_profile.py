"""Where the gateway's time goes per request: a sampling profile (py-spy) of a real gateway under real load.

``unroll bench gateway-profile`` runs a real tritonserver and one gateway worker under closed-loop load from the
project's load engine (:mod:`.loadgen`) sending real test digits, while ``py-spy record`` samples the gateway; each
stack goes to the stage of its innermost recognised frame (:data:`STAGES`), reported as share of samples and ms per
request per concurrency level. py-spy needs ptrace rights over the gateway and is a benchmark extra; without it the
benchmark says so and exits.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

from unroll import artifacts, pipeline
from unroll.benchmarks import loadgen
from unroll.benchmarks.common import (
    exported_card,
    latency_summary,
    load_note,
    machine_info,
    metric_sum,
    ort_session,
    write_results,
)
from unroll.benchmarks.serve_load import REQUEST_TIMEOUT_S, Workload, classify_workload, gateway_payloads, served_models
from unroll.errors import (
    BenchError,  # py-spy missing or not allowed to attach, or a server could not start
    TritonStartError,
)
from unroll.serving.gateway.process import gateway_popen
from unroll.serving.gateway.settings import Settings
from unroll.serving.gateway.workers import default_workers
from unroll.serving.repository import INTRA_OP_SPINNING, write_repository
from unroll.serving.triton import free_ports, start

#: (stage, patterns): a stack's stage is that of the innermost frame matching one of the patterns, tried in this
#: order for each frame. Patterns match py-spy's ``function (file:line)`` frame text.
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("decode", (r"^decode \(serving/imaging/images\.py", r"\(PIL/")),
    ("preprocess", (r"\(serving/imaging/images\.py",)),
    ("postprocess", (r"^_classes \(serving/gateway/classify\.py", r"^predictions_from_logits \(")),
    ("JSON response", (r"\(pydantic", r"JSONResponse", r"\(json/", r"orjson", r"^render \(")),
    ("Triton gRPC call", (r"\(serving/gateway/triton_client\.py", r"\(tritonclient/", r"\(grpc/")),
    ("body read", (r"\(serving/gateway/body\.py", r"starlette/requests\.py")),
    ("metrics", (r"\(serving/gateway/metrics\.py", r"\(prometheus_client/")),
    ("route handler (checks, catalog)", (r"\(serving/gateway/classify\.py", r"\(serving/gateway/catalog\.py",
                                         r"\(serving/gateway/state\.py")),
    ("routing and dependencies (FastAPI)", (r"\(fastapi/", r"starlette/routing\.py")),
    ("threadpool hand-off", (r"\(anyio/", r"starlette/concurrency\.py", r"\(concurrent/futures", r"threading\.py")),
    ("HTTP server (uvicorn, httptools, uvloop)", (r"\(uvicorn/", r"\(httptools/", r"\(uvloop/",
                                                  r"\(serving/gateway/server\.py", r"\(starlette/")),
    ("event loop", (r"\(asyncio/",)),
)
#: Frames of a thread with nothing to do (the loop in select/epoll; a worker thread waiting for work), should
#: py-spy report one as active.
IDLE = (r"\.select \(selectors\.py", r"^Condition\.wait \(threading\.py", r"^Queue\.get \(queue\.py")
MAIN = "MainThread"
_STAGE_RE = [(name, [re.compile(p) for p in pats]) for name, pats in STAGES]
_IDLE_RE = [re.compile(p) for p in IDLE]


def py_spy() -> str:
    """Path of the ``py-spy`` executable (next to this interpreter, else on PATH)."""
    here = Path(sys.executable).with_name("py-spy")
    found = str(here) if here.exists() else shutil.which("py-spy")
    if found is None:
        raise BenchError("py-spy is not installed (a benchmark extra: pip install py-spy)")
    return found


def parse_raw(text: str) -> list[tuple[str, list[str], int]]:
    """py-spy ``--format raw`` (collapsed stacks, ``--threads``): ``[(thread name, frames outermost first, count)]``."""
    out = []
    for line in text.splitlines():
        line = line.rstrip()
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1] if frames and frames[0].startswith("thread (") else "?"
        out.append((thread, frames[1:] if frames and frames[0].startswith("thread (") else frames, int(count)))
    return out


def stage_of(frames: list[str]) -> str:
    """The stage of a stack (innermost recognised frame wins), ``idle`` for a thread waiting, else ``other``."""
    for frame in reversed(frames):
        if any(r.search(frame) for r in _IDLE_RE):
            return "idle"
        for name, pats in _STAGE_RE:
            if any(p.search(frame) for p in pats):
                return name
    return "other"


def breakdown(stacks: list[tuple[str, list[str], int]], rate: int, duration_s: float, requests: int) -> dict:
    """Busy samples per (thread kind, stage) → shares and ms per request; the event loop's idle time is its wall
    time (``rate × duration_s`` samples) less its busy samples and the worker threads' busy samples."""
    main: Counter[str] = Counter()
    workers: Counter[str] = Counter()
    leaves: dict[str, Counter[str]] = {}
    for thread, frames, n in stacks:
        stage = "Triton gRPC call" if "_poll_wrapper" in thread else stage_of(frames)  # grpc's poller thread
        (main if thread == MAIN else workers)[stage] += n
        leaf = " < ".join(f.split(" (", 1)[0] for f in frames[-3:])
        leaves.setdefault(stage, Counter())[f"{'loop' if thread == MAIN else 'worker'}: {leaf}"] += n
    main_busy = sum(n for s, n in main.items() if s != "idle")
    busy_workers = sum(n for s, n in workers.items() if s != "idle")
    rows = []
    for stage in [*(s for s, _ in STAGES), "other"]:
        n_main, n_work = main.get(stage, 0), workers.get(stage, 0)
        if n_main + n_work == 0:
            continue
        rows.append({"stage": stage, "thread": "event loop" if n_work == 0 else
                     ("worker threads" if n_main == 0 else "both"), "samples": n_main + n_work,
                     "top_stacks": [{"innermost": k, "samples": v} for k, v in leaves[stage].most_common(5)]})
    # The loop's idle time: waiting while the request is in a worker thread (counted there) or elsewhere.
    waiting = max(round(rate * duration_s) - main_busy - busy_workers, 0)
    rows.append({"stage": "waiting (Triton, network, client)", "thread": "event loop idle", "samples": waiting})
    total = sum(r["samples"] for r in rows)
    for r in rows:
        r["share"] = r["samples"] / total if total else 0.0
        r["ms_per_request"] = r["samples"] / rate * 1e3 / requests if requests else None
    busy = total - waiting
    return {"rows": rows, "samples": total, "main_thread_busy_samples": main_busy, "busy_samples": busy,
            "busy_ms_per_request": busy / rate * 1e3 / requests if requests else None,
            "worker_idle_samples": workers.get("idle", 0)}


def _metric(base: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        return metric_sum(r.read().decode(), name, **labels)


def _load(target: str | loadgen.Sender, payloads: list, concurrency: int, duration_s: float,
          warmup_s: float) -> loadgen.LevelResult:
    """A closed-loop level on the load engine."""
    return loadgen.run(target, payloads, loadgen.Load(concurrency=concurrency), duration_s, warmup_s,
                       REQUEST_TIMEOUT_S)


def profile_level(base: str, pid: int, workload: Workload, concurrency: int, duration_s: float, rate: int,
                  out_dir: Path) -> dict:
    """py-spy over ``duration_s`` of closed-loop load at ``concurrency``; the stage breakdown of that window."""
    payloads = gateway_payloads(workload)
    _load(base, payloads, concurrency, 1.0, 0.5)  # warm connections, caches, the catalog
    raw = out_dir / f"pyspy-c{concurrency}.txt"
    route = workload.gateway_path.split("?", 1)[0]
    n0 = _metric(base, "unroll_gateway_requests_total", route=route, status="200")
    t0 = _metric(base, "unroll_gateway_triton_request_duration_seconds_sum", outcome="ok")
    spy = subprocess.Popen([py_spy(), "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw",
                            "--threads", "--nonblocking", "--duration", str(int(duration_s)), "-o", str(raw)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    res = _load(base, payloads, concurrency, duration_s + 1.0, 0.0)
    log, _ = spy.communicate(timeout=60)
    if spy.returncode != 0 or not raw.exists():
        raise BenchError(f"py-spy failed (needs ptrace rights over the gateway, e.g. root): {log.strip()[-400:]}")
    n = _metric(base, "unroll_gateway_requests_total", route=route, status="200") - n0
    triton_s = _metric(base, "unroll_gateway_triton_request_duration_seconds_sum", outcome="ok") - t0
    # Requests answered while py-spy sampled: the client's rate over its window × py-spy's duration.
    in_window = res.throughput * int(duration_s)
    b = breakdown(parse_raw(raw.read_text()), rate, int(duration_s), round(in_window))
    return {"concurrency": concurrency, "duration_s": int(duration_s), "rate_hz": rate, "requests": res.ok,
            "requests_in_window": round(in_window), "errors": res.errors_total, "throughput_rps": res.throughput,
            "latency_ms": latency_summary(res.latencies_ms), "client_cpu_ms_per_request": res.cpu_ms_per_request,
            "triton_round_trip_ms": triton_s / n * 1e3 if n else None, **b}


def _ort_p50(onnx_dir: Path, model: str, workload: Workload, duration_s: float) -> dict:
    """In-process ONNX Runtime at concurrency 1 on the same inputs (the +2 ms target's reference)."""
    # as Triton's model runs it
    session = ort_session(artifacts.graph(model, onnx_dir=onnx_dir), threads=2, spinning=INTRA_OP_SPINNING)
    res = _load(loadgen.InProcessSender(lambda feeds: session.run(None, feeds)), workload.arrays, 1, duration_s, 0.5)
    return {"requests": res.ok, "errors": res.errors_total, "latency_ms": latency_summary(res.latencies_ms)}


def _throughput(base: str, workload: Workload, concurrency: int, duration_s: float, workers: int) -> dict:
    load = os.getloadavg()
    res = _load(base, gateway_payloads(workload), concurrency, duration_s, 1.0)
    return {"workers": workers, "concurrency": concurrency, "requests": res.ok, "errors": res.errors_total,
            "error_samples": list(res.error_samples), "throughput_rps": res.throughput,
            "latency_ms": latency_summary(res.latencies_ms), "client_cpu_ms_per_request": res.cpu_ms_per_request,
            "load_average": load}


def run(concurrency: tuple[int, ...] = (1, 32), duration_s: float = 10.0, rate: int = 250,
        onnx_dir: Path = artifacts.ONNX_DIR, workers: tuple[int, ...] | None = None,
        throughput_concurrency: int = 32, log=lambda m: None) -> dict:  # noqa: ANN001
    """The profile at each of ``concurrency`` (one gateway process), in-process ONNX Runtime at concurrency 1, and
    gateway throughput at ``throughput_concurrency`` with each of ``workers`` processes (default: 1 and the
    ``unroll serve`` default, at least 2), all against one Triton."""
    py_spy()
    workers = workers or (1, max(2, default_workers()))
    served = served_models()
    machine = machine_info(threads=2)
    load_start = os.getloadavg()
    pipeline.run(pipeline.plan([served.classifier], onnx_dir=onnx_dir))  # exports what is missing or stale

    card = exported_card(served.classifier, onnx_dir)  # the trained λ is on the exported graph's card
    w = classify_workload(served.classifier, lam=card.lam.default if card.lam is not None else None)
    log("in-process ONNX Runtime, concurrency 1")
    ort = _ort_p50(onnx_dir, served.classifier, w, duration_s)
    with tempfile.TemporaryDirectory(prefix="unroll-gwprof-") as tmp:
        root = Path(tmp)
        repo = root / "repo"
        write_repository("cpu", [m for m in (served.classifier, served.lam_rule) if m], repo, onnx_dir=onnx_dir)
        try:
            triton = start(repo, *free_ports(3), log_file=root / "triton.log", timeout_s=300,
                           extra_args=["--exit-timeout-secs=2"])
        except TritonStartError as e:
            raise BenchError(f"could not start Triton: {e.reason}") from None
        try:
            settings = Settings(triton_url=triton.grpc_url)
            levels = []
            with gateway_popen(settings, root / "gateway.log", workers=1) as (base, proc):
                for c in concurrency:
                    log(f"profile at concurrency {c}")
                    levels.append(profile_level(base, proc.pid, w, c, duration_s, rate, root))
            scaling = []
            for n in workers:
                log(f"throughput at concurrency {throughput_concurrency}, {n} worker(s)")
                with gateway_popen(settings, root / f"gateway-{n}.log", workers=n) as (base, _):
                    scaling.append(_throughput(base, w, throughput_concurrency, duration_s, n))
        finally:
            triton.stop()
    gw1 = next((lv for lv in levels if lv["concurrency"] == 1), None)
    target = None
    if gw1 is not None:
        over = gw1["latency_ms"]["p50"] - ort["latency_ms"]["p50"]
        target = {"target": "gateway + Triton ≤ in-process ONNX Runtime + 2 ms (p50, concurrency 1, while profiled)",
                  "measured": f"+{over:.2f} ms (gateway {gw1['latency_ms']['p50']:.2f} ms, ONNX Runtime "
                              f"{ort['latency_ms']['p50']:.2f} ms)", "met": over <= 2.0}
    return {"benchmark": "gateway_profile", "model": served.classifier, "input": w.label,
            "gateway_path": w.gateway_path, "machine": machine, "load_average_start": load_start,
            "load_average_end": os.getloadavg(), "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "profiler": "py-spy record --threads --format raw", "levels": levels, "onnxruntime": ort,
            "workers": scaling, "targets": [target] if target else []}


def markdown(p: dict) -> str:
    lines = [f"# Gateway profile: where a request's time goes ({p['model']}, {p['input']}, PNG over HTTP)", "",
             f"{p['profiler']} at {p['levels'][0]['rate_hz'] if p['levels'] else '-'} Hz on one gateway process "
             "(real tritonserver over gRPC, the load engine's keep-alive HTTP/1.1 client in a closed loop, real test "
             "digits). Each sampled "
             "stack is assigned to the stage of its innermost recognised frame (`benchmarks/gateway_profile.py`, "
             "`STAGES`). ms/request = samples ÷ rate ÷ requests answered in the window. `waiting` = the event loop "
             "idle while no gateway thread works on the request (Triton, network, client). "
             f"{load_note(p['machine'])} Load average at start {p['load_average_start'][0]:.2f}, at end "
             f"{p['load_average_end'][0]:.2f}; measured {p['measured_at']}.", ""]
    for lv in p["levels"]:
        lat = lv["latency_ms"]
        rt = lv.get("triton_round_trip_ms")
        lines += [f"## Concurrency {lv['concurrency']}: {lv['throughput_rps']:.1f} req/s, p50 {lat['p50']:.2f} ms, "
                  f"{lv['errors']} errors", "",
                  f"Gateway busy (all threads): {lv['busy_ms_per_request']:.2f} ms of samples per request; Triton "
                  f"round trip seen by the gateway: {rt:.2f} ms per request (its histogram)."
                  if rt is not None and lv["busy_ms_per_request"] is not None else "", "",
                  "| stage | thread | samples | share | ms/request |", "|---|---|---|---|---|"]
        for r in sorted(lv["rows"], key=lambda r: -r["samples"]):
            ms = "-" if r["ms_per_request"] is None else f"{r['ms_per_request']:.3f}"
            lines.append(f"| {r['stage']} | {r['thread']} | {r['samples']} | {100 * r['share']:.1f} % | {ms} |")
        lines.append("")
    ort = p.get("onnxruntime")
    if ort:
        lines += [f"In-process ONNX Runtime on the same digits, concurrency 1: p50 {ort['latency_ms']['p50']:.2f} ms.",
                  ""]
    for t in p.get("targets", []):
        lines += [f"Target: {t['target']}: {t['measured']} — {'met' if t['met'] else '**not met**'}.", ""]
    if p.get("workers"):
        lines += ["## Gateway throughput by worker processes", "",
                  "| workers | concurrency | req/s | p50 | p99 | errors | load average (1 min) at start |",
                  "|---|---|---|---|---|---|---|"]
        for r in p["workers"]:
            lat = r["latency_ms"]
            lines.append(f"| {r['workers']} | {r['concurrency']} | {r['throughput_rps']:.1f} | {lat['p50']:.2f} | "
                         f"{lat['p99']:.2f} | {r['errors']} | {r['load_average'][0]:.2f} |")
        lines.append("")
    return "\n".join(lines)


def write(payload: dict, out_dir: Path) -> list[Path]:
    return list(write_results("gateway_profile", payload, markdown(payload), out_dir))


if __name__ == "__main__":  # python -m unroll.benchmarks.gateway_profile: print, write nothing
    result = run(log=print)
    print(json.dumps(result["workers"], indent=1))
    print(markdown(result))
