"""``unroll repo``: write (and validate) a Triton model repository for the exported ONNX models.

Two targets share one layout (``<model>/config.pbtxt``, ``<model>/1/…``, ``labels.txt`` for
classifiers) and differ only in how a model runs:

* ``cpu`` — what runs here: the Triton in the nvidia-pytriton wheel has only the Python backend, so
  every model is a Python-backend model (``serving/triton_backend_model.py`` copied as
  ``1/model.py``) that runs ``1/model.onnx`` with ONNX Runtime, one session per instance.
* ``gpu`` — for the NGC ``tritonserver`` container: ``tensorrt_plan`` when ``unroll build`` left a
  plan ``build/trt/<name>.<precision>.plan``, else ``onnxruntime_onnx`` with the TensorRT execution
  accelerator (precision, engine cache, one optimization profile per model).

Configs are built as ``model_config_pb2.ModelConfig`` protobufs and printed with ``text_format``,
so they are schema-valid by construction; :func:`validate_repository` re-parses every written
config and checks each input and output (name, type, dims, reshape) against the ONNX graph.

Everything model-specific comes from the model card the export wrote into the ONNX (labels, the λ
input and its default, the TensorRT profile, the task); each config carries that card as the parameter
``unroll.card`` so Triton's clients (the gateway) read the same card. Warm-up shapes come from the export
report's verified parity cases.

Batching defaults are starting points, not measurements: on a CPU, batching saves no arithmetic, only
the per-execution overhead of the Python backend, so the queue delay is kept short (waiting longer only
adds latency to a lone request), and the denoiser gets a small ``max_batch_size`` because its cost grows
with the image area, so a large batch of large images would make every request wait for all the others.
On the GPU target ``max_batch_size`` is the card's TensorRT profile maximum (the engine covers no more).
``unroll bench serve`` measures dynamic batching on and off through the real server
(``benchmarks/results/``); re-measure on your hardware and pass ``--queue-delay-us`` /
``--max-batch-size``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import onnx
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from unroll.card import CARD_KEY, CardError, ModelCard, from_onnx

Target = Literal["cpu", "gpu"]
PRECISIONS = ("fp32", "fp16", "int8")
DEFAULT_MAX_BATCH_SIZE = 32
#: CPU exceptions to DEFAULT_MAX_BATCH_SIZE by task (see the module docstring).
CPU_MAX_BATCH_SIZE = {"denoising": 4}
DEFAULT_QUEUE_DELAY_US = 500
VERSION = "1"
LABELS_FILE = "labels.txt"
BACKEND_MODEL = Path(__file__).with_name("triton_backend_model.py")
#: Where the NGC container keeps ONNX Runtime's TensorRT engines (must be writable inside it).
GPU_ENGINE_CACHE = "/tmp/unroll-trt-cache"

_ONNX_TO_TRITON = {
    onnx.TensorProto.FLOAT: "TYPE_FP32", onnx.TensorProto.FLOAT16: "TYPE_FP16", onnx.TensorProto.BFLOAT16: "TYPE_BF16",
    onnx.TensorProto.DOUBLE: "TYPE_FP64", onnx.TensorProto.INT8: "TYPE_INT8", onnx.TensorProto.UINT8: "TYPE_UINT8",
    onnx.TensorProto.INT16: "TYPE_INT16", onnx.TensorProto.INT32: "TYPE_INT32", onnx.TensorProto.INT64: "TYPE_INT64",
    onnx.TensorProto.BOOL: "TYPE_BOOL", onnx.TensorProto.STRING: "TYPE_STRING",
}


class RepositoryError(ValueError):
    """A model cannot be put in the repository, or a written config does not match its ONNX graph."""


@dataclass(frozen=True)
class Tensor:
    """One graph input/output: Triton type and full dims (batch included, -1 where dynamic)."""

    name: str
    data_type: str
    dims: tuple[int, ...]


@dataclass(frozen=True)
class Source:
    """What one served model is built from."""

    name: str  #: model name in the repository
    onnx: Path  #: the graph (also the reference for validation when a plan is served)
    report: dict  #: the export report (task, parity shapes, solver settings)
    card: ModelCard  #: the model card carried in the ONNX
    plan: Path | None = None


def onnx_io(path: Path) -> tuple[list[Tensor], list[Tensor]]:
    """Inputs and outputs of an ONNX graph (initializers listed as inputs by old exporters excluded)."""
    model = onnx.load(str(path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}

    def conv(v: onnx.ValueInfoProto) -> Tensor:
        tt = v.type.tensor_type
        if tt.elem_type not in _ONNX_TO_TRITON:
            raise RepositoryError(f"{path.name}: tensor {v.name!r} has ONNX type "
                                  f"{onnx.TensorProto.DataType.Name(tt.elem_type)}, which Triton cannot serve")
        dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim)
        return Tensor(v.name, _ONNX_TO_TRITON[tt.elem_type], dims)

    return [conv(v) for v in model.graph.input if v.name not in inits], [conv(v) for v in model.graph.output]


def _source(name: str, target: Target, precision: str, onnx_dir: Path, plan_dir: Path) -> Source:
    fp32 = onnx_dir / f"{name}.onnx"
    plan = plan_dir / f"{name}.{precision}.plan" if target == "gpu" else None
    if target == "gpu" and plan is not None and plan.exists():
        graph = fp32  # the plan was built from it: same tensors
    elif precision == "fp32" or (target == "gpu" and precision == "fp16"):
        graph, plan = fp32, None  # GPU fp16 without a plan: TensorRT casts the fp32 graph (precision_mode FP16)
    else:
        graph, plan = onnx_dir / f"{name}.{precision}.onnx", None
        if not graph.exists():
            raise RepositoryError(f"{name}: no {precision} model at {graph}; run `unroll quantize {name}` first")
    if not graph.exists():
        raise RepositoryError(f"{name}: no ONNX export at {graph}; run `unroll export {name}` first")
    report_path = onnx_dir / f"{name}.report.json"
    if not report_path.exists():
        raise RepositoryError(f"{name}: {report_path} is missing; re-run `unroll export {name}`")
    try:
        card = from_onnx(fp32)
    except CardError as e:
        raise RepositoryError(str(e)) from None
    if card.name != name:  # the Triton model name, the gateway's model= and the card must agree
        raise RepositoryError(f"{fp32} carries the card of {card.name!r}: a graph's file stem must be its card's name")
    return Source(name, graph, json.loads(report_path.read_text()), card, plan)


def class_labels(card: ModelCard, num_classes: int) -> list[str]:
    """Label strings for Triton's classification extension (``score:index:label``): the card's, else indices."""
    if card.labels is not None:
        if len(card.labels) != num_classes:
            raise RepositoryError(f"{card.name}: the card has {len(card.labels)} labels for {num_classes} logits")
        return list(card.labels)
    return [str(i) for i in range(num_classes)]


def _split_batch(t: Tensor, batching: bool) -> list[int]:
    return list(t.dims[1:]) if batching else list(t.dims)


def _io_config(cls: type, t: Tensor, batching: bool):
    """A ModelInput/ModelOutput for ``t``; a batch-only tensor ([B]) becomes dims [1] + reshape []."""
    dims = _split_batch(t, batching)
    io = cls(name=t.name, data_type=mc.DataType.Value(t.data_type))
    if not dims:  # Triton needs at least one dim: the documented idiom for per-sample scalars
        io.dims.append(1)
        io.reshape.SetInParent()
    else:
        io.dims.extend(dims)
    return io


def _example_shapes(src: Source) -> dict[str, list[int]]:
    """A valid input shape per tensor (batch included): the export's first verified parity case."""
    cases = src.report.get("parity", {}).get("cases", [])
    if not cases:
        raise RepositoryError(f"{src.name}: the export report has no parity cases to take a warm-up shape from")
    return cases[0]["shapes"]


