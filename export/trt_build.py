"""``unroll build``: a TensorRT engine from the exported (and possibly quantized) ONNX, checked before it is kept.

Precision lives in the graph, not in builder flags. TensorRT 10 deprecated implicit INT8 calibration and
the FP16/INT8 builder flags and TensorRT 11 removed them, so ``unroll quantize`` writes the precision into
the ONNX (FP16 tensors with casts, explicit ``QuantizeLinear``/``DequantizeLinear`` pairs) and this module
builds every engine *strongly typed* from the matching file:

=========  ==================================  ==================================
precision  ONNX it builds from                 written by
=========  ==================================  ==================================
fp32       ``build/onnx/NAME.onnx``            ``unroll export NAME``
fp16       ``build/onnx/NAME.fp16.onnx``       ``unroll quantize NAME --precision fp16``
int8       ``build/onnx/NAME.int8.onnx``       ``unroll quantize NAME --precision int8``
=========  ==================================  ==================================

Everything model-specific comes from the model card in the ONNX being built (:mod:`unroll.card`),
never from the model's name. One optimization profile covers every input: the batch axis from
``card.trt_profile.batch`` (per-sample ``[B]`` inputs such as λ/σ follow it), the other dynamic axes from
``card.trt_profile.dims``, fixed dims as in the ONNX. ``batch``, ``image_sizes`` and ``dim_ranges`` (the
CLI's ``--batch-*``, ``--*-size`` and ``--dim-range NAME=MIN:OPT:MAX``; a NAME is ``INPUT[AXIS]`` or the
ONNX ``dim_param``, e.g. ``tokens``) override the card.

Before TensorRT sees the graph (:func:`preflight`, all on the CPU): the graph is linted for TensorRT's
ONNX parser (:mod:`unroll.export.trt_lint`; a failing node is named, nothing is parsed) and the profile's
GPU memory is estimated at its max shapes (:mod:`unroll.export.trt_memory`); a build whose estimate exceeds
the GPU's memory (or ``max_memory_gib``) is refused. After the build the engine is run on the card's gate
data and compared with ONNX Runtime running the FP32 graph, by the one gate implementation
(:mod:`unroll.export.gates`, the same data, metrics and tolerances ``unroll quantize`` uses: the
``fp32`` engine against ``card.gate("fp32")``, fp16/int8 against theirs; blocks and λ rules by
``rel_err``). The plan is renamed into place only when the gate passes, and the JSON beside it always
says what was measured, linted and estimated.

TensorRT 10.x (NGC Triton containers) and 11.x (pip) share this code. The one place the Python API
differs for what is used here is network creation (see :func:`_network_flags`): in 10.x a network is
strongly typed only when created with ``NetworkDefinitionCreationFlag.STRONGLY_TYPED``; in 11.x strong
typing is always on and that flag is deprecated and ignored (``EXPLICIT_BATCH`` is gone: explicit batch
has been the only mode since 10.0). Every TensorRT call here is checked on a CPU against the documented
Python API of both versions (``tests/fixtures/tensorrt_api.json``, recorded from NVIDIA's bindings and
documentation; ``tests/trt_api.py`` turns it into a stand-in module that rejects anything undocumented).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from unroll.export import gates as gate
from unroll.export import trt_memory

from unroll.card import ModelCard, from_onnx

__all__ = [
    "PRECISIONS", "EngineRunner", "GateError", "LintError", "MissingOnnxError", "Preflight", "ProfileMemoryError",
    "TrtBuildError", "TrtUnavailableError", "UnknownDimError", "axis_key", "build_engine", "card_dim_ranges",
    "dim_range_names", "dynamic_axes", "engine_gate_cases", "graph_inputs", "has_dynamic_image", "lint_graph",
    "onnx_path_for", "parity_check", "preflight", "profile_shapes", "read_card", "read_report", "resolve_dim_ranges",
    "run_engine", "tensorrt_available",
]

PRECISIONS = ("fp32", "fp16", "int8")
MAX_OPT_LEVEL = 5  # TensorRT's builder optimization levels are 0…5 (3 is its default)

TRT_MISSING = "TensorRT is not installed (pip install 'unroll[gpu]' on a machine with an NVIDIA GPU)."
NO_GPU = "No CUDA GPU is visible (TensorRT engines are built on the GPU they will run on)."
NEITHER = ("TensorRT engines need an NVIDIA GPU and the tensorrt package, and this machine has neither "
           "(run `unroll build` where `pip install 'unroll[gpu]'` and a CUDA GPU are available).")

Shape = tuple[int, ...]
Range = tuple[int, int, int]
ProfileShapes = dict[str, tuple[Shape, Shape, Shape]]
Progress = Callable[[str], None]


class TrtBuildError(RuntimeError):
    """The engine could not be built or checked; the message says why in one sentence (plus details)."""


class TrtUnavailableError(TrtBuildError):
    """No TensorRT or no CUDA GPU here: nothing to build with (the CLI exits 2 on this)."""


class MissingOnnxError(TrtBuildError, FileNotFoundError):
    """The ONNX to build from is missing; the message names the command that writes it."""


class LintError(TrtBuildError):
    """The graph breaks a TensorRT ONNX parser rule (:mod:`unroll.export.trt_lint`); TensorRT was not run."""

    def __init__(self, message: str, issues: list[str]) -> None:
        super().__init__(message)
        self.issues = issues


class ProfileMemoryError(TrtBuildError):
    """The profile's estimated GPU memory (:mod:`unroll.export.trt_memory`) exceeds the budget; nothing was built."""


