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
``card.trt_profile.batch`` (per-sample ``[B]`` inputs such as λ/σ follow it), the main input's dynamic
axes from ``card.trt_profile.dims``, fixed dims as in the ONNX; ``batch`` / ``image_sizes`` arguments
(the CLI's options) override the card. After the build the engine is run on the card's gate data and
compared with ONNX Runtime running the FP32 graph, by the one gate implementation
(:mod:`unroll.export.gates`, the same data, metrics and tolerances ``unroll quantize`` uses: the
``fp32`` engine against ``card.gate("fp32")``, fp16/int8 against theirs). The plan is renamed into place
only when the gate passes, and the JSON beside it always says what was measured.

TensorRT 10.x (NGC Triton containers) and 11.x (pip) share this code. The one place the Python API
differs for what is used here is network creation (see :func:`_network_flags`): in 10.x a network is
strongly typed only when created with ``NetworkDefinitionCreationFlag.STRONGLY_TYPED``; in 11.x strong
typing is always on and that flag is deprecated and ignored (``EXPLICIT_BATCH`` is gone: explicit batch
has been the only mode since 10.0).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from unroll.export import gates as gate

from unroll.card import ModelCard, from_onnx

__all__ = [
    "PRECISIONS", "EngineRunner", "GateError", "MissingOnnxError", "TrtBuildError", "TrtUnavailableError",
    "build_engine", "engine_gate_cases", "graph_inputs", "has_dynamic_image", "onnx_path_for", "parity_check",
    "profile_shapes", "read_card", "read_report", "run_engine", "tensorrt_available",
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
    if _LOGGER is None:

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


def _card_axes(card: ModelCard) -> dict[int, Range]:
    """The card's profile ranges as graph axes of its main input (card axes are per sample: +1 for the batch)."""
    out = {}
    for key, r in card.trt_profile.dims.items():
        _check_range(f"card.trt_profile.dims[{key!r}]", *r)
        out[int(key) + 1] = tuple(r)
    return out


def profile_shapes(model: onnx.ModelProto, card: ModelCard, batch: Range | None = None,
                   image_sizes: tuple[tuple[int, int], tuple[int, int], tuple[int, int]] | None = None
                   ) -> ProfileShapes:
    """min/opt/max shape of every graph input for one TensorRT optimization profile.

    Axis 0 is the batch and follows ``batch`` (default ``card.trt_profile.batch``; ``[B]`` inputs like
    λ/σ follow it too); the main input's dynamic axes follow ``card.trt_profile.dims``, except that
    ``image_sizes`` (``(H, W)`` for min, opt, max; each side ≥ ``card.input.min_size``) overrides H, W of
    a ``[B, C, H, W]`` input; fixed dims keep their ONNX value. A dynamic axis with no range is an error
    naming the input and the card field to set, rather than a silent guess.
    """
    batch = tuple(batch or card.trt_profile.batch)
    _check_range("batch", *batch)
    floor = card.input.min_size
    if image_sizes is not None:
        (h0, w0), (h1, w1), (h2, w2) = image_sizes
        _check_range("image height", h0, h1, h2, floor)
        _check_range("image width", w0, w1, w2, floor)
    axes = _card_axes(card)
    out: ProfileShapes = {}
    for v in graph_inputs(model):
        dims = list(v.type.tensor_type.shape.dim)
        if not dims:
            raise ValueError(f"input {v.name!r} is a scalar or has no shape; TensorRT profiles need ranked inputs")
        main = v.name == card.input.name
        lo, mid, hi = [], [], []
        for axis, d in enumerate(dims):
            if d.HasField("dim_value") and d.dim_value > 0:
                r = (d.dim_value,) * 3
            elif axis == 0:
                r = batch
            elif main and len(dims) == 4 and axis in (2, 3) and image_sizes is not None:
                r = tuple(s[axis - 2] for s in image_sizes)
            elif main and axis in axes:
                r = axes[axis]
            else:
                label = d.dim_param or f"axis {axis}"
                hint = f" (set card.trt_profile.dims['{axis - 1}'])" if main else ""
                hint += " or give image sizes" if main and len(dims) == 4 and axis in (2, 3) else ""
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


def _torch_dtype(trt: Any, dt: Any) -> Any:
    import torch

    table = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT32": torch.int32,
             "INT64": torch.int64, "INT8": torch.int8, "UINT8": torch.uint8, "BOOL": torch.bool}
    for key, tdt in table.items():
        member = getattr(trt.DataType, key, None)
        if member is not None and dt == member:
            return tdt
    raise TrtBuildError(f"engine I/O type {dt} has no torch equivalent here")


class EngineRunner:
    """A deserialized engine with one execution context; torch CUDA tensors are the I/O buffers.

    Inputs are copied to the GPU on a private stream, output buffers are sized from the shapes the
    context infers after ``set_input_shape``, and everything runs on that stream, which is synchronized
    before the outputs are copied back.
    """

    def __init__(self, plan: Path | bytes) -> None:
        trt = _require_tensorrt()
        import torch

        self._trt, self._torch = trt, torch
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
        self.stream = torch.cuda.Stream()

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
        with torch.cuda.stream(self.stream):
            for n in self.inputs:
                host = torch.from_numpy(np.ascontiguousarray(feeds[n])).to(self.dtypes[n])
                dev = host.to("cuda", non_blocking=False)
                keep[n] = dev
                if not self.context.set_input_shape(n, tuple(dev.shape)):
                    raise ValueError(f"input {n!r} of shape {tuple(dev.shape)} lies outside the engine's "
                                     "optimization profile")
                self.context.set_tensor_address(n, dev.data_ptr())
            for n in self.outputs:
                shape = tuple(self.context.get_tensor_shape(n))
                if any(d < 0 for d in shape):
                    raise TrtBuildError(f"TensorRT could not infer the shape of output {n!r} ({shape})")
                keep[n] = torch.empty(shape, dtype=self.dtypes[n], device="cuda")
                self.context.set_tensor_address(n, keep[n].data_ptr())
            if not self.context.execute_async_v3(self.stream.cuda_stream):
                raise TrtBuildError(f"TensorRT execution failed: {'; '.join(self._logger.errors) or 'no details'}")
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
    role = card.data.gate
    what = f"card.data.{role} = {getattr(card.data, role) or 'the export example inputs'}"
    left = f"; {len(cases) - len(fits)} smaller than the profile minimum left out" if len(fits) < len(cases) else ""
    return fits, f"{what}: {len(fits)} batches, {sum(len(c) for c in fits)} samples{left}"


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
    """Every parser error as 'node NAME (OP): description [code]' (node names and operators are reported
    by TensorRT 10+; the index is the fallback)."""
    rows = []
    for i in range(parser.num_errors):
        e = parser.get_error(i)
        node = getattr(e, "node_name", lambda: "")() or (f"#{e.node()}" if e.node() >= 0 else "")
        op = getattr(e, "node_operator", lambda: "")()
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


def build_engine(name: str, precision: str = "fp32", onnx_dir: Path = Path("build/onnx"),
                 out_dir: Path = Path("build/trt"), batch: Range | None = None,
                 image_sizes: tuple[tuple[int, int], tuple[int, int], tuple[int, int]] | None = None,
                 workspace_gib: float = 4.0, opt_level: int = 3,
                 timing_cache: Path | None = Path("build/trt/timing.cache"), verify: bool = True,
                 tf32: bool = False, gates: Mapping[str, float] | None = None,
                 progress: Progress | None = None) -> dict:
    """Build ``out_dir/NAME.PRECISION.plan`` (+ ``.json``) strongly typed from the precision's ONNX.

    The profile, gate data and tolerances come from the card in that ONNX: ``batch`` (min, opt, max) and
    ``image_sizes`` override ``card.trt_profile``; ``gates`` (``{metric: tolerance}``) override
    ``card.gate(precision)``. ``tf32`` is off by default so FP32 layers compute in IEEE FP32 and the
    parity gate compares like with like; precision is otherwise entirely the graph's. Raises
    :class:`MissingOnnxError`, :class:`TrtUnavailableError`, :class:`TrtBuildError` or :class:`GateError`
    (JSON written, no plan).
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
    graph = onnx.load(str(src), load_external_data=False)
    profile = profile_shapes(graph, card, batch, image_sizes)
    batch = tuple(batch or card.trt_profile.batch)
    input_names = list(profile)
    del graph

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
    if not tf32 and hasattr(trt.BuilderFlag, "TF32"):
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
        "build_seconds": round(build_s, 2),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "card": card.model_dump(mode="json"),
    }
    runner = EngineRunner(blob)
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