def _warmup(src: Source, cfg: mc.ModelConfig, batch_sizes: Iterable[int]) -> None:
    example = _example_shapes(src)
    for b in batch_sizes:
        w = cfg.model_warmup.add(name=f"{src.name}-batch{b}", batch_size=b)
        for inp in cfg.input:
            dims = list(inp.dims)
            if any(d < 0 for d in dims):
                shape = example.get(inp.name)
                if shape is None:
                    raise RepositoryError(f"{src.name}: no example shape for dynamic input {inp.name!r}")
                full = shape[1:] if cfg.max_batch_size > 0 else shape
                dims = [e if d < 0 else d for d, e in zip(dims, full, strict=True)]
            wi = mc.ModelWarmup.Input(data_type=inp.data_type, dims=dims)
            # zeros for per-sample scalars (lam, sigma: in range for the model), noise for images / features
            if list(inp.dims) == [1]:
                wi.zero_data = True
            else:
                wi.random_data = True
            w.inputs[inp.name].CopyFrom(wi)


def _gpu_profile(src: Source, cfg: mc.ModelConfig) -> dict[str, str]:
    """One TensorRT optimization profile from the card: batch up to ``max_batch_size``, dynamic axes per card.

    The card's ``trt_profile.batch`` gives min/opt (capped at the config's ``max_batch_size``, which is
    the profile's max); ``trt_profile.dims`` the range of each dynamic axis of the card's main input.
    """
    prof = src.card.trt_profile
    b = cfg.max_batch_size
    mins, opts, maxs = [], [], []
    for inp in cfg.input:
        graph_dims = list(inp.reshape.shape) if inp.HasField("reshape") else list(inp.dims)
        lo, op, hi = ([min(prof.batch[0], b)], [min(prof.batch[1], b)], [b]) if b else ([], [], [])
        for axis, d in enumerate(graph_dims):
            if d >= 0:
                triple = (d, d, d)
            elif inp.name == src.card.input.name and str(axis) in prof.dims:
                triple = prof.dims[str(axis)]
            else:
                raise RepositoryError(f"{src.name}: input {inp.name!r} axis {axis} is dynamic; the card needs "
                                      f"trt_profile.dims['{axis}'] (min, opt, max) for the TensorRT profile")
            for lst, v in zip((lo, op, hi), triple, strict=True):
                lst.append(v)
        mins.append(f"{inp.name}:{'x'.join(map(str, lo))}")
        opts.append(f"{inp.name}:{'x'.join(map(str, op))}")
        maxs.append(f"{inp.name}:{'x'.join(map(str, hi))}")
    return {"trt_profile_min_shapes": ",".join(mins), "trt_profile_opt_shapes": ",".join(opts),
            "trt_profile_max_shapes": ",".join(maxs)}


