"""The GPU check's device side: whether CUDA can be used, what the machine is, the TF32 switch, and the timer.

Why a module of its own: the cases (the iteration dial's CPU column), the candidates' measurements and the report's
machine line all need these few device facts, and every time in the results comes from the one timer here (CUDA
events on the GPU, the wall clock on the CPU), so the GPU rows and the CPU column beside them are timed alike.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def cuda_unavailable() -> str | None:
    """Why CUDA cannot be used here (no PyTorch, a CPU build, no device), or ``None`` when it can."""
    try:
        import torch
    except ImportError as e:
        return f"PyTorch is not importable ({e})"
    if not torch.cuda.is_available():
        built = torch.version.cuda
        return (f"torch {torch.__version__} sees no CUDA device" if built else
                f"torch {torch.__version__} is a CPU-only build")
    return None


def machine(device: str) -> dict:
    """GPU name, driver, torch/CUDA/cuDNN/Triton versions, CPU, Python, UTC date."""
    import torch

    info: dict[str, Any] = {"device": device, "python": platform.python_version(), "platform": platform.platform(),
                            "cpu_threads": torch.get_num_threads(),
                            "torch": torch.__version__, "cuda_build": torch.version.cuda,
                            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    try:
        info["cudnn"] = torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001 (informational only)
        info["cudnn"] = None
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), sm_count=p.multi_processor_count,
                    capability=f"{p.major}.{p.minor}")
        smi = shutil.which("nvidia-smi")
        if smi:
            try:
                info["driver"] = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                                capture_output=True, text=True, timeout=20).stdout.strip() or None
            except (OSError, subprocess.SubprocessError):
                info["driver"] = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def time_runner(run: Callable[[], Any], device: str, warmup: int, repeats: int, budget_s: float) -> dict:
    """p50/p99/mean ms per call after ``warmup`` calls: CUDA events around each call (wall clock on the CPU)."""
    import torch

    for _ in range(warmup):
        run()
    times: list[float] = []
    t0 = time.perf_counter()
    if device == "cuda":
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        events = []
        while len(events) < repeats and (len(events) < 10 or time.perf_counter() - t0 < budget_s):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            run()
            e.record()
            events.append((s, e))
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        times = [s.elapsed_time(e) for s, e in events]
    else:
        while len(times) < repeats and (len(times) < 3 or time.perf_counter() - t0 < budget_s):
            t = time.perf_counter()
            run()
            times.append((time.perf_counter() - t) * 1e3)
        wall = time.perf_counter() - t0
    a = np.asarray(times)
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)), "mean_ms": float(a.mean()),
            "wall_ms_per_call": wall * 1e3 / len(times), "repeats": len(times), "warmup": warmup}