class GateError(TrtBuildError):
    """The engine disagrees with ONNX Runtime FP32 beyond its gate; the JSON was written, the plan was not."""

    def __init__(self, message: str, report: dict) -> None:
        super().__init__(message)
        self.report = report


# --------------------------------------------------------------------------------------------- environment


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


def _require_tensorrt() -> Any:
    ok, why = tensorrt_available()
    if not ok:
        raise TrtUnavailableError(why)
    import tensorrt as trt

    return trt


def _trt_major(trt: Any) -> int:
    return int(str(trt.__version__).split(".")[0])


def _network_flags(trt: Any) -> int:
    """Creation flags for a strongly typed network.

    TensorRT 10.x: strong typing is opt-in through ``1 << STRONGLY_TYPED`` (and ``EXPLICIT_BATCH`` is
    deprecated and ignored, explicit batch being the only mode). TensorRT 11.x: every network is strongly
    typed and ``STRONGLY_TYPED`` is deprecated and ignored, so no flag is passed.
    """
    if _trt_major(trt) >= 11:
        return 0
    return 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)


_LOGGER: Any = None


def _logger(trt: Any) -> Any:
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


# --------------------------------------------------------------------------------------------- profiles


def onnx_path_for(name: str, precision: str, onnx_dir: Path = Path("build/onnx")) -> Path:
    """Where ``unroll export`` / ``unroll quantize`` write the graph a ``precision`` engine is built from."""
    _check_precision(precision)
    return Path(onnx_dir) / (f"{name}.onnx" if precision == "fp32" else f"{name}.{precision}.onnx")


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")


def _check_range(what: str, lo: int, mid: int, hi: int, floor: int = 1) -> None:
    if not floor <= lo <= mid <= hi:
        raise ValueError(f"{what} must satisfy {floor} ≤ min ≤ opt ≤ max, got {lo}/{mid}/{hi}")


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The real inputs (older exporters also list initializers as graph inputs)."""
    inits = {t.name for t in model.graph.initializer}
    return [v for v in model.graph.input if v.name not in inits]


#: ``INPUT[AXIS]``: one axis of one graph input (axis 0 is the batch), the canonical key of a dim range.
_AXIS_KEY = re.compile(r"(?P<input>.+)\[(?P<axis>\d+)\]")


def axis_key(input_name: str, axis: int) -> str:
    """The canonical name of one graph-input axis in dim ranges: ``INPUT[AXIS]`` (``x[1]``, ``noisy[2]``)."""
    return f"{input_name}[{axis}]"


def dynamic_axes(model: onnx.ModelProto) -> dict[str, str]:
    """Every dynamic non-batch axis of the graph's inputs: ``{"INPUT[AXIS]": dim_param or ""}`` in input order."""
    out = {}
    for v in graph_inputs(model):
        for axis, d in enumerate(v.type.tensor_type.shape.dim):
            if axis > 0 and not (d.HasField("dim_value") and d.dim_value > 0):
                out[axis_key(v.name, axis)] = d.dim_param
    return out