def default_max_batch_size(target: Target, card: ModelCard) -> int:
    """GPU: the card's TensorRT profile maximum; CPU: :data:`DEFAULT_MAX_BATCH_SIZE` or the task's exception."""
    if target == "gpu":
        return card.trt_profile.batch[2]
    return CPU_MAX_BATCH_SIZE.get(card.task, DEFAULT_MAX_BATCH_SIZE)


def build_config(src: Source, target: Target, precision: str = "fp32", threads: int = 2,
                 max_batch_size: int | None = None, queue_delay_us: int = DEFAULT_QUEUE_DELAY_US,
                 instances: int = 1) -> tuple[mc.ModelConfig, list[str] | None]:
    """The ModelConfig for one model, and its labels (classifiers) or None."""
    if max_batch_size is None:
        max_batch_size = default_max_batch_size(target, src.card)
    inputs, outputs = onnx_io(src.onnx)
    batching = all(t.dims and t.dims[0] == -1 for t in inputs + outputs)
    cfg = mc.ModelConfig(name=src.name, max_batch_size=max_batch_size if batching else 0)
    if target == "cpu":
        cfg.backend = "python"
    else:
        cfg.platform = "tensorrt_plan" if src.plan is not None else "onnxruntime_onnx"
    defaults: dict[str, float] = {}
    for t in inputs:
        io = cfg.input.add()
        io.CopyFrom(_io_config(mc.ModelInput, t, batching))
        if src.card.lam is not None and t.name == src.card.lam.input and target == "cpu":
            # optional with the model's own λ: the Python model fills it in. The GPU backends cannot
            # default a missing input, so there it stays required and the gateway always sends it.
            io.optional = True
            defaults[t.name] = src.card.lam.default
    labels = None
    for t in outputs:
        io = cfg.output.add()
        io.CopyFrom(_io_config(mc.ModelOutput, t, batching))
        if src.card.task == "classification" and t.name == src.card.output:
            labels = class_labels(src.card, t.dims[-1])
            io.label_filename = LABELS_FILE
    if batching:
        cfg.dynamic_batching.max_queue_delay_microseconds = queue_delay_us
    kind = mc.ModelInstanceGroup.KIND_CPU if target == "cpu" else mc.ModelInstanceGroup.KIND_GPU
    cfg.instance_group.add(kind=kind, count=instances)
    params = {"unroll_source_onnx": src.onnx.name, CARD_KEY: src.card.to_json()}
    if target == "cpu":
        params |= {"onnx_file": "model.onnx", "intra_op_num_threads": str(threads), "intra_op_spinning": "0",
                   "input_defaults": json.dumps(defaults)}
    elif src.plan is None:
        acc = cfg.optimization.execution_accelerators.gpu_execution_accelerator.add(name="tensorrt")
        acc.parameters.update({
            "precision_mode": precision.upper(),
            "max_workspace_size_bytes": str(1 << 30),
            "trt_engine_cache_enable": "1",
            "trt_engine_cache_path": f"{GPU_ENGINE_CACHE}/{src.name}",
            "trt_timing_cache_enable": "1",
            "trt_timing_cache_path": f"{GPU_ENGINE_CACHE}/{src.name}",
            **_gpu_profile(src, cfg),
        })
    for k, v in params.items():
        cfg.parameters[k].string_value = v
    _warmup(src, cfg, sorted({1, max_batch_size}) if batching else [1])
    return cfg, labels


