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

One optimization profile covers every input: the batch axis from ``batch`` (per-sample ``[B]`` inputs
such as ``lam``/``sigma`` follow it), the denoiser's H×W from ``image_sizes``, fixed dims as in the ONNX.
After the build the engine is run on the accuracy-gate data and compared with ONNX Runtime running the
FP32 graph; the plan is renamed into place only when the gate passes, and the JSON beside it always says
what was measured.

TensorRT 10.x (NGC Triton containers) and 11.x (pip) share this code. The one place the Python API
differs for what is used here is network creation (see :func:`_network_flags`): in 10.x a network is
strongly typed only when created with ``NetworkDefinitionCreationFlag.STRONGLY_TYPED``; in 11.x strong
typing is always on and that flag is deprecated and ignored (``EXPLICIT_BATCH`` is gone: explicit batch
has been the only mode since 10.0).

Gate data (:func:`gate_cases`): the quantization step's ``unroll.export.quantize.gate_inputs(name)`` when its
cases carry the targets the metrics need (a :class:`GateCase`, a mapping with ``feeds`` and ``clean`` /
``labels`` / ``sigma255``, or ``(label, feeds, clean)``). When they are bare feed dicts, the same held-out
data is rebuilt here with its targets: the 1,000 MNIST test digits (λ from the export report) for
``sdnet-mnist``, the held-out images with ``data.noise_seed`` noise at σ 15/25/50 for ``csc-denoiser``
(cropped to the profile's largest H×W if need be); the export's real example inputs for the others.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import onnx

__all__ = [
    "DEFAULT_BATCH", "DEFAULT_IMAGE_SIZES", "GATES", "PRECISIONS", "EngineRunner", "GateCase", "GateError",
    "MissingOnnxError", "TrtBuildError", "TrtUnavailableError", "build_engine", "default_gate_cases", "gate_cases",
    "gate_failures", "gates_for", "graph_inputs", "has_dynamic_image", "onnx_path_for", "parity_check",
    "profile_shapes", "read_report", "run_engine", "split_cases", "tensorrt_available", "top1_agreement",
]

PRECISIONS = ("fp32", "fp16", "int8")
DEFAULT_BATCH = (1, 8, 32)
#: Denoiser H×W (min, opt, max) when none is given: CONVENTIONS.md allows any H, W ≥ 16.
DEFAULT_IMAGE_SIZES = ((16, 16), (256, 256), (1024, 1024))
MIN_IMAGE_SIDE = 16
MAX_OPT_LEVEL = 5  # TensorRT's builder optimization levels are 0…5 (3 is its default)
EVAL_SIGMAS = (15.0, 25.0, 50.0)

#: Parity gates against ONNX Runtime FP32, per precision: the quantization step's thresholds (taken from
#: ``unroll.export.quantize.DEFAULT_GATES`` when present, see :func:`gates_for`), and tighter ones for fp32.
GATES: dict[str, dict[str, float]] = {
    "fp32": {"min_top1_agreement": 0.999, "max_accuracy_loss_points": 0.1, "max_psnr_loss_db": 0.01},
    "fp16": {"min_top1_agreement": 0.999, "max_accuracy_loss_points": 0.1, "max_psnr_loss_db": 0.02},
    "int8": {"min_top1_agreement": 0.995, "max_accuracy_loss_points": 0.3, "max_psnr_loss_db": 0.15},
}

TRT_MISSING = "TensorRT is not installed (pip install 'unroll[gpu]' on a machine with an NVIDIA GPU)."
NO_GPU = "No CUDA GPU is visible (TensorRT engines are built on the GPU they will run on)."
NEITHER = ("TensorRT engines need an NVIDIA GPU and the tensorrt package, and this machine has neither "
           "(run `unroll build` where `pip install 'unroll[gpu]'` and a CUDA GPU are available).")

Shape = tuple[int, ...]
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


@dataclass
class GateCase:
    """One batch of gate data: engine inputs, and what the task metric needs beside the reference output."""

    label: str
    feeds: dict[str, np.ndarray]
    clean: np.ndarray | None = None  # denoiser: the clean image(s), same shape as the output
    labels: np.ndarray | None = None  # classifier: true classes, for the accuracy delta
    sigma255: float | None = None  # denoiser: noise level on the 0–255 scale


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


def profile_shapes(model: onnx.ModelProto, batch: tuple[int, int, int] = DEFAULT_BATCH,
                   image_sizes: tuple[tuple[int, int], tuple[int, int], tuple[int, int]] | None = None,
                   dim_ranges: Mapping[str, tuple[int, int, int]] | None = None) -> ProfileShapes:
    """min/opt/max shape of every graph input for one TensorRT optimization profile.

    Axis 0 is the batch and follows ``batch`` (so ``[B]`` inputs like ``lam``/``sigma`` do too); the
    dynamic H, W (axes 2, 3) of a 4-D image input follow ``image_sizes``; any other dynamic axis follows
    ``dim_ranges[its dim_param]`` (e.g. ``tokens``); fixed dims keep their ONNX value. A dynamic axis
    with no range is an error naming the input, rather than a silent guess.
    """
    _check_range("batch", *batch)
    if image_sizes is not None:
        (h0, w0), (h1, w1), (h2, w2) = image_sizes
        _check_range("image height", h0, h1, h2, MIN_IMAGE_SIDE)
        _check_range("image width", w0, w1, w2, MIN_IMAGE_SIDE)
    for k, r in (dim_ranges or {}).items():
        _check_range(f"dimension {k!r}", *r)
    out: ProfileShapes = {}
    for v in graph_inputs(model):
        dims = list(v.type.tensor_type.shape.dim)
        if not dims:
            raise ValueError(f"input {v.name!r} is a scalar or has no shape; TensorRT profiles need ranked inputs")
        lo, mid, hi = [], [], []
        for axis, d in enumerate(dims):
            if d.HasField("dim_value") and d.dim_value > 0:
                r = (d.dim_value,) * 3
            elif axis == 0:
                r = tuple(batch)
            elif len(dims) == 4 and axis in (2, 3) and image_sizes is not None:
                r = tuple(s[axis - 2] for s in image_sizes)
            elif d.dim_param and dim_ranges and d.dim_param in dim_ranges:
                r = tuple(dim_ranges[d.dim_param])
            else:
                label = d.dim_param or f"axis {axis}"
                hint = " (give image sizes)" if len(dims) == 4 and axis in (2, 3) else ""
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


def _coerce_case(i: int, item: Any) -> GateCase:
    if isinstance(item, GateCase):
        return item
    if isinstance(item, Mapping) and item and all(isinstance(v, np.ndarray) for v in item.values()):
        return GateCase(f"case {i}", dict(item))  # bare feeds: inputs only, no targets
    if isinstance(item, Mapping) and "feeds" in item:
        return GateCase(str(item.get("label", f"case {i}")), dict(item["feeds"]), item.get("clean"),
                        item.get("labels"), item.get("sigma255"))
    if hasattr(item, "feeds"):
        return GateCase(str(getattr(item, "label", f"case {i}")), dict(item.feeds), getattr(item, "clean", None),
                        getattr(item, "labels", None), getattr(item, "sigma255", None))
    if isinstance(item, tuple) and len(item) in (2, 3) and isinstance(item[1], Mapping):
        return GateCase(str(item[0]), dict(item[1]), item[2] if len(item) == 3 else None)
    raise TrtBuildError(f"quantize.gate_inputs returned a case of unexpected form ({type(item).__name__})")


def _quantize_gate_inputs(name: str) -> list[GateCase] | None:
    """The quantization gate's own cases, when ``unroll.export.quantize.gate_inputs`` exists and knows ``name``."""
    try:
        from unroll.export import quantize
    except ImportError:
        return None
    fn = getattr(quantize, "gate_inputs", None)
    if fn is None:
        return None
    try:
        items = list(fn(name))
    except (ValueError, KeyError):  # a model the quantization step does not cover
        return None
    return [_coerce_case(i, c) for i, c in enumerate(items)]


def _has_targets(task: str, cases: list[GateCase]) -> bool:
    """Whether the cases carry what the task metric needs (clean images for PSNR, classes for accuracy)."""
    if task == "denoising":
        return all(c.clean is not None for c in cases)
    if task == "classification":
        return all(c.labels is not None for c in cases)
    return True


def gate_cases(name: str, task: str, input_names: list[str], profile: ProfileShapes,
               onnx_dir: Path = Path("build/onnx")) -> tuple[list[GateCase], str]:
    """The gate data and where it came from.

    The quantization step's ``gate_inputs`` is used when its cases carry targets. When they are bare
    feeds (inputs only), the same held-out data is rebuilt here with its targets: the MNIST test split in
    order, the held-out images with ``data.noise_seed`` noise at σ 15/25/50 — identical inputs, plus the
    clean images and classes that the PSNR and accuracy deltas need.
    """
    cases = _quantize_gate_inputs(name)
    if cases is not None and _has_targets(task, cases):
        return cases, "unroll.export.quantize.gate_inputs"
    note = "built here" + (" (same held-out data as unroll.export.quantize.gate_inputs, with targets)"
                           if cases is not None else " (held-out data)")
    return default_gate_cases(name, input_names, profile, onnx_dir), note


def _default_lam(name: str, onnx_dir: Path) -> float:
    """The model's own first-layer λ, from the export report (what serving uses when none is asked)."""
    report = Path(onnx_dir) / f"{name}.report.json"
    try:
        solvers = json.loads(report.read_text()).get("solvers") or []
        return float(next(s["lambda"] for s in solvers if "lambda" in s))
    except (OSError, ValueError, StopIteration, KeyError):
        return 0.1


@functools.cache
def _mnist_test() -> tuple[np.ndarray, np.ndarray]:
    """The 1,000 held-out MNIST digits and classes (loading the CSV takes seconds: once per process)."""
    from unroll import data

    _, _, x, y = data.mnist_split()
    return x, y


def _center_crop(img: np.ndarray, hmax: int, wmax: int) -> np.ndarray:
    h, w = img.shape
    top, left = max(0, (h - hmax) // 2), max(0, (w - wmax) // 2)
    return img[top:top + min(h, hmax), left:left + min(w, wmax)]


def default_gate_cases(name: str, input_names: list[str], profile: ProfileShapes,
                       onnx_dir: Path = Path("build/onnx")) -> list[GateCase]:
    """Real held-out gate data built here when the quantization step provides none."""
    from unroll import data
    from unroll.registry import get_spec

    spec = get_spec(name)
    bmax = max(hi[0] for _, _, hi in profile.values())
    cases: list[GateCase] = []
    if spec.task == "classification":
        if name == "sdnet-mnist":
            x, y = _mnist_test()
            label = "MNIST test split"
        else:
            from unroll.export.inputs import image_batch

            x, y, label = image_batch(spec, 16).numpy(), None, "bundled photos"
        lam = _default_lam(name, onnx_dir)
        for s in range(0, len(x), bmax):
            feeds = {"image": x[s:s + bmax].astype(np.float32)}
            if "lam" in input_names:
                feeds["lam"] = np.full(len(feeds["image"]), lam, np.float32)
            cases.append(GateCase(f"{label} [{s}:{s + len(feeds['image'])}]", feeds,
                                  labels=None if y is None else y[s:s + bmax]))
    elif spec.task == "denoising":
        (_, _, hmin, wmin), _, (_, _, hmax, wmax) = profile["noisy"]
        for img_name, img in data.denoise_test_set().items():
            img = _center_crop(img, hmax, wmax)
            if img.shape[0] < hmin or img.shape[1] < wmin:
                continue
            for s in EVAL_SIGMAS:
                noisy = data.add_noise(img, s, data.noise_seed(img_name, s))
                cases.append(GateCase(f"{img_name} {img.shape[0]}×{img.shape[1]} σ={s:g}",
                                      {"noisy": noisy[None, None], "sigma": np.array([s / 255.0], np.float32)},
                                      clean=img[None, None], sigma255=s))
    else:
        from unroll.export.inputs import cases as export_cases

        for c in export_cases(spec, lam_input="lam" in input_names):
            cases.append(GateCase(c.label, {k: v.numpy() for k, v in c.inputs.items() if k in input_names}))
    if not cases:
        raise TrtBuildError(f"no gate data fits the optimization profile of {name}")
    return cases


# --------------------------------------------------------------------------------------------- metrics


def top1_agreement(ref_logits: np.ndarray, got_logits: np.ndarray) -> float:
    """Fraction of samples whose arg-max class is the same in both."""
    return float(np.mean(np.argmax(ref_logits, axis=1) == np.argmax(got_logits, axis=1)))


def gates_for(precision: str, overrides: Mapping[str, float] | None = None) -> dict[str, float]:
    """The gate for ``precision``: the quantization step's own thresholds for fp16/int8 when it defines
    them (so both steps always agree), else :data:`GATES`; then explicit ``overrides``."""
    g = dict(GATES[precision])
    try:
        from unroll.export.quantize import DEFAULT_GATES  # {"agreement", "accuracy_loss" (fraction), "psnr_loss_db"}

        q = DEFAULT_GATES.get(precision, {})
        for theirs, ours, scale in (("agreement", "min_top1_agreement", 1.0),
                                    ("accuracy_loss", "max_accuracy_loss_points", 100.0),
                                    ("psnr_loss_db", "max_psnr_loss_db", 1.0)):
            if theirs in q:
                g[ours] = float(q[theirs]) * scale
    except (ImportError, AttributeError, TypeError):
        pass
    return {**g, **(overrides or {})}


def gate_failures(task: str, precision: str, parity: dict, gates: Mapping[str, float] | None = None) -> list[str]:
    """Which gate metrics failed and by how much (empty when the engine passes)."""
    g = gates_for(precision, gates)
    bad = []
    if task == "classification":
        a = parity["top1_agreement"]
        if a < g["min_top1_agreement"]:
            bad.append(f"top-1 agreement {a:.2%} is below {g['min_top1_agreement']:.2%} "
                       f"(short by {g['min_top1_agreement'] - a:.2%})")
        loss = parity.get("accuracy_loss_points")
        if loss is not None and "max_accuracy_loss_points" in g and loss > g["max_accuracy_loss_points"]:
            bad.append(f"accuracy loss {loss:.2f} points exceeds {g['max_accuracy_loss_points']:.2f} "
                       f"(by {loss - g['max_accuracy_loss_points']:.2f})")
    elif task == "denoising":
        for s, row in parity["psnr"].items():
            if row["loss_db"] > g["max_psnr_loss_db"]:
                bad.append(f"PSNR loss at σ={s} is {row['loss_db']:.3f} dB, over {g['max_psnr_loss_db']} dB "
                           f"(by {row['loss_db'] - g['max_psnr_loss_db']:.3f} dB)")
    if not parity.get("finite", True):
        bad.append("the engine produced NaN or Inf")
    return bad


def split_cases(cases: list[GateCase], bmax: int) -> list[GateCase]:
    """Cases larger than the profile's maximum batch, cut into pieces the engine accepts."""
    out = []
    for c in cases:
        n = len(next(iter(c.feeds.values())))
        if n <= bmax:
            out.append(c)
            continue
        for s in range(0, n, bmax):
            cut = slice(s, s + bmax)
            out.append(GateCase(f"{c.label} [{s}:{min(n, s + bmax)}]", {k: v[cut] for k, v in c.feeds.items()},
                                None if c.clean is None else c.clean[cut],
                                None if c.labels is None else c.labels[cut], c.sigma255))
    return out


def _pad_batch(feeds: dict[str, np.ndarray], bmin: int) -> tuple[dict[str, np.ndarray], int]:
    """Repeat samples up to the profile's minimum batch (the extra rows are dropped afterwards)."""
    n = len(next(iter(feeds.values())))
    if n >= bmin:
        return feeds, n
    reps = -(-bmin // n)
    return {k: np.concatenate([v] * reps)[:bmin] for k, v in feeds.items()}, n


def parity_check(runner: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]], reference_onnx: Path,
                 task: str, cases: list[GateCase], bmin: int = 1, progress: Progress | None = None) -> dict:
    """Engine vs ONNX Runtime (CPU, FP32 graph) on the gate cases: the task metric and max |Δ|."""
    import onnxruntime as ort

    from unroll.train.denoiser import psnr  # the metric the denoiser is evaluated with everywhere

    sess = ort.InferenceSession(str(reference_onnx), providers=["CPUExecutionProvider"])
    out_name = sess.get_outputs()[0].name
    refs, gots, labels, max_abs, finite = [], [], [], 0.0, True
    psnr_rows: dict[str, dict[str, list[float]]] = {}
    for i, c in enumerate(cases):
        if progress:
            progress(f"parity {i + 1}/{len(cases)}: {c.label}")
        feeds = {k: np.asarray(v) for k, v in c.feeds.items()}
        ref = sess.run([out_name], feeds)[0]
        padded, n = _pad_batch(feeds, bmin)
        got = runner(padded)[out_name][:n].astype(np.float32)
        if got.shape != ref.shape:
            raise TrtBuildError(f"{c.label}: engine output shape {got.shape} != ONNX Runtime {ref.shape}")
        finite &= bool(np.isfinite(got).all())
        max_abs = max(max_abs, float(np.max(np.abs(got.astype(np.float64) - ref))))
        if task == "classification":
            refs.append(ref)
            gots.append(got)
            if c.labels is not None:
                labels.append(np.asarray(c.labels))
        elif task == "denoising" and c.clean is not None:
            key = f"{c.sigma255:g}" if c.sigma255 is not None else "all"
            row = psnr_rows.setdefault(key, {"ref": [], "got": []})
            for k in range(len(ref)):
                row["ref"].append(psnr(c.clean[k], ref[k]))
                row["got"].append(psnr(c.clean[k], got[k]))
    result: dict[str, Any] = {"reference": f"onnxruntime {ort.__version__} CPU, {reference_onnx.name}",
                              "cases": len(cases), "max_abs_diff": max_abs, "finite": finite}
    if task == "classification":
        r, g = np.concatenate(refs), np.concatenate(gots)
        result.update(samples=len(r), top1_agreement=top1_agreement(r, g))
        if labels and len(np.concatenate(labels)) == len(r):
            y = np.concatenate(labels)
            acc_ref, acc_got = float(np.mean(r.argmax(1) == y)), float(np.mean(g.argmax(1) == y))
            result.update(accuracy_reference=acc_ref, accuracy_engine=acc_got,
                          accuracy_loss_points=100.0 * (acc_ref - acc_got))
    elif task == "denoising":
        result["psnr"] = {s: {"images": len(v["ref"]), "reference_db": float(np.mean(v["ref"])),
                              "engine_db": float(np.mean(v["got"])),
                              "loss_db": float(np.mean(v["ref"]) - np.mean(v["got"]))}
                          for s, v in psnr_rows.items()}
    return result


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


def build_engine(name: str, precision: str = "fp32", onnx_dir: Path = Path("build/onnx"),
                 out_dir: Path = Path("build/trt"), batch: tuple[int, int, int] = DEFAULT_BATCH,
                 image_sizes: tuple[tuple[int, int], tuple[int, int], tuple[int, int]] | None = None,
                 workspace_gib: float = 4.0, opt_level: int = 3,
                 timing_cache: Path | None = Path("build/trt/timing.cache"), verify: bool = True,
                 dim_ranges: Mapping[str, tuple[int, int, int]] | None = None, tf32: bool = False,
                 gates: Mapping[str, float] | None = None, progress: Progress | None = None) -> dict:
    """Build ``out_dir/NAME.PRECISION.plan`` (+ ``.json``) strongly typed from the precision's ONNX.

    ``tf32`` is off by default so FP32 layers compute in IEEE FP32 and the parity gate compares like with
    like; precision is otherwise entirely the graph's. Raises :class:`MissingOnnxError`,
    :class:`TrtUnavailableError`, :class:`TrtBuildError` or :class:`GateError` (JSON written, no plan).
    """
    _check_precision(precision)
    if not 0 <= opt_level <= MAX_OPT_LEVEL:
        raise ValueError(f"builder optimization level must be 0…{MAX_OPT_LEVEL}, not {opt_level}")
    if workspace_gib <= 0:
        raise ValueError(f"workspace must be positive, not {workspace_gib} GiB")
    say = progress or (lambda _msg: None)
    onnx_dir, out_dir = Path(onnx_dir), Path(out_dir)
    src = onnx_path_for(name, precision, onnx_dir)
    ref = onnx_path_for(name, "fp32", onnx_dir)
    for path, p in ((src, precision), (ref, "fp32")):
        if not path.exists() and (path == src or verify):
            cmd = f"unroll export {name}" if p == "fp32" else f"unroll quantize {name} --precision {p}"
            raise MissingOnnxError(f"{path} does not exist: run `{cmd}` first.")
    graph = onnx.load(str(src), load_external_data=False)
    if image_sizes is None and has_dynamic_image(graph):
        image_sizes = DEFAULT_IMAGE_SIZES
    profile = profile_shapes(graph, batch, image_sizes, dim_ranges)
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

    from unroll.registry import get_spec

    task = get_spec(name).task
    dev = torch.cuda.current_device()
    cc = torch.cuda.get_device_capability(dev)
    report: dict[str, Any] = {
        "model": name, "task": task, "precision": precision,
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
    }
    runner = EngineRunner(blob)
    report["io"] = runner.io_info()
    failures: list[str] = []
    if verify:
        say("checking the engine against ONNX Runtime FP32")
        cases, report["gate_data"] = gate_cases(name, task, input_names, profile, onnx_dir)
        report["parity"] = parity_check(runner, ref, task, split_cases(cases, batch[2]), batch[0], say)
        report["gate"] = gates_for(precision, gates)
        failures = gate_failures(task, precision, report["parity"], gates)
    else:
        report["parity"] = None
        report["gate"] = "skipped (verify=False)"
    _finish(tmp_plan, plan_path, json_path, report, failures)
    return report


def read_report(name: str, precision: str, out_dir: Path = Path("build/trt")) -> dict | None:
    """The JSON written beside a plan, or None."""
    path = Path(out_dir) / f"{name}.{precision}.json"
    return json.loads(path.read_text()) if path.exists() else None
