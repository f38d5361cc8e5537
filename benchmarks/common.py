"""Shared measurement helpers: machine info, warm-up + median timing, result writing."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine_info(threads: int) -> dict:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for pkg in ("torch", "onnxruntime", "onnx", "onnxslim", "numpy", "tritonclient", "nvidia-pytriton", "bm3d"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return {"cpu": cpu, "logical_cores": os.cpu_count(), "threads_used": threads, "python": platform.python_version(),
            "platform": platform.platform(), "versions": versions,
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def time_call(fn: Callable[[], object], warmup: int = 3, min_repeats: int = 5, max_repeats: int = 50,
              budget_s: float = 3.0) -> dict:
    """Median (and p10/p90) wall time in ms after warm-up; repeats until the budget or max_repeats."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_repeats and (len(times) < min_repeats or time.perf_counter() - start < budget_s):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return {"median_ms": statistics.median(times), "p10_ms": times[int(0.1 * (len(times) - 1))],
            "p90_ms": times[int(0.9 * (len(times) - 1))], "repeats": len(times)}


def write_results(stem: str, payload: dict, markdown: str, out_dir: Path = RESULTS) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    j, m = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    j.write_text(json.dumps(payload, indent=2) + "\n")
    m.write_text(markdown)
    return j, m