def dim_range_names(model: onnx.ModelProto) -> list[str]:
    """The names ``--dim-range`` accepts for this graph: each dynamic axis as ``INPUT[AXIS]``, and each ONNX
    ``dim_param`` of a dynamic non-batch axis (``tokens``, ``height``), which names every axis carrying it."""
    axes = dynamic_axes(model)
    params = [p for p in dict.fromkeys(axes.values()) if p]
    return [*axes, *params]


class UnknownDimError(ValueError):
    """A dim range names no dynamic axis of the graph; the message lists the names that exist."""


def resolve_dim_ranges(model: onnx.ModelProto, ranges: Mapping[str, Sequence[int]] | None
                       ) -> dict[str, Range]:
    """``{"INPUT[AXIS]": (min, opt, max)}`` from ranges named by ``INPUT[AXIS]`` or by ``dim_param``.

    A name that is no dynamic non-batch axis is an :class:`UnknownDimError` naming the valid ones (the batch
    axis has its own range, ``batch``; a fixed axis takes no range). Two names for the same axis must agree.
    """
    axes = dynamic_axes(model)
    valid = dim_range_names(model)
    out: dict[str, Range] = {}
    for name, r in (ranges or {}).items():
        rng = tuple(int(v) for v in r)
        if len(rng) != 3:
            raise ValueError(f"dim range {name!r} needs min, opt and max, got {list(rng)}")
        m = _AXIS_KEY.fullmatch(name)
        if m and int(m.group("axis")) == 0 and any(v.name == m.group("input") for v in graph_inputs(model)):
            raise UnknownDimError(f"{name} is the batch axis: its range is the batch range (--batch-min/--batch-opt/"
                                  "--batch-max, card.trt_profile.batch), not a dim range")
        keys = [name] if name in axes else [k for k, p in axes.items() if p and p == name]
        if not keys:
            fixed = ""
            if m:
                for v in graph_inputs(model):
                    dims = list(v.type.tensor_type.shape.dim)
                    axis = int(m.group("axis"))
                    if v.name == m.group("input") and axis < len(dims) and dims[axis].dim_value > 0:
                        fixed = f" ({name} is fixed at {dims[axis].dim_value} in the graph)"
            raise UnknownDimError(f"no dynamic axis is called {name!r}{fixed}; this graph's dynamic axes are "
                                  f"{', '.join(valid) or 'none (every non-batch axis is fixed)'}")
        for k in keys:
            if k in out and out[k] != rng:
                raise ValueError(f"two ranges for {k}: {list(out[k])} and {list(rng)} ({name})")
            out[k] = rng
    return out


def card_dim_ranges(model: onnx.ModelProto, card: ModelCard) -> dict[str, Range]:
    """The card's ranges (``card.trt_profile.dims``, axes of one sample of the main input) as ``INPUT[AXIS]`` keys
    of this graph's dynamic axes (a card range for an axis the graph fixes is not a range here)."""
    axes = dynamic_axes(model)
    out = {}
    for key, r in card.trt_profile.dims.items():
        _check_range(f"card.trt_profile.dims[{key!r}]", *r)
        k = axis_key(card.input.name, int(key) + 1)
        if k in axes:
            out[k] = tuple(r)
    return out


