"""A TensorRT engine once built: whether TensorRT and a GPU are here, the process's one TensorRT logger, a runner
with torch tensors as I/O buffers, and the parity check of an engine against ONNX Runtime on the card's gate data.

torch, tensorrt and onnxruntime are imported where they are used: a machine without TensorRT or a GPU must still
import this module to be told why it cannot build (:func:`tensorrt_available`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from unroll import gates as gate
from unroll.card import ModelCard
from unroll.errors import TrtBuildError, TrtUnavailableError
from unroll.trt_profile import ProfileShapes

Progress = Callable[[str], None]

TRT_MISSING = "TensorRT is not installed (pip install 'unroll[gpu]' on a machine with an NVIDIA GPU)."
NO_GPU = "No CUDA GPU is visible (TensorRT engines are built on the GPU they will run on)."
NEITHER = ("TensorRT engines need an NVIDIA GPU and the tensorrt package, and this machine has neither "
           "(run `unroll build` where `pip install 'unroll[gpu]'` and a CUDA GPU are available).")


def tensorrt_available() -> tuple[bool, str]:
    """(True, "TensorRT X on GPU") when an engine can be built here, else (False, one sentence saying why)."""
    try:
        import torch

        gpu = bool(torch.cuda.is_available())
    except Exception:  # a broken torch install is as good as no GPU for this purpose
        gpu = False
    try:
        import tensorrt as trt
    except ImportError:
        return False, (TRT_MISSING if gpu else NEITHER)
    except Exception as e:  # wheels present but the native libraries fail to load
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return False, f"TensorRT is installed but does not load ({first})."
    if not gpu:
        return False, NO_GPU
    return True, f"TensorRT {trt.__version__} on {torch.cuda.get_device_name(torch.cuda.current_device())}"


def require_tensorrt() -> Any:
    ok, why = tensorrt_available()
    if not ok:
        raise TrtUnavailableError(why)
    import tensorrt as trt

    return trt


_LOGGER: Any = None


def trt_logger(trt: Any) -> Any:
    """The process's one TensorRT logger (builders and runtimes share it): warnings and errors go to
    stderr, and errors are also kept so a failed build or run can say why."""
    global _LOGGER
    if _LOGGER is None or not isinstance(_LOGGER, trt.ILogger):  # one per tensorrt module

        class _Logger(trt.ILogger):
            def __init__(self) -> None:
                trt.ILogger.__init__(self)
                self.errors: list[str] = []

            def log(self, severity: Any, msg: str) -> None:
                if severity in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                    self.errors.append(msg)
                    print(f"[TensorRT] ERROR: {msg}", file=sys.stderr, flush=True)
                elif severity == trt.ILogger.Severity.WARNING:
                    print(f"[TensorRT] WARNING: {msg}", file=sys.stderr, flush=True)

        _LOGGER = _Logger()
    _LOGGER.errors.clear()
    return _LOGGER


#: TensorRT I/O types the runner can hand over as torch tensors (``DataType`` members of TensorRT 10.x and 11.x).
_TORCH_DTYPES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT32": "int32", "INT64": "int64",
                 "INT8": "int8", "UINT8": "uint8", "BOOL": "bool"}


#: Where the runner puts I/O buffers: ``cuda`` (the GPU the engine runs on). Tests that stand in for TensorRT on a
#: CPU set ``cpu``: buffers are then host tensors and the stream handle is 0; everything else is the same code path.
ENGINE_DEVICE = "cuda"


def _torch_dtype(trt: Any, dt: Any) -> Any:
    import torch

    for key, name in _TORCH_DTYPES.items():
        if dt == getattr(trt.DataType, key):
            return getattr(torch, name)
    raise TrtBuildError(f"engine I/O type {dt} has no torch equivalent here")


class EngineRunner:
    """A deserialized engine with one execution context; torch tensors on :data:`ENGINE_DEVICE` are the I/O buffers.

    Inputs are copied to the GPU on a private stream, output buffers are sized from the shapes the
    context infers after ``set_input_shape``, and everything runs on that stream, which is synchronized
    before the outputs are copied back.
    """

    def __init__(self, plan: Path | bytes, device: str | None = None) -> None:
        trt = require_tensorrt()
        import torch

        self._trt, self._torch = trt, torch
        self.device = device or ENGINE_DEVICE
        self._logger = trt_logger(trt)
        self._runtime = trt.Runtime(self._logger)
        blob = Path(plan).read_bytes() if isinstance(plan, str | Path) else bytes(plan)
        self.engine = self._runtime.deserialize_cuda_engine(blob)
        if self.engine is None:
            raise TrtBuildError("TensorRT could not deserialize the plan (built by another TensorRT version or "
                                f"for another GPU?): {'; '.join(self._logger.errors) or 'no details'}")
        self.context = self.engine.create_execution_context()
        if self.context is None:
            raise TrtBuildError("TensorRT could not create an execution context (out of GPU memory?)")
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.dtypes = {n: _torch_dtype(trt, self.engine.get_tensor_dtype(n)) for n in names}
        self.stream = torch.cuda.Stream() if self.device == "cuda" else None

    def io_info(self) -> list[dict]:
        """Name, direction, dtype and (profile-relative) shape of every engine I/O tensor, for the JSON."""
        return [{"name": n, "mode": "input" if n in self.inputs else "output",
                 "dtype": str(self.dtypes[n]).replace("torch.", ""),
                 "shape": list(self.engine.get_tensor_shape(n))} for n in self.inputs + self.outputs]

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self._torch
        missing = [n for n in self.inputs if n not in feeds]
        extra = [n for n in feeds if n not in self.inputs]
        if missing or extra:
            raise ValueError(f"engine inputs are {self.inputs}; missing {missing}, unexpected {extra}")
        keep: dict[str, Any] = {}
        on_stream = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with on_stream:
            for n in self.inputs:
                host = torch.from_numpy(np.ascontiguousarray(feeds[n])).to(self.dtypes[n])
                dev = host.to(self.device, non_blocking=False).contiguous()
                keep[n] = dev
                if not self.context.set_input_shape(n, tuple(dev.shape)):
                    raise ValueError(f"input {n!r} of shape {tuple(dev.shape)} lies outside the engine's "
                                     "optimization profile")
                self.context.set_tensor_address(n, dev.data_ptr())
            for n in self.outputs:
                shape = tuple(self.context.get_tensor_shape(n))
                if any(d < 0 for d in shape):
                    raise TrtBuildError(f"TensorRT could not infer the shape of output {n!r} ({shape})")
                keep[n] = torch.empty(shape, dtype=self.dtypes[n], device=self.device)
                self.context.set_tensor_address(n, keep[n].data_ptr())
            handle = self.stream.cuda_stream if self.stream is not None else 0
            if not self.context.execute_async_v3(handle):
                raise TrtBuildError(f"TensorRT execution failed: {'; '.join(self._logger.errors) or 'no details'}")
        if self.stream is not None:
            self.stream.synchronize()
        return {n: keep[n].float().cpu().numpy() if keep[n].dtype == torch.bfloat16 else keep[n].cpu().numpy()
                for n in self.outputs}


def run_engine(plan_path: Path | str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run a plan once on host arrays and return host arrays (deserializes each call; keep an
    :class:`EngineRunner` to run many batches)."""
    return EngineRunner(Path(plan_path))(feeds)


