"""One CPU inference call for an exported graph, on ONNX Runtime or OpenVINO: the per-model CPU runtime.

Which runtime is faster depends on the graph, so the card records the choice per model (``card.cpu_runtime``,
measured by ``unroll bench export``), and :func:`open_session` hides both behind one callable (``run(feeds)``,
``run.inputs``) for the Triton Python backend and the benchmarks. Settings: ``threads`` intra-op threads, latency
first; OpenVINO is forced to FP32 because its default on CPUs with BF16 support is bfloat16, outside the export's
parity tolerance. Nothing here imports PyTorch (the CPU serving image has none).
"""

from __future__ import annotations

import ctypes
import importlib.util
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from unroll.errors import ServingError

RUNTIMES = ("onnxruntime", "openvino")
DEFAULT_RUNTIME = "onnxruntime"

Session = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
"""Also carries ``.runtime`` (its name) and ``.inputs`` ({graph input: dims, ``None`` where dynamic})."""


class RuntimeUnavailable(ServingError):
    """The requested CPU runtime is not installed (or not a known runtime)."""


def available(runtime: str) -> bool:
    """Whether ``runtime`` (one of :data:`RUNTIMES`) can be imported here."""
    if runtime not in RUNTIMES:
        return False
    return importlib.util.find_spec(runtime) is not None


def unavailable_reason(runtime: str) -> str | None:
    """``None`` when ``runtime`` is usable, else why not (for benchmark cells and errors)."""
    if runtime not in RUNTIMES:
        return f"unknown CPU runtime {runtime!r} (known: {', '.join(RUNTIMES)})"
    if not available(runtime):
        return f"{runtime} not installed (pip install {runtime})"
    return None


def open_session(path: str | Path, runtime: str = DEFAULT_RUNTIME, threads: int = 2, spinning: bool = False,
                 release_idle_s: float | None = None) -> Session:
    """A callable running the graph at ``path`` on ``runtime`` with ``threads`` threads.

    OpenVINO gives its intermediate buffers back after ``release_idle_s`` seconds without an inference
    (:class:`IdleRelease`; default :data:`RELEASE_IDLE_S`); ONNX Runtime's are bounded by the largest input it
    has run (the gateway's tiling bounds that).

    It takes ``{input name: array}`` (extra names are an error, as in ONNX Runtime) and returns
    ``{output name: array}`` for every graph output, in graph order, as arrays the caller owns. Safe
    to call from several threads (OpenVINO calls are serialised on one infer request).
    """
    why = unavailable_reason(runtime)
    if why:
        raise RuntimeUnavailable(why)
    if threads < 1:
        raise ValueError(f"threads must be ≥ 1, got {threads}")
    if runtime == "onnxruntime":
        return _ort_session(str(path), threads, spinning)
    return _openvino_session(str(path), threads, RELEASE_IDLE_S if release_idle_s is None else release_idle_s)


def ort_session(path: str | Path, threads: int, spinning: bool = False):
    """The ONNX Runtime CPU session behind :func:`open_session`: CPU provider, all graph optimizations, one inter-op
    thread, sequential execution; idle threads sleep unless ``spinning`` (spinning takes CPU from neighbours).

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


def _ort_session(path: str, threads: int, spinning: bool) -> Session:
    sess = ort_session(path, threads, spinning)
    names = [o.name for o in sess.get_outputs()]

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, sess.run(names, feeds), strict=True))

    run.runtime = "onnxruntime"  # type: ignore[attr-defined]
    run.inputs = {i.name: [d if isinstance(d, int) else None for d in i.shape]  # type: ignore[attr-defined]
                  for i in sess.get_inputs()}
    return run


def openvino_config(threads: int) -> dict[str, object]:
    """OpenVINO CPU settings matching :func:`_ort_session`'s (latency, ``threads`` threads, FP32 maths)."""
    return {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32",
            "NUM_STREAMS": 1}


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


def _openvino_session(path: str, threads: int, release_idle_s: float) -> Session:
    import openvino as ov

    compiled = ov.Core().compile_model(path, "CPU", openvino_config(threads))
    dims = {p.get_any_name(): [d.get_length() if d.is_static else None for d in p.get_partial_shape()]
            for p in compiled.inputs}
    outputs = [(p.get_any_name(), p) for p in compiled.outputs]
    request = compiled.create_infer_request()
    lock = threading.Lock()
    idle = IdleRelease(compiled.release_memory, lock, release_idle_s)

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        extra = set(feeds) - dims.keys()
        if extra:
            raise ValueError(f"unknown input(s) {sorted(extra)}; the graph's inputs are {sorted(dims)}")
        with lock:
            result = request.infer({k: np.ascontiguousarray(v) for k, v in feeds.items()})
            out = {name: np.array(result[port], copy=True) for name, port in outputs}
            idle.touch()
            return out

    run.runtime = "openvino"  # type: ignore[attr-defined]
    run.inputs = dims  # type: ignore[attr-defined]
    return run