def profile_shapes(model: onnx.ModelProto, card: ModelCard, batch: Range | None = None,
                   image_sizes: tuple[tuple[int, int], tuple[int, int], tuple[int, int]] | None = None,
                   dim_ranges: Mapping[str, Sequence[int]] | None = None) -> ProfileShapes:
    """min/opt/max shape of every graph input for one TensorRT optimization profile.

    Axis 0 is the batch and follows ``batch`` (default ``card.trt_profile.batch``; ``[B]`` inputs like
    λ/σ follow it too). Every other dynamic axis takes its range from, first, ``dim_ranges`` (names as
    :func:`resolve_dim_ranges` takes them: ``INPUT[AXIS]`` or the ONNX ``dim_param``), then ``image_sizes``
    (``(H, W)`` for min, opt, max, for H and W of a ``[B, C, H, W]`` main input), then the card
    (``card.trt_profile.dims``). Fixed dims keep their ONNX value. A dynamic axis with no range is an error
    naming the input and the card field to set, rather than a silent guess. Axes of the main input must
    stay ≥ ``card.input.min_size``.
    """
    batch = tuple(batch or card.trt_profile.batch)
    _check_range("batch", *batch)
    floor = card.input.min_size
    ranges: dict[str, Range] = card_dim_ranges(model, card)
    main_dims = next((len(v.type.tensor_type.shape.dim) for v in graph_inputs(model) if v.name == card.input.name), 0)
    given = resolve_dim_ranges(model, dim_ranges)
    dynamic = dynamic_axes(model)
    image_axes = [axis_key(card.input.name, a) for a in (2, 3)] if main_dims == 4 else []
    if image_sizes is not None and any(k in dynamic for k in image_axes):  # fixed H×W: sizes do not apply
        (h0, w0), (h1, w1), (h2, w2) = image_sizes
        _check_range("image height", h0, h1, h2, floor)
        _check_range("image width", w0, w1, w2, floor)
        for i, key in enumerate(image_axes):
            if key not in dynamic:
                continue
            if key in given:
                raise ValueError(f"{key} has a dim range and image sizes; give one of them")
            ranges[key] = tuple(s[i] for s in image_sizes)
    ranges.update(given)
    for key, r in ranges.items():
        main = key.startswith(f"{card.input.name}[")
        _check_range(f"dim range {key}", *r, floor if main else 1)
    out: ProfileShapes = {}
    for v in graph_inputs(model):
        dims = list(v.type.tensor_type.shape.dim)
        if not dims:
            raise ValueError(f"input {v.name!r} is a scalar or has no shape; TensorRT profiles need ranked inputs")
        main = v.name == card.input.name
        lo, mid, hi = [], [], []
        for axis, d in enumerate(dims):
            key = axis_key(v.name, axis)
            if d.HasField("dim_value") and d.dim_value > 0:
                r = (d.dim_value,) * 3
            elif axis == 0:
                r = batch
            elif key in ranges:
                r = ranges[key]
            else:
                label = d.dim_param or f"axis {axis}"
                hint = (f" (set {card.field_hint('trt_profile', 'dims', str(axis - 1), value='<[min, opt, max]>')}"
                        if main else " (give")
                hint += f" or --dim-range {d.dim_param or key}=MIN:OPT:MAX)"
                raise ValueError(f"input {v.name!r} has a dynamic dimension {label!r} with no range{hint}")
            lo.append(r[0])
            mid.append(r[1])
            hi.append(r[2])
        out[v.name] = (tuple(lo), tuple(mid), tuple(hi))
    return out


def has_dynamic_image(model: onnx.ModelProto) -> bool:
    """Whether some 4-D input has a dynamic H or W (then image sizes matter)."""
    for v in graph_inputs(model):
        dims = v.type.tensor_type.shape.dim
        if len(dims) == 4 and any(not (d.HasField("dim_value") and d.dim_value > 0) for d in list(dims)[2:]):
            return True
    return False


# --------------------------------------------------------------------------------------------- running


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
        trt = _require_tensorrt()
        import torch

        self._trt, self._torch = trt, torch
        self.device = device or ENGINE_DEVICE
        self._logger = _logger(trt)
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


# --------------------------------------------------------------------------------------------- gate data


def read_card(path: Path) -> ModelCard:
    """The card of the ONNX being built (a graph without one is an error saying how to get one)."""
    try:
        return from_onnx(path)
    except ValueError as e:
        raise TrtBuildError(str(e)) from None


def engine_gate_cases(card: ModelCard, profile: ProfileShapes) -> tuple[list[gate.GateCase], str]:
    """The card's gate data (:func:`unroll.export.gates.gate_cases`) cut to fit the profile, and a description.

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
    """Engine vs ONNX Runtime (CPU, FP32 graph) on the gate cases: :func:`unroll.export.gates.measure`'s metrics."""
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


# --------------------------------------------------------------------------------------------- build


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_atomic(path: Path, blob: bytes) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_bytes(blob)
    os.replace(tmp, path)


def _parser_errors(parser: Any) -> list[str]:
    """Every parser error as 'node NAME (OP): description [code]' (``ParserError.node_name`` and
    ``node_operator`` exist in TensorRT 10.x and 11.x; the node index is the fallback for errors of no node)."""
    rows = []
    for i in range(parser.num_errors):
        e = parser.get_error(i)
        node = e.node_name() or (f"#{e.node()}" if e.node() >= 0 else "")
        op = e.node_operator()
        where = f"node {node!r}" + (f" ({op})" if op else "") if node else "graph"
        rows.append(f"{where}: {e.desc()} [{e.code()}]")
    return rows