def _header(src: Source, target: Target, precision: str, cfg: mc.ModelConfig) -> str:
    lines = [f"Generated by `unroll repo --target {target} --precision {precision}` from {src.onnx.name}"
             + (f" and {src.plan.name}" if src.plan else "") + "; regenerate instead of editing.",
             "dims exclude the batch dimension (-1 = dynamic); a [B] graph tensor is dims [1] + reshape [] "
             "(clients send it as [B, 1]).",
             "max_queue_delay_microseconds and max_batch_size: defaults explained in serving/repository.py "
             "(re-measure with `unroll bench serve`).",
             "model_warmup runs before the model reports ready."]
    if src.card.lam is not None:
        lines.append("lam is optional (default = the trained λ) on the CPU target only: the GPU backends cannot "
                     "default a missing input, so the gateway always sends lam." if target == "cpu" else
                     "lam is required here (TensorRT/ONNX Runtime backends cannot default a missing input); "
                     "the gateway always sends it.")
    if target == "gpu" and src.plan is None:
        lines.append("TensorRT profile (min/opt/max shapes) is in the accelerator parameters; the engine built "
                     "at warm-up covers only that range, so widen it and regenerate for larger inputs.")
    if target == "gpu" and src.plan is not None:
        lines.append("max_batch_size and input sizes must lie inside the plan's optimization profile "
                     f"(see {src.plan.with_suffix('.json').name}).")
    return "".join(f"# {ln}\n" for ln in lines)


def write_repository(target: Target, models: list[str], out: Path, precision: str = "fp32",
                     onnx_dir: Path = Path("build/onnx"), plan_dir: Path = Path("build/trt"), threads: int = 2,
                     max_batch_size: int | None = None, queue_delay_us: int = DEFAULT_QUEUE_DELAY_US,
                     instances: int = 1) -> list[Path]:
    """Write ``out/<model>/config.pbtxt`` + ``out/<model>/1/…`` (+ ``labels.txt``) for each model; validate.

    ``models`` are ONNX file stems in ``onnx_dir`` (a model's name; its λ-rule companion is a model of its
    own, named on its card). ``max_batch_size=None`` takes :func:`default_max_batch_size` per model; an int applies
    to every model. Each model directory is rebuilt from scratch (so switching targets leaves no stale
    ``model.py`` or plan), other directories in ``out`` are left alone. Returns the files written.
    """
    if target not in ("cpu", "gpu"):
        raise RepositoryError(f"target must be cpu or gpu, not {target!r}")
    if precision not in PRECISIONS:
        raise RepositoryError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if (max_batch_size is not None and max_batch_size < 1) or queue_delay_us < 0 or threads < 1 or instances < 1:
        raise RepositoryError("max_batch_size, threads and instances must be ≥ 1 and queue_delay_us ≥ 0")
    if not models:
        raise RepositoryError("no models given")
    sources = [_source(m, target, precision, Path(onnx_dir), Path(plan_dir)) for m in dict.fromkeys(models)]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for src in sources:
        cfg, labels = build_config(src, target, precision, threads, max_batch_size, queue_delay_us, instances)
        tmp = out / f".{src.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / VERSION).mkdir(parents=True)
        files = {"config.pbtxt": None}
        (tmp / "config.pbtxt").write_text(_header(src, target, precision, cfg) + text_format.MessageToString(cfg))
        if labels is not None:
            (tmp / LABELS_FILE).write_text("\n".join(labels) + "\n")
            files[LABELS_FILE] = None
        if src.plan is not None:
            shutil.copyfile(src.plan, tmp / VERSION / "model.plan")
            files[f"{VERSION}/model.plan"] = None
        else:
            shutil.copyfile(src.onnx, tmp / VERSION / "model.onnx")
            files[f"{VERSION}/model.onnx"] = None
        if target == "cpu":
            shutil.copyfile(BACKEND_MODEL, tmp / VERSION / "model.py")
            files[f"{VERSION}/model.py"] = None
        validate_model(tmp, reference_onnx=src.onnx, name=src.name)
        dst = out / src.name
        if dst.exists():
            shutil.rmtree(dst)
        tmp.rename(dst)
        written += [dst / f for f in files]
    return written


