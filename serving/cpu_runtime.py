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
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from unroll.errors import RuntimeUnavailable

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


def open_session(path: str | Path, runtime: str = DEFAULT_RUNTIME, threads: int = 2, spinning: bool = False,
                 release_idle_s: float | None = None, static_shapes: bool = False, bf16: bool = False,
                 device: str = "cpu", fp16: bool = False, batch_sizes: Sequence[int] = ()) -> Session:
    """A callable running the graph at ``path`` on ``runtime`` with ``threads`` threads.

    ``static_shapes`` (OpenVINO): compile one static-shape model per input shape met instead of running the
    dynamic-shape graph (faster per call once compiled; :class:`_StaticShapes`). ``aotinductor``: ``path`` is an
    AOTInductor package (``export/aoti.py``). ``bf16`` (OpenVINO): bfloat16 maths (:func:`openvino_config`).
    ``torch``: the registered PyTorch module ``path``'s card names, checked against ``path`` before it serves, on
    ``device`` (``cpu`` or ``cuda:N``; the other runtimes run on the CPU only); ``bf16`` / ``fp16``: bfloat16 /
    float16 behind the card's fp16 gate, ``batch_sizes``: CUDA graphs captured at load
    (:func:`unroll.serving.torch_runtime.torch_session`).

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
        return _ort_session(str(path), threads, spinning)
    if runtime == "aotinductor":
        from unroll.serving.aoti_runtime import aoti_session  # (PyTorch only when this runtime is asked for)

        return aoti_session(path, threads)
    idle_s = RELEASE_IDLE_S if release_idle_s is None else release_idle_s
    return _openvino_session(str(path), threads, idle_s, static_shapes, bf16)


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


def openvino_config(threads: int, bf16: bool = False) -> dict[str, object]:
    """OpenVINO CPU settings matching :func:`_ort_session`'s (latency, ``threads`` threads, FP32 maths; ``bf16``:
    bfloat16 maths where the CPU has it, a reduced precision that must pass the FP16 gate)."""
    return {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_PRECISION_HINT": "bf16" if bf16 else "f32", "NUM_STREAMS": 1}


def bf16_unavailable() -> str | None:
    """Why OpenVINO cannot run bfloat16 maths here (not installed, no BF16 in this CPU), or ``None``."""
    why = unavailable_reason("openvino")
    if why:
        return why
    import openvino as ov

    if "BF16" not in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        return "this CPU has no bfloat16 instructions (OpenVINO's OPTIMIZATION_CAPABILITIES lacks BF16)"
    return None


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


def _openvino_session(path: str, threads: int, release_idle_s: float, static_shapes: bool = False,
                      bf16: bool = False) -> Session:
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