def _load_timing_cache(config: Any, path: Path) -> tuple[Any, str]:
    """Attach the on-disk timing cache (same TensorRT and GPU only) or a fresh one; say which."""
    blob = path.read_bytes() if path.exists() else b""
    cache = config.create_timing_cache(blob) if blob else None
    if cache is not None and config.set_timing_cache(cache, ignore_mismatch=False):
        return cache, f"loaded {len(blob)} bytes"
    cache = config.create_timing_cache(b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    return cache, "new" if not blob else "new (the cached one was from another TensorRT version or GPU)"


def _finish(tmp_plan: Path, plan_path: Path, json_path: Path, report: dict, failures: list[str]) -> None:
    """Write the JSON; keep the plan only when nothing failed (a stale plan is removed, not left beside a
    JSON that says the new build failed)."""
    report["passed"] = not failures
    report["failures"] = failures
    _write_atomic(json_path, (json.dumps(report, indent=2) + "\n").encode())
    if failures:
        tmp_plan.unlink(missing_ok=True)
        plan_path.unlink(missing_ok=True)
        what = f"{report['precision']} engine for {report['model']}"
        raise GateError(f"The {what} failed its parity gate against ONNX Runtime FP32: {'; '.join(failures)} "
                        f"(measurements in {json_path}; no plan was written).", report)
    os.replace(tmp_plan, plan_path)


def require_onnx(name: str, precision: str, onnx_dir: Path, verify: bool = True) -> tuple[Path, Path]:
    """The ONNX a ``precision`` engine builds from and the FP32 reference; a missing one is an error naming
    the command that writes it."""
    src, ref = onnx_path_for(name, precision, onnx_dir), onnx_path_for(name, "fp32", onnx_dir)
    for path, p in ((src, precision), (ref, "fp32")):
        if not path.exists() and (path == src or verify):
            cmd = f"unroll export {name}" if p == "fp32" else f"unroll quantize {name} --precision {p}"
            raise MissingOnnxError(f"{path} does not exist: run `{cmd}` first.")
    return src, ref


#: What lowers a profile's memory, for the message of a refused build.
LOWER_MEMORY = ("lower the profile's largest shapes (`unroll build --batch-max N`, `--max-size HxW` for images, "
                "`--dim-range NAME=MIN:OPT:MAX` for other axes such as tokens; Python: batch=, image_sizes=, "
                "dim_ranges=), or raise --max-memory-gib where the GPU has more memory")


def lint_graph(model: onnx.ModelProto) -> list[str]:
    """:func:`unroll.export.trt_lint.lint` on the graph TensorRT is about to parse, one 'node NAME (OP): why' per
    issue that would make the parse fail (issues a newer lint marks ``severity='warning'`` are not counted)."""
    from unroll.export import trt_lint

    return [str(i) for i in trt_lint.lint(model) if getattr(i, "severity", "error") != "warning"]


@dataclass
class Preflight:
    """What is checked on the CPU before TensorRT sees a graph: the profile, the lint, the memory estimate."""

    profile: ProfileShapes
    lint: list[str]
    memory: trt_memory.MemoryEstimate
    #: ``(bytes, "where the number comes from")`` the estimate was checked against, or ``None`` (no GPU, no limit).
    budget: tuple[int, str] | None

    def report(self) -> dict:
        return {"lint": {"checker": "unroll.export.trt_lint", "issues": self.lint},
                "memory": {**self.memory.to_json(),
                           "budget": None if self.budget is None else
                           {"bytes": self.budget[0], "gib": round(self.budget[0] / trt_memory.GIB, 2),
                            "source": self.budget[1]}}}


def preflight(src: Path, card: ModelCard, batch: Range | None = None,
              image_sizes: tuple[tuple[int, int], tuple[int, int], tuple[int, int]] | None = None,
              dim_ranges: Mapping[str, Sequence[int]] | None = None,
              max_memory_gib: float | None = None) -> Preflight:
    """The profile (:func:`profile_shapes`), then the TensorRT lint of ``src`` (:class:`LintError` naming each
    node), then the memory estimate at the profile's max shapes checked against ``max_memory_gib`` or, when
    that is not given and CUDA is visible, the GPU's total memory (:class:`ProfileMemoryError`)."""
    graph = onnx.load(str(src))
    profile = profile_shapes(graph, card, batch, image_sizes, dim_ranges)
    issues = lint_graph(graph)
    if issues:
        raise LintError(f"{Path(src).name} breaks {len(issues)} TensorRT ONNX parser rule(s) "
                        "(unroll.export.trt_lint); nothing was handed to TensorRT:\n  " + "\n  ".join(issues), issues)
    est = trt_memory.estimate(graph, {n: hi for n, (_, _, hi) in profile.items()})
    budget: tuple[int, str] | None = None
    if max_memory_gib is not None:
        if max_memory_gib <= 0:
            raise ValueError(f"max_memory_gib must be positive, not {max_memory_gib}")
        budget = (int(max_memory_gib * trt_memory.GIB), f"--max-memory-gib {max_memory_gib:g}")
    else:
        gpu = trt_memory.gpu_total_bytes()
        if gpu is not None:
            budget = (gpu[0], f"the GPU's {trt_memory.fmt_bytes(gpu[0])} ({gpu[1]})")
    if budget is not None:
        try:
            trt_memory.check_budget(est, budget[0], budget[1], LOWER_MEMORY)
        except trt_memory.MemoryBudgetError as e:
            raise ProfileMemoryError(str(e)) from None
    return Preflight(profile, issues, est, budget)


def build_engine(name: str, precision: str = "fp32", onnx_dir: Path = Path("build/onnx"),
                 out_dir: Path = Path("build/trt"), batch: Range | None = None,
                 image_sizes: tuple[tuple[int, int], tuple[int, int], tuple[int, int]] | None = None,
                 workspace_gib: float = 4.0, opt_level: int = 3,
                 timing_cache: Path | None = Path("build/trt/timing.cache"), verify: bool = True,
                 tf32: bool = False, gates: Mapping[str, float] | None = None,
                 progress: Progress | None = None, dim_ranges: Mapping[str, Sequence[int]] | None = None,
                 max_memory_gib: float | None = None) -> dict:
    """Build ``out_dir/NAME.PRECISION.plan`` (+ ``.json``) strongly typed from the precision's ONNX.

    The profile, gate data and tolerances come from the card in that ONNX: ``batch`` (min, opt, max),
    ``image_sizes`` and ``dim_ranges`` (``{"INPUT[AXIS]" or dim_param: (min, opt, max)}``, see
    :func:`profile_shapes`) override ``card.trt_profile``; ``gates`` (``{metric: tolerance}``) override
    ``card.gate(precision)``. ``tf32`` is off by default so FP32 layers compute in IEEE FP32 and the
    parity gate compares like with like; precision is otherwise entirely the graph's.

    Before TensorRT is touched (:func:`preflight`): the graph is linted for TensorRT's parser
    (:class:`LintError`, naming the nodes) and the profile's memory is estimated at its max shapes and checked
    against ``max_memory_gib`` or the GPU's memory (:class:`ProfileMemoryError`); both go into the JSON.
    Raises :class:`MissingOnnxError`, :class:`TrtUnavailableError`, :class:`TrtBuildError` or
    :class:`GateError` (JSON written, no plan).
    """
    _check_precision(precision)
    if not 0 <= opt_level <= MAX_OPT_LEVEL:
        raise ValueError(f"builder optimization level must be 0…{MAX_OPT_LEVEL}, not {opt_level}")
    if workspace_gib <= 0:
        raise ValueError(f"workspace must be positive, not {workspace_gib} GiB")
    say = progress or (lambda _msg: None)
    onnx_dir, out_dir = Path(onnx_dir), Path(out_dir)
    src, ref = require_onnx(name, precision, onnx_dir, verify)
    card = read_card(src)
    tolerances = gate.tolerances(card, precision, gates)
    say("checking the graph and the profile's memory")
    checked = preflight(src, card, batch, image_sizes, dim_ranges, max_memory_gib)
    profile = checked.profile
    batch = tuple(batch or card.trt_profile.batch)
    input_names = list(profile)

    trt = _require_tensorrt()
    import torch

    say("parsing ONNX")
    logger = _logger(trt)
    builder = trt.Builder(logger)
    network = builder.create_network(_network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(src)):
        rows = _parser_errors(parser)
        raise TrtBuildError(f"TensorRT's ONNX parser rejected {src} with {len(rows)} error(s):\n  "
                            + "\n  ".join(rows or ["(no details)"]))
    net_inputs = [network.get_input(i).name for i in range(network.num_inputs)]
    if sorted(net_inputs) != sorted(input_names):
        raise TrtBuildError(f"TensorRT sees inputs {net_inputs} but the ONNX declares {input_names}")

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    config.builder_optimization_level = int(opt_level)
    if not tf32:  # BuilderFlag.TF32 is in 10.x and 11.x (11.x removed the precision flags, not TF32)
        config.clear_flag(trt.BuilderFlag.TF32)
    opt_profile = builder.create_optimization_profile()
    for n, (lo, mid, hi) in profile.items():
        opt_profile.set_shape(n, lo, mid, hi)
    if config.add_optimization_profile(opt_profile) < 0:
        raise TrtBuildError(f"TensorRT rejected the optimization profile {profile}")
    cache_note = "disabled"
    if timing_cache is not None:
        timing_cache = Path(timing_cache)
        _, cache_note = _load_timing_cache(config, timing_cache)

    say(f"building the {precision} engine (TensorRT is timing kernels; this can take minutes)")
    t0 = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    build_s = time.perf_counter() - t0
    if plan is None:
        raise TrtBuildError(f"TensorRT could not build the {precision} engine for {name}: "
                            + ("; ".join(logger.errors[-3:]) or "see the builder messages above"))
    blob = bytes(plan)
    if timing_cache is not None:
        timing_cache.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(timing_cache, bytes(config.get_timing_cache().serialize()))

    out_dir.mkdir(parents=True, exist_ok=True)
    plan_path = out_dir / f"{name}.{precision}.plan"
    json_path = plan_path.with_suffix(".json")
    tmp_plan = plan_path.with_name(f".{plan_path.name}.partial")
    tmp_plan.write_bytes(blob)

    dev = torch.cuda.current_device()
    cc = torch.cuda.get_device_capability(dev)
    report: dict[str, Any] = {
        "model": name, "task": card.task, "precision": precision,
        "onnx": str(src), "onnx_sha256": _sha256(src),
        "plan": str(plan_path), "plan_bytes": len(blob), "plan_sha256": hashlib.sha256(blob).hexdigest(),
        "tensorrt": str(trt.__version__),
        "network": "strongly typed" + (" (always, TensorRT 11)" if _trt_major(trt) >= 11 else " (STRONGLY_TYPED)"),
        "gpu": {"name": torch.cuda.get_device_name(dev), "compute_capability": f"{cc[0]}.{cc[1]}"},
        "cuda": torch.version.cuda, "torch": torch.__version__,
        "builder": {"workspace_gib": workspace_gib, "optimization_level": opt_level, "tf32": tf32,
                    "timing_cache": {"path": None if timing_cache is None else str(timing_cache),
                                     "status": cache_note}},
        "profiles": [{n: {"min": list(lo), "opt": list(mid), "max": list(hi)}
                      for n, (lo, mid, hi) in profile.items()}],
        "max_batch_size": batch[2],
        **checked.report(),
        "build_seconds": round(build_s, 2),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "card": card.model_dump(mode="json"),
    }
    runner = EngineRunner(blob, ENGINE_DEVICE)
    report["io"] = runner.io_info()
    failures: list[str] = []
    if verify:
        say("checking the engine against ONNX Runtime FP32")
        cases, report["gate_data"] = engine_gate_cases(card, profile)
        report["parity"] = parity_check(runner, ref, card, cases, batch[0], say)
        report["gate"] = tolerances
        failures = gate.failures(report["parity"], tolerances)
        unchecked = gate.unmeasured(report["parity"], tolerances)
        if unchecked:
            report["gate_unmeasured"] = unchecked
    else:
        report["parity"] = None
        report["gate"] = "skipped (verify=False)"
    _finish(tmp_plan, plan_path, json_path, report, failures)
    return report


def read_report(name: str, precision: str, out_dir: Path = Path("build/trt")) -> dict | None:
    """The JSON written beside a plan, or None."""
    path = Path(out_dir) / f"{name}.{precision}.json"
    return json.loads(path.read_text()) if path.exists() else None
