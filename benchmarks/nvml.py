"""GPU utilisation and memory through NVML, sampled in a thread over a measured window.

``pynvml`` (NVIDIA's ``nvidia-ml-py``) where it is installed and a GPU answers; otherwise :func:`absent` says why,
and the sampler records nothing (a CPU machine is not an error, and nothing pretends to have measured a GPU).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np


def _handle(index: int = 0) -> tuple[Any, Any]:
    import pynvml

    pynvml.nvmlInit()
    return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)


def absent(index: int = 0) -> str | None:
    """Why GPU ``index`` cannot be sampled here (``None``: it can)."""
    try:
        _handle(index)
    except ImportError:
        return "pynvml (nvidia-ml-py) is not installed"
    except Exception as e:  # noqa: BLE001  (pynvml raises NVMLError_* subclasses for a driver or device missing)
        return f"NVML: {type(e).__name__}: {e}"
    return None


class GpuSampler:
    """Utilisation (%) and memory used (MiB) of GPU ``index``, every ``period_s`` from :meth:`start` to
    :meth:`stop`; nothing where :func:`absent` gives a reason."""

    def __init__(self, index: int = 0, period_s: float = 0.05) -> None:
        self.why_absent = absent(index)
        self.period_s = period_s
        self.samples: list[tuple[float, float, float]] = []
        self._nvml = self._dev = None
        if self.why_absent is None:
            self._nvml, self._dev = _handle(index)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> tuple[float, float, float]:
        u = self._nvml.nvmlDeviceGetUtilizationRates(self._dev)
        m = self._nvml.nvmlDeviceGetMemoryInfo(self._dev)
        return float(u.gpu), float(u.memory), m.used / 2**20

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append(self._read())

    def start(self) -> None:
        self.samples, self._stop = [], threading.Event()
        if self._dev is not None:
            self._thread = threading.Thread(target=self._loop, name="nvml-sampler", daemon=True)
            self._thread.start()

    def stop(self) -> dict[str, float] | None:
        """The window's mean and peak utilisation, mean memory-bus utilisation, peak memory used (``None``: no
        samples, or no GPU)."""
        self._stop.set()
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        if not self.samples:
            return None
        a = np.asarray(self.samples, dtype=np.float64)
        return {"gpu_util_mean": float(a[:, 0].mean()), "gpu_util_max": float(a[:, 0].max()),
                "mem_util_mean": float(a[:, 1].mean()), "memory_used_max_mib": float(a[:, 2].max()),
                "samples": len(self.samples)}
