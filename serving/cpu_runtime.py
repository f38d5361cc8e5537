"""The two CPU runtimes of an exported graph, ONNX Runtime and OpenVINO: one inference call each.

Which runtime is faster depends on the graph, so the card records the choice per model (``card.cpu_runtime``,
measured by ``unroll bench export``); :func:`unroll.serving.runtimes.open_session` opens the one asked for (these,
or an AOTInductor package, or the PyTorch module on the CPU or a GPU) as one callable (``run(feeds)``,
``run.inputs``) for the Triton Python backend and the benchmarks. Settings: ``threads`` intra-op threads, latency
first; OpenVINO is forced to FP32 because its default on CPUs with BF16 support is bfloat16, outside the export's
parity tolerance. Nothing here imports PyTorch (the CPU serving image has none).
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from unroll.serving.runtimes import Session


def ort_session(path: str | Path, threads: int, spinning: bool = False):
    """The ONNX Runtime CPU session behind :func:`onnxruntime_session`: CPU provider, all graph optimizations, one
    inter-op thread, sequential execution; idle threads sleep unless ``spinning`` (spinning takes CPU from
    neighbours).

    The benchmarks' in-process baseline uses it too, so "in-process ONNX Runtime" and Triton's model run the
    graph with the same settings.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def onnxruntime_session(path: str, threads: int, spinning: bool) -> Session:
    """The ``onnxruntime`` runtime of :func:`unroll.serving.runtimes.open_session` (:func:`ort_session`'s settings)."""
    sess = ort_session(path, threads, spinning)
    names = [o.name for o in sess.get_outputs()]

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, sess.run(names, feeds), strict=True))

    run.runtime = "onnxruntime"  # type: ignore[attr-defined]
    run.inputs = {i.name: [d if isinstance(d, int) else None for d in i.shape]  # type: ignore[attr-defined]
                  for i in sess.get_inputs()}
    return run


def openvino_config(threads: int, bf16: bool = False) -> dict[str, object]:
    """OpenVINO CPU settings matching :func:`onnxruntime_session`'s (latency, ``threads`` threads, FP32 maths; ``bf16``:
    bfloat16 maths where the CPU has it, a reduced precision that must pass the FP16 gate)."""
    return {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_PRECISION_HINT": "bf16" if bf16 else "f32", "NUM_STREAMS": 1}


#: Seconds without an inference after which an OpenVINO model gives its intermediate buffers back.
RELEASE_IDLE_S = 2.0


class IdleRelease:
    """Calls ``release`` (OpenVINO's ``CompiledModel.release_memory``) once no inference has run for
    :attr:`idle_s`, then returns freed heap to the OS (glibc ``malloc_trim``).

    OpenVINO keeps the intermediate buffers of the largest shape it has run (about 0.5 KB per pixel for the
    denoiser): without this a burst of large images would leave the backend process that large for good. The
    next inference after a release allocates them again (a fraction of one inference's time), which only a
    request arriving after an idle pause pays. ``lock`` is the one the inferences hold.
    """

    def __init__(self, release: Callable[[], None], lock: threading.Lock, idle_s: float = RELEASE_IDLE_S) -> None:
        self._release, self._lock, self.idle_s = release, lock, idle_s
        self._last, self._dirty = 0.0, False
        self._wake = threading.Event()
        threading.Thread(target=self._loop, name="unroll-release-idle", daemon=True).start()

    def touch(self) -> None:
        """Record an inference (called with ``lock`` held)."""
        self._last, self._dirty = time.monotonic(), True
        self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while (left := self._last + self.idle_s - time.monotonic()) > 0:
                time.sleep(left)
            with self._lock:
                if self._dirty and time.monotonic() - self._last >= self.idle_s:
                    self._release()
                    self._dirty = False
                    _malloc_trim()


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


#: How many static-shape OpenVINO models one session keeps compiled (the least recently used goes first).
STATIC_SHAPES_KEPT = 8


class _StaticShapes:
    """OpenVINO models compiled for one input-shape signature each, on first use, the :data:`STATIC_SHAPES_KEPT`
    most recently used kept. A static shape lets OpenVINO plan every buffer and pick its kernels once; the
    dynamic-shape graph re-infers shapes and re-plans on every call (``unroll optimize`` measures both)."""

    def __init__(self, core, model, config: dict) -> None:
        self._core, self._model, self._config = core, model, config
        self._compiled: OrderedDict[tuple, tuple] = OrderedDict()

    def request(self, feeds: dict[str, np.ndarray]):
        key = tuple(sorted((k, v.shape) for k, v in feeds.items()))
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key][1]
        model = self._model.clone()
        model.reshape({k: list(v.shape) for k, v in feeds.items()})
        compiled = self._core.compile_model(model, "CPU", self._config)
        self._compiled[key] = (compiled, compiled.create_infer_request())
        while len(self._compiled) > STATIC_SHAPES_KEPT:
            self._compiled.popitem(last=False)
        return self._compiled[key][1]

    def release_memory(self) -> None:
        for compiled, _ in self._compiled.values():
            compiled.release_memory()


def openvino_session(path: str, threads: int, release_idle_s: float, static_shapes: bool = False,
                     bf16: bool = False) -> Session:
    """The ``openvino`` runtime of :func:`unroll.serving.runtimes.open_session`: one compiled model (or one per input
    shape, ``static_shapes``: :class:`_StaticShapes`), calls serialised on its infer request, buffers given back
    after ``release_idle_s`` idle seconds (:class:`IdleRelease`)."""
    import openvino as ov

    core = ov.Core()
    model = core.read_model(path)
    # names from the model as read: compiling may rename a port (e.g. after an FP16 graph's input casts)
    dims = {p.get_any_name(): [d.get_length() if d.is_static else None for d in p.get_partial_shape()]
            for p in model.inputs}
    index = {name: i for i, name in enumerate(dims)}
    outputs = [p.get_any_name() for p in model.outputs]
    lock = threading.Lock()
    if static_shapes:
        static = _StaticShapes(core, model, openvino_config(threads, bf16))
        request_for, release = static.request, static.release_memory
    else:
        compiled = core.compile_model(model, "CPU", openvino_config(threads, bf16))
        request = compiled.create_infer_request()
        request_for, release = (lambda feeds: request), compiled.release_memory
    idle = IdleRelease(release, lock, release_idle_s)

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        extra = set(feeds) - dims.keys()
        if extra:
            raise ValueError(f"unknown input(s) {sorted(extra)}; the graph's inputs are {sorted(dims)}")
        feeds = {k: np.ascontiguousarray(v) for k, v in feeds.items()}
        with lock:
            request = request_for(feeds)
            request.infer({index[k]: v for k, v in feeds.items()})
            out = {name: np.array(request.get_output_tensor(i).data, copy=True) for i, name in enumerate(outputs)}
            idle.touch()
            return out

    run.runtime = "openvino"  # type: ignore[attr-defined]
    run.inputs = dims  # type: ignore[attr-defined]
    return run