def _fmt(dims: Iterable[int]) -> str:
    return "[" + ", ".join(map(str, dims)) + "]"


def validate_model(model_dir: Path, reference_onnx: Path | None = None, name: str | None = None) -> mc.ModelConfig:
    """Parse ``model_dir/config.pbtxt`` against Triton's schema and check it against the ONNX graph.

    The reference graph is ``reference_onnx``, else ``<version>/model.onnx`` in the model directory
    (a plan-only model needs ``reference_onnx``). Every problem is collected; one
    :class:`RepositoryError` names each mismatching tensor.
    """
    model_dir = Path(model_dir)
    name = name or model_dir.name
    path = model_dir / "config.pbtxt"
    if not path.exists():
        raise RepositoryError(f"{name}: no config.pbtxt in {model_dir}")
    cfg = mc.ModelConfig()
    try:
        text_format.Parse(path.read_text(), cfg)
    except text_format.ParseError as e:
        raise RepositoryError(f"{name}: config.pbtxt is not a valid Triton model config: {e}") from e
    errors: list[str] = []
    if cfg.name and cfg.name != name:
        errors.append(f"config name {cfg.name!r} differs from the directory name {name!r}")
    if not cfg.backend and not cfg.platform:
        errors.append("neither backend nor platform is set")
    versions = sorted((p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    if not versions:
        errors.append("no numeric version directory")
    artifact = None
    if versions:
        onnx_file = cfg.parameters["onnx_file"].string_value if "onnx_file" in cfg.parameters else "model.onnx"
        artifact = versions[-1] / ("model.plan" if cfg.platform == "tensorrt_plan" else
                                   onnx_file if cfg.backend == "python" else cfg.default_model_filename or "model.onnx")
        needed = [artifact] + ([versions[-1] / "model.py"] if cfg.backend == "python" else [])
        errors += [f"{p.relative_to(model_dir)} is missing (model files are not committed: run `unroll repo`)"
                   for p in needed if not p.exists()]
    if reference_onnx is None:
        if artifact is None or artifact.suffix != ".onnx" or not artifact.exists():
            raise RepositoryError(f"{name} ({path}): no ONNX graph to validate against:\n  " + "\n  ".join(
                errors or ["a plan-only model needs reference_onnx"]))
        reference_onnx = artifact
    inputs, outputs = onnx_io(Path(reference_onnx))
    batching = cfg.max_batch_size > 0
    graph_batching = all(t.dims and t.dims[0] == -1 for t in inputs + outputs)
    if batching and not graph_batching:
        errors.append(f"max_batch_size {cfg.max_batch_size} but the ONNX graph has no dynamic batch dimension")
    errors += _check_tensors("input", list(cfg.input), inputs, batching, exact=True)
    errors += _check_tensors("output", list(cfg.output), outputs, batching, exact=False)
    for out in cfg.output:
        if out.label_filename:
            lf = model_dir / out.label_filename
            n = len(lf.read_text().splitlines()) if lf.exists() else None
            if n is None:
                errors.append(f"output {out.name!r}: label file {out.label_filename} is missing")
            elif not out.dims or n != out.dims[-1]:
                errors.append(f"output {out.name!r}: {n} labels for dims {_fmt(out.dims)}")
    by_name = {i.name: i for i in cfg.input}
    for w in cfg.model_warmup:
        for k, wi in w.inputs.items():
            ci = by_name.get(k)
            if ci is None:
                errors.append(f"warm-up {w.name!r}: input {k!r} is not a model input")
            elif len(wi.dims) != len(ci.dims) or any(c >= 0 and c != d for c, d in zip(ci.dims, wi.dims, strict=False)):
                errors.append(f"warm-up {w.name!r}: input {k!r} dims {_fmt(wi.dims)} do not fit {_fmt(ci.dims)}")
            elif wi.data_type != ci.data_type:
                errors.append(f"warm-up {w.name!r}: input {k!r} type differs from the input's")
        if batching and not 1 <= w.batch_size <= cfg.max_batch_size:
            errors.append(f"warm-up {w.name!r}: batch_size {w.batch_size} outside 1…{cfg.max_batch_size}")
    if errors:
        raise RepositoryError(f"{name} ({path}) does not match {Path(reference_onnx).name}:\n  " + "\n  ".join(errors))
    return cfg


def _check_tensors(kind: str, configured: list, graph: list[Tensor], batching: bool, exact: bool) -> list[str]:
    errors = []
    want = {t.name: t for t in graph}
    seen = set()
    for io in configured:
        t = want.get(io.name)
        if t is None:
            errors.append(f"{kind} {io.name!r} is not in the ONNX graph (it has {', '.join(want)})")
            continue
        seen.add(io.name)
        dtype = mc.DataType.Name(io.data_type)
        if dtype != t.data_type:
            errors.append(f"{kind} {io.name!r}: type {dtype} but the ONNX graph has {t.data_type}")
        graph_dims = _split_batch(t, batching)
        effective = list(io.reshape.shape) if io.HasField("reshape") else list(io.dims)
        if effective != graph_dims:
            what = f"reshape {_fmt(effective)}" if io.HasField("reshape") else f"dims {_fmt(io.dims)}"
            errors.append(f"{kind} {io.name!r}: {what} but the ONNX graph has {_fmt(graph_dims)}"
                          + (" (batch excluded)" if batching else ""))
        elif io.HasField("reshape") and _numel(io.dims) != _numel(io.reshape.shape):
            errors.append(f"{kind} {io.name!r}: dims {_fmt(io.dims)} and reshape {_fmt(io.reshape.shape)} "
                          "differ in size")
    missing = [n for n in want if n not in seen]
    if exact and missing:
        errors.append(f"ONNX {kind}(s) {', '.join(map(repr, missing))} missing from the config")
    return errors


def _numel(dims: Iterable[int]) -> int | None:
    n = 1
    for d in dims:
        if d < 0:
            return None
        n *= d
    return n


def validate_repository(repo: Path, onnx_dir: Path | None = None) -> dict[str, mc.ModelConfig]:
    """Validate every model of a repository; plan-only models are checked against ``onnx_dir``.

    The graph a plan was built from is found through the config's ``unroll_source_onnx`` parameter.
    """
    repo = Path(repo)
    if not repo.is_dir():
        raise RepositoryError(f"model repository {repo} does not exist")
    found: dict[str, mc.ModelConfig] = {}
    for model_dir in sorted(p for p in repo.iterdir() if p.is_dir() and not p.name.startswith(".")):
        cfg = mc.ModelConfig()
        try:
            text_format.Parse((model_dir / "config.pbtxt").read_text(), cfg)
        except OSError as e:
            raise RepositoryError(f"{model_dir.name}: no readable config.pbtxt ({e.strerror})") from e
        except text_format.ParseError as e:
            raise RepositoryError(f"{model_dir.name}: config.pbtxt is not a valid Triton model config: {e}") from e
        ref = None
        if cfg.platform == "tensorrt_plan":  # a plan cannot be read without TensorRT: check its source graph
            src = cfg.parameters.get("unroll_source_onnx")
            if onnx_dir is None or src is None:
                raise RepositoryError(f"{model_dir.name}: a TensorRT plan; pass onnx_dir to validate it against "
                                      "the ONNX it was built from")
            ref = Path(onnx_dir) / src.string_value
        found[model_dir.name] = validate_model(model_dir, reference_onnx=ref)
    if not found:
        raise RepositoryError(f"model repository {repo} holds no models")
    return found
