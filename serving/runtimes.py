"""Which runtime runs an exported graph, and a session on it: :func:`open_session`, what the Triton Python backend
and the benchmarks call.

A card names its model's runtime (``card.cpu_runtime``, chosen by measurement: ``unroll bench export``, ``unroll
optimize``): ONNX Runtime or OpenVINO on the CPU (:mod:`.cpu_runtime`), an AOTInductor package
(:mod:`.aoti_runtime`), or the registered PyTorch module (:mod:`.torch_runtime`), the one that also runs on a GPU
(``device="cuda:N"``, a ``KIND_GPU`` instance). :func:`open_session` hides them behind one callable
(:data:`Session`). Nothing here imports PyTorch unless a runtime that runs on it is asked for (the CPU serving
image has none).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from unroll.errors import RuntimeUnavailable
from unroll.serving.cpu_runtime import RELEASE_IDLE_S, onnxruntime_session, openvino_session

RUNTIMES = ("onnxruntime", "openvino", "aotinductor", "torch")
#: Import name of each runtime (AOTInductor packages run on PyTorch; ``torch`` is the registered module itself,
#: :mod:`unroll.serving.torch_runtime`, the one that also runs on a GPU).
_MODULES = {"onnxruntime": "onnxruntime", "openvino": "openvino", "aotinductor": "torch", "torch": "torch"}
DEFAULT_RUNTIME = "onnxruntime"

Session = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
"""Also carries ``.runtime`` (its name) and ``.inputs`` ({graph input: dims, ``None`` where dynamic})."""


def available(runtime: str) -> bool:
    """Whether ``runtime`` (one of :data:`RUNTIMES`) can be imported here."""
    if runtime not in RUNTIMES:
        return False
    return importlib.util.find_spec(_MODULES[runtime]) is not None


def unavailable_reason(runtime: str) -> str | None:
    """``None`` when ``runtime`` is usable, else why not (for benchmark cells and errors)."""
    if runtime not in RUNTIMES:
        return f"unknown CPU runtime {runtime!r} (known: {', '.join(RUNTIMES)})"
    if not available(runtime):
        return f"{runtime} not installed (pip install {_MODULES[runtime]})"
    return None


def bf16_unavailable() -> str | None:
    """Why OpenVINO cannot run bfloat16 maths here (not installed, no BF16 in this CPU), or ``None``."""
    why = unavailable_reason("openvino")
    if why:
        return why
    import openvino as ov

    if "BF16" not in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        return "this CPU has no bfloat16 instructions (OpenVINO's OPTIMIZATION_CAPABILITIES lacks BF16)"
    return None


def open_session(path: str | Path, runtime: str = DEFAULT_RUNTIME, threads: int = 2, spinning: bool = False,
                 release_idle_s: float | None = None, static_shapes: bool = False, bf16: bool = False,
                 device: str = "cpu", fp16: bool = False, batch_sizes: Sequence[int] = ()) -> Session:
    """A callable running the graph at ``path`` on ``runtime`` with ``threads`` threads.

    ``static_shapes`` (OpenVINO): compile one static-shape model per input shape met instead of running the
    dynamic-shape graph (faster per call once compiled; :class:`.cpu_runtime._StaticShapes`). ``aotinductor``:
    ``path`` is an AOTInductor package (``export/aoti.py``). ``bf16`` (OpenVINO): bfloat16 maths
    (:func:`.cpu_runtime.openvino_config`).
    ``torch``: the registered PyTorch module ``path``'s card names, checked against ``path`` before it serves, on
    ``device`` (``cpu`` or ``cuda:N``; the other runtimes run on the CPU only); ``bf16`` / ``fp16``: bfloat16 /
    float16 behind the card's fp16 gate, ``batch_sizes``: CUDA graphs captured at load
    (:func:`unroll.serving.torch_runtime.torch_session`).

    OpenVINO gives its intermediate buffers back after ``release_idle_s`` seconds without an inference
    (:class:`.cpu_runtime.IdleRelease`; default :data:`.cpu_runtime.RELEASE_IDLE_S`); ONNX Runtime's are bounded by
    the largest input it has run (the gateway's tiling bounds that).

    It takes ``{input name: array}`` (extra names are an error, as in ONNX Runtime) and returns
    ``{output name: array}`` for every graph output, in graph order, as arrays the caller owns. Safe
    to call from several threads (OpenVINO calls are serialised on one infer request).
    """
    why = unavailable_reason(runtime)
    if why:
        raise RuntimeUnavailable(why)
    if threads < 1:
        raise ValueError(f"threads must be ≥ 1, got {threads}")
    if bf16 and runtime not in ("openvino", "torch"):
        raise ValueError(f"bf16 maths is an OpenVINO or torch setting, not one of {runtime}")
    if fp16 and (runtime != "torch" or bf16):
        raise ValueError("fp16 maths is a torch runtime setting, and one of bf16 and fp16 at most")
    if device != "cpu" and runtime != "torch":
        raise ValueError(f"{runtime} runs on the CPU here; device {device!r} takes the torch runtime")
    if runtime == "torch":
        from unroll.serving.torch_runtime import torch_session  # (PyTorch only when this runtime is asked for)

        half = "bfloat16" if bf16 else "float16" if fp16 else None
        return torch_session(path, threads, device, half=half, batch_sizes=batch_sizes)
    if runtime == "onnxruntime":
        return onnxruntime_session(str(path), threads, spinning)
    if runtime == "aotinductor":
        from unroll.serving.aoti_runtime import aoti_session  # (PyTorch only when this runtime is asked for)

        return aoti_session(path, threads)
    idle_s = RELEASE_IDLE_S if release_idle_s is None else release_idle_s
    return openvino_session(str(path), threads, idle_s, static_shapes, bf16)