def engine_gate_cases(card: ModelCard, profile: ProfileShapes) -> tuple[list[gate.GateCase], str]:
    """The card's gate data (:func:`unroll.gates.gate_cases`) cut to fit the profile, and a description.

    Batches are at most the profile's largest; denoiser images are centre-cropped to its largest H×W.
    Cases whose main input is still outside the profile (smaller than its minimum) are left out, and
    the description says how many.
    """
    lo, _, hi = profile[card.input.name]
    max_hw = (hi[2], hi[3]) if len(hi) == 4 else None
    cases = gate.gate_cases(card, max_batch=hi[0], max_hw=max_hw)
    fits = [c for c in cases
            if all(a <= n <= b for a, n, b in zip(lo[1:], c.feeds[card.input.name].shape[1:], hi[1:], strict=True))]
    if not fits:
        raise TrtBuildError(f"none of the {len(cases)} gate cases of {card.name} fits the optimization profile "
                            f"{lo} … {hi} of input {card.input.name!r}")
    left = f"; {len(cases) - len(fits)} smaller than the profile minimum left out" if len(fits) < len(cases) else ""
    return fits, gate.gate_source(card, fits) + left


def _pad_batch(feeds: dict[str, np.ndarray], bmin: int) -> tuple[dict[str, np.ndarray], int]:
    """Repeat samples up to the profile's minimum batch (the extra rows are dropped afterwards)."""
    n = len(next(iter(feeds.values())))
    if n >= bmin:
        return feeds, n
    reps = -(-bmin // n)
    return {k: np.concatenate([v] * reps)[:bmin] for k, v in feeds.items()}, n


def parity_check(runner: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]], reference_onnx: Path,
                 card: ModelCard, cases: list[gate.GateCase], bmin: int = 1,
                 progress: Progress | None = None) -> dict:
    """Engine vs ONNX Runtime (CPU, FP32 graph) on the gate cases: :func:`unroll.gates.measure`'s metrics."""
    import onnxruntime as ort

    reference = gate.onnxruntime_run(reference_onnx, card.output)
    done = iter(range(1, len(cases) + 1))

    def engine(feeds: dict[str, np.ndarray]) -> np.ndarray:
        if progress:
            progress(f"parity {next(done)}/{len(cases)}")
        padded, n = _pad_batch(feeds, bmin)
        return runner(padded)[card.output][:n].astype(np.float32)

    try:
        metrics = gate.measure(card, cases, reference, engine)
    except ValueError as e:  # an output of another shape than ONNX Runtime's
        raise TrtBuildError(str(e)) from None
    return {"reference": f"onnxruntime {ort.__version__} CPU, {Path(reference_onnx).name}", **metrics}
