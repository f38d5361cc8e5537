"""``unroll repo``: write (and validate) a Triton model repository for the exported ONNX models.

Two targets share one layout (``<model>/config.pbtxt``, ``<model>/1/…``, ``labels.txt`` for
classifiers) and differ only in how a model runs:

* ``cpu`` — what runs here: the Triton in the nvidia-pytriton wheel has only the Python backend, so
  every model is a Python-backend model (``serving/triton_backend_model.py`` copied as
  ``1/model.py``) that runs ``1/model.onnx`` with the card's CPU runtime (``cpu_runtime``: ONNX Runtime, or
  OpenVINO), one session per instance.
* ``gpu`` — for the NGC ``tritonserver`` container: ``tensorrt_plan`` when ``unroll build`` left a
  plan ``build/trt/<name>.<precision>.plan`` (checked against the JSON beside it, copied as
  ``<model>/trt_plan.json``), else ``onnxruntime_onnx`` with the TensorRT execution accelerator (engine
  cache, one optimization profile per model).

**Precision lives in the graph** (GPU target). TensorRT 10 deprecated weak typing (the builder's
FP16/INT8 flags casting an FP32 network) and TensorRT 11 removed it. So a ``--precision fp16``/``int8`` GPU
config serves ``NAME.fp16.onnx`` / ``NAME.int8.onnx`` from ``unroll quantize`` (FP16 tensors; explicit
Q/DQ) and sets ``precision_mode`` to ``FP32``, which makes ONNX Runtime's TensorRT provider build a
*strongly typed* network that runs the graph's own precision. What this rests on (read in the sources,
not run here, no GPU):

* Triton's onnxruntime backend (``triton-inference-server/onnxruntime_backend``, ``src/onnxruntime.cc`` and
  its README) accepts ``precision_mode`` FP32 | FP16 | BF16 | INT8 and maps FP16 → ORT's
  ``trt_fp16_enable``, INT8 → ``trt_int8_enable``, BF16 → ``trt_bf16_enable``, FP32 → none of them.
* ONNX Runtime's TensorRT provider (``onnxruntime/core/providers/tensorrt/tensorrt_execution_provider.cc``,
  since microsoft/onnxruntime PR #19695 "TRT detailed log and strong typed networks") creates its network
  with ``kSTRONGLY_TYPED`` when built against TensorRT > 8 and neither ``trt_fp16_enable`` nor
  ``trt_int8_enable`` is set; setting either builds weakly typed with the FP16/INT8 builder flag. ORT has
  no separate "strongly typed" provider option (``OrtTensorRTProviderOptionsV2`` lists none).
* An INT8 graph carries explicit Q/DQ, from which a strongly typed network takes its INT8 layers: no
  calibration table (ORT's docs: a table must not be given for a Q/DQ model) and no ``trt_int8_enable``.
  On an ORT built against TensorRT 8 networks are never strongly typed, and a Q/DQ graph without the INT8
  flag fails to build there ("Int8 precision has been set … but int8 is not configured", microsoft/
  onnxruntime issue #13381): use an NGC container whose ONNX Runtime is built against TensorRT 10.

Configs are built as ``model_config_pb2.ModelConfig`` protobufs and printed with ``text_format``,
so they are schema-valid by construction; :func:`validate_repository` re-parses every written
config and checks each input and output (name, type, dims, reshape) against the ONNX graph, and on the
GPU target the served TensorRT profile (:mod:`unroll.serving.profile`, config parameter ``unroll.profile``)
against the graph, ``max_batch_size``, the warm-up shapes and, for a plan, the plan's JSON (passed gate,
profile, I/O, checksums).

Everything model-specific comes from the model card the export wrote into the ONNX (labels, the λ
input and its default, the TensorRT profile, the task); each config carries that card as the parameter
``unroll.card`` so Triton's clients (the gateway) read the same card. Warm-up shapes come from the export
report's verified parity cases.

λ: on the CPU target the λ input is optional and the Python model fills in the card's default
(``input_defaults``); Triton's TensorRT and ONNX Runtime backends cannot default a missing input, so on the
GPU target it is required, and the gateway always sends it (the card's default when a request gives none).

Batching defaults. **No queue delay** (``max_queue_delay_microseconds: 0``): a lone request must not wait
for a batch that is not coming. Triton's dynamic batcher still batches: while the model instance is busy,
requests queue up, and the next execution takes all of them (up to ``max_batch_size``) at once, so under load
batches form by themselves without any delay. A delay only adds latency: with 500 µs a request at
concurrency 1 waits the whole delay in the queue (Triton's "queue" time), and at concurrency 16 the instance
is rarely idle, so batches form without it. The measurement (0 vs 500 µs at concurrency 1 and 16, with
``perf_analyzer``) is the "Dynamic batching queue delay" table of ``benchmarks/results/serve.md``, written by
``unroll bench serve``. On a CPU, batching saves no arithmetic,
only the per-execution overhead of the Python backend; the denoiser gets a small ``max_batch_size`` because
its cost grows with the image area, so a large batch of large images would make every request wait for all
the others.
On the GPU target ``max_batch_size`` is the TensorRT profile's maximum batch (the plan's, else the card's):
the engine covers no more. ``unroll bench serve`` measures dynamic batching on and off through the real
server (``benchmarks/results/``); re-measure on your hardware and pass ``--queue-delay-us`` /
``--max-batch-size``.

Test-only: ``write_repository(..., cpu_stand_in=True)`` writes the GPU target's configs (same inputs, dims,
``max_batch_size``, no ``input_defaults``, the profile, labels) with the platform swapped for the Python
backend running the same graph with ONNX Runtime on the CPU, so the bundled Triton can load them and the
gateway's request path can be tested against GPU configs here. The stand-in model refuses inputs outside
the profile, as TensorRT would. Never deploy a stand-in: it is not what the GPU runs.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import onnx
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from unroll.serving.profile import PROFILE_KEY, ProfileError, Range, ServedProfile, from_plan_profile

from unroll.card import CARD_KEY, CardError, ModelCard, from_onnx

Target = Literal["cpu", "gpu"]
PRECISIONS = ("fp32", "fp16", "int8")
DEFAULT_MAX_BATCH_SIZE = 32
#: CPU exceptions to DEFAULT_MAX_BATCH_SIZE by task (see the module docstring).
CPU_MAX_BATCH_SIZE = {"denoising": 4}
#: No delay: see the module docstring (a lone request must not wait; busy instances batch what queued).
DEFAULT_QUEUE_DELAY_US = 0
#: ONNX Runtime's intra-op threads spin briefly for the next piece of work before they sleep (ONNX Runtime's own
#: default; they block when idle). Measured with perf_analyzer, one digit: concurrency 1 p50 0.70-0.73 ms vs
#: 0.86-0.90 ms without, concurrency 16 2,937-3,084 vs 2,543-2,591 req/s (two rounds each, this 2-core machine).
#: The cost: spinning threads take CPU from neighbours on the same cores; with the gateway on the same 2 cores its
#: concurrency-32 throughput fell from 588 to 533 req/s (the README's Speed section). `unroll repo --no-spinning`.
INTRA_OP_SPINNING = True
VERSION = "1"
LABELS_FILE = "labels.txt"
#: The plan's JSON (``unroll build``), copied beside config.pbtxt so validation can re-check the plan.
PLAN_JSON = "trt_plan.json"
BACKEND_MODEL = Path(__file__).with_name("triton_backend_model.py")
#: Where the NGC container keeps ONNX Runtime's TensorRT engines (must be writable inside it).
GPU_ENGINE_CACHE = "/tmp/unroll-trt-cache"
#: ``precision_mode`` values that make ONNX Runtime's TensorRT provider build weakly typed (see the docstring).
WEAKLY_TYPED_MODES = ("FP16", "BF16", "INT8")
#: Config parameter marking a test-only CPU stand-in; its value is the GPU platform it stands in for.
STAND_IN_KEY = "unroll.cpu_stand_in"

_ONNX_TO_TRITON = {
    onnx.TensorProto.FLOAT: "TYPE_FP32", onnx.TensorProto.FLOAT16: "TYPE_FP16", onnx.TensorProto.BFLOAT16: "TYPE_BF16",
    onnx.TensorProto.DOUBLE: "TYPE_FP64", onnx.TensorProto.INT8: "TYPE_INT8", onnx.TensorProto.UINT8: "TYPE_UINT8",
    onnx.TensorProto.INT16: "TYPE_INT16", onnx.TensorProto.INT32: "TYPE_INT32", onnx.TensorProto.INT64: "TYPE_INT64",
    onnx.TensorProto.BOOL: "TYPE_BOOL", onnx.TensorProto.STRING: "TYPE_STRING",
}
#: A plan JSON's ``io[].dtype`` (torch dtype names, export/trt_build.py) → Triton type.
_PLAN_DTYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "float64": "TYPE_FP64",
                "int8": "TYPE_INT8", "uint8": "TYPE_UINT8", "int32": "TYPE_INT32", "int64": "TYPE_INT64",
                "bool": "TYPE_BOOL"}


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
    onnx: Path  #: the graph served: NAME.onnx, or NAME.PRECISION.onnx (also what a plan was built from)
    report: dict  #: the export report (task, parity shapes, solver settings)
    card: ModelCard  #: the model card carried in the ONNX
    plan: Path | None = None
    plan_report: dict | None = None  #: the JSON ``unroll build`` wrote beside the plan
    profile: ServedProfile | None = None  #: the plan's optimization profile (plans only)


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


def graph_path(name: str, precision: str, onnx_dir: Path) -> Path:
    """The graph that carries ``precision``: ``NAME.onnx`` (fp32) or ``NAME.PRECISION.onnx`` (``unroll quantize``)."""
    return Path(onnx_dir) / (f"{name}.onnx" if precision == "fp32" else f"{name}.{precision}.onnx")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _source(name: str, target: Target, precision: str, onnx_dir: Path, plan_dir: Path) -> Source:
    fp32 = onnx_dir / f"{name}.onnx"
    if not fp32.exists():
        raise RepositoryError(f"{name}: no ONNX export at {fp32}; run `unroll export {name}` first")
    graph = graph_path(name, precision, onnx_dir)
    if not graph.exists():  # both targets serve the graph that carries the precision; nothing is cast at load
        why = (" (GPU configs run the graph's own precision, strongly typed: TensorRT is not asked to cast the FP32 "
               "graph)" if target == "gpu" else "")
        raise RepositoryError(f"{name}: no {precision} model at {graph}; run `unroll quantize {name} --precision "
                              f"{precision}` first{why}")
    report_path = onnx_dir / f"{name}.report.json"
    if not report_path.exists():
        raise RepositoryError(f"{name}: {report_path} is missing; re-run `unroll export {name}`")
    try:
        card = from_onnx(fp32)
    except CardError as e:
        raise RepositoryError(str(e)) from None
    if card.name != name:  # the Triton model name, the gateway's model= and the card must agree
        raise RepositoryError(f"{fp32} carries the card of {card.name!r}: a graph's file stem must be its card's name")
    plan = plan_dir / f"{name}.{precision}.plan" if target == "gpu" else None
    plan_report = profile = None
    if plan is not None and plan.exists():
        plan_report, profile = read_plan_report(name, precision, plan, graph)
    elif plan is not None and plan.with_suffix(".json").exists():
        rep = _load_json(plan.with_suffix(".json"), name)
        if rep.get("passed") is False:  # the engine disagreed with ONNX Runtime FP32 on this GPU: say so
            why = "; ".join(rep.get("failures") or []) or "no details"
            raise RepositoryError(
                f"{name}: the last `unroll build {name} --precision {precision}` failed its parity gate "
                f"({plan.with_suffix('.json')} says passed: false: {why}) "
                "and left no plan; fix and rebuild, or delete that JSON to serve the ONNX through ONNX Runtime's "
                "TensorRT provider instead")
    else:
        plan = None
    return Source(name, graph, json.loads(report_path.read_text()), card, plan, plan_report, profile)


def _load_json(path: Path, name: str) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RepositoryError(f"{name}: cannot read {path}: {e}") from None
    if not isinstance(raw, dict):
        raise RepositoryError(f"{name}: {path} is not a JSON object")
    return raw


def read_plan_report(name: str, precision: str, plan: Path, graph: Path) -> tuple[dict, ServedProfile]:
    """The JSON ``unroll build`` wrote beside ``plan`` and its optimization profile; refused (RepositoryError) when
    missing, failed, for another precision, for another graph than ``graph``, or not describing one profile."""
    path = plan.with_suffix(".json")
    rebuild = f"rebuild with `unroll build {name} --precision {precision}`"
    if not path.exists():
        raise RepositoryError(f"{name}: {plan} has no {path.name} beside it (unroll build writes both; without it "
                              f"the plan's profile and parity gate are unknown); {rebuild}")
    rep = _load_json(path, name)
    errors = []
    if rep.get("passed") is not True:
        errors.append(f"it says passed: {rep.get('passed')!r} (the engine's parity gate against ONNX Runtime FP32 "
                      f"did not pass: {'; '.join(rep.get('failures') or []) or 'no details'})")
    if rep.get("precision") not in (None, precision):
        errors.append(f"it describes a {rep.get('precision')} engine, not {precision}")
    if rep.get("onnx_sha256") and rep["onnx_sha256"] != _sha256(graph):
        errors.append(f"{graph.name} changed since the plan was built from it (sha256 differs): the plan is stale")
    profile = None
    try:
        profile = plan_profile(rep, str(path))
    except ProfileError as e:
        errors.append(str(e))
    if errors:
        raise RepositoryError(f"{name}: refusing {plan.name}: {path}: " + "; ".join(errors) + f"; {rebuild}")
    assert profile is not None
    return rep, ServedProfile(profile.inputs, f"plan {plan.name}")


def plan_profile(report: dict, where: str) -> ServedProfile:
    """The one optimization profile of a plan JSON (``profiles: [{input: {min, opt, max}}]``)."""
    profiles = report.get("profiles")
    if not isinstance(profiles, list) or len(profiles) != 1:
        n = len(profiles) if isinstance(profiles, list) else "no"
        raise ProfileError(f"{where}: expected exactly one optimization profile, found {n}")
    return ServedProfile(from_plan_profile(profiles[0], where))


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


def _graph_dims(inp) -> list[int]:
    """Per-sample graph dims of a config input (its ``reshape`` where it has one)."""
    return list(inp.reshape.shape) if inp.HasField("reshape") else list(inp.dims)


def card_profile(src: Source, cfg: mc.ModelConfig) -> ServedProfile:
    """One TensorRT optimization profile from the card: batch up to ``max_batch_size``, dynamic axes per card.

    The card's ``trt_profile.batch`` gives min/opt (capped at the config's ``max_batch_size``, which is
    the profile's max); ``trt_profile.dims`` the range of each dynamic axis of the card's main input.
    """
    prof = src.card.trt_profile
    b = cfg.max_batch_size
    out: dict[str, Range] = {}
    for inp in cfg.input:
        lo, op, hi = ([min(prof.batch[0], b)], [min(prof.batch[1], b)], [b]) if b else ([], [], [])
        for axis, d in enumerate(_graph_dims(inp)):
            if d >= 0:
                triple = (d, d, d)
            elif inp.name == src.card.input.name and str(axis) in prof.dims:
                triple = prof.dims[str(axis)]
            else:
                raise RepositoryError(f"{src.name}: input {inp.name!r} axis {axis} is dynamic; the card needs "
                                      f"trt_profile.dims['{axis}'] (min, opt, max) for the TensorRT profile")
            for lst, v in zip((lo, op, hi), triple, strict=True):
                lst.append(v)
        out[inp.name] = Range(tuple(lo), tuple(op), tuple(hi))
    return ServedProfile(out, "card trt_profile")


def ort_profile_params(profile: ServedProfile) -> dict[str, str]:
    """ONNX Runtime's ``trt_profile_{min,opt,max}_shapes`` strings (``name:AxBxC,…``) for ``profile``."""
    def fmt(which: str) -> str:
        return ",".join(f"{n}:{'x'.join(map(str, getattr(r, which)))}" for n, r in profile.inputs.items())

    return {f"trt_profile_{w}_shapes": fmt(w) for w in ("min", "opt", "max")}


def default_max_batch_size(target: Target, card: ModelCard, profile: ServedProfile | None = None) -> int:
    """GPU: the plan's profile maximum (``profile``), else the card's; CPU: :data:`DEFAULT_MAX_BATCH_SIZE` or the
    task's exception."""
    if target == "gpu":
        return profile.max_batch if profile is not None else card.trt_profile.batch[2]
    return CPU_MAX_BATCH_SIZE.get(card.task, DEFAULT_MAX_BATCH_SIZE)


def build_config(src: Source, target: Target, precision: str = "fp32", threads: int = 2,
                 max_batch_size: int | None = None, queue_delay_us: int = DEFAULT_QUEUE_DELAY_US,
                 instances: int = 1, cpu_stand_in: bool = False,
                 spinning: bool = INTRA_OP_SPINNING) -> tuple[mc.ModelConfig, list[str] | None]:
    """The ModelConfig for one model, and its labels (classifiers) or None (``cpu_stand_in``: see the module doc)."""
    if max_batch_size is None:
        max_batch_size = default_max_batch_size(target, src.card, src.profile)
    inputs, outputs = onnx_io(src.onnx)
    batching = all(t.dims and t.dims[0] == -1 for t in inputs + outputs)
    if batching and src.profile is not None and max_batch_size > src.profile.max_batch:
        raise RepositoryError(f"{src.name}: max_batch_size {max_batch_size} exceeds the max batch "
                              f"{src.profile.max_batch} of the optimization profile {src.plan.name} was built with "
                              f"({src.plan.with_suffix('.json').name}); lower --max-batch-size or rebuild the plan "
                              "with a larger batch")
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
        cfg.dynamic_batching.SetInParent()  # present even with delay 0 (the default): dynamic batching on
        cfg.dynamic_batching.max_queue_delay_microseconds = queue_delay_us
    kind = mc.ModelInstanceGroup.KIND_CPU if target == "cpu" else mc.ModelInstanceGroup.KIND_GPU
    cfg.instance_group.add(kind=kind, count=instances)
    params = {"unroll_source_onnx": src.onnx.name, CARD_KEY: src.card.to_json()}
    # what serving/triton_backend_model.py reads (the CPU target, and the test-only stand-in of a GPU config)
    python_backend = {"onnx_file": "model.onnx", "intra_op_num_threads": str(threads),
                      "intra_op_spinning": "1" if spinning else "0"}
    if target == "cpu":
        params |= python_backend | {"cpu_runtime": src.card.cpu_runtime, "input_defaults": json.dumps(defaults)}
    else:
        profile = src.profile if src.profile is not None else card_profile(src, cfg)
        params[PROFILE_KEY] = profile.to_json()
        if src.plan is None:
            acc = cfg.optimization.execution_accelerators.gpu_execution_accelerator.add(name="tensorrt")
            acc.parameters.update({
                # FP32 = neither trt_fp16_enable nor trt_int8_enable: a strongly typed network running the
                # graph's own precision (NAME.PRECISION.onnx); see the module docstring for the sources.
                "precision_mode": "FP32",
                "max_workspace_size_bytes": str(1 << 30),
                "trt_engine_cache_enable": "1",
                "trt_engine_cache_path": f"{GPU_ENGINE_CACHE}/{src.name}",
                "trt_timing_cache_enable": "1",
                "trt_timing_cache_path": f"{GPU_ENGINE_CACHE}/{src.name}",
                **ort_profile_params(profile),
            })
    if cpu_stand_in:
        if src.plan is not None:
            raise RepositoryError(f"{src.name}: the CPU stand-in replaces ONNX Runtime's TensorRT provider only; a "
                                  f"TensorRT plan ({src.plan}) cannot be stood in for")
        params[STAND_IN_KEY] = cfg.platform
        cfg.ClearField("platform")
        cfg.ClearField("optimization")
        cfg.backend = "python"
        cfg.instance_group[0].kind = mc.ModelInstanceGroup.KIND_CPU
        params |= python_backend
    for k, v in params.items():
        cfg.parameters[k].string_value = v
    _warmup(src, cfg, sorted({1, max_batch_size}) if batching else [1])
    return cfg, labels


def _header(src: Source, target: Target, precision: str, cfg: mc.ModelConfig, cpu_stand_in: bool = False) -> str:
    lines = [f"Generated by `unroll repo --target {target} --precision {precision}` from {src.onnx.name}"
             + (f" and {src.plan.name}" if src.plan else "") + "; regenerate instead of editing."]
    if cpu_stand_in:
        lines.append("TEST-ONLY CPU STAND-IN (write_repository(cpu_stand_in=True)): the GPU config with the Python "
                     "backend running this graph with ONNX Runtime on the CPU, refusing inputs outside "
                     f"{PROFILE_KEY} as TensorRT would. Never deploy it.")
    lines += ["dims exclude the batch dimension (-1 = dynamic); a [B] graph tensor is dims [1] + reshape [] "
              "(clients send it as [B, 1]).",
              "max_queue_delay_microseconds and max_batch_size: defaults explained in serving/repository.py "
              "(re-measure with `unroll bench serve`).",
              "model_warmup runs before the model reports ready."]
    if src.card.lam is not None:
        lines.append("lam is optional (default = the trained λ) on the CPU target only: the GPU backends cannot "
                     "default a missing input, so the gateway always sends lam." if target == "cpu"
                     else "lam is required here (Triton's TensorRT/ONNX Runtime backends cannot default a missing "
                     "input); the gateway always sends it: the card's default when a request gives none.")
    if target == "gpu":
        lines.append(f"{PROFILE_KEY}: the TensorRT optimization profile served (per input min/opt/max, batch "
                     f"first; from {src.profile.source if src.profile else 'the card trt_profile'}). The engine "
                     "covers nothing outside it: the gateway answers 413/422 for images outside it and splits "
                     "batches at its max batch.")
    if target == "gpu" and src.plan is None:
        what = {"fp32": "FP32 tensors", "fp16": "FP16 tensors written by `unroll quantize`",
                "int8": "explicit Q/DQ written by `unroll quantize`; no calibration table"}[precision]
        lines.append(f"Precision lives in the graph: model.onnx is {src.onnx.name} ({what}); precision_mode FP32 sets "
                     "neither trt_fp16_enable nor trt_int8_enable, so ONNX Runtime's TensorRT provider builds a "
                     "strongly typed network that runs the graph's own precision (TensorRT is not asked to cast; weak "
                     "typing is removed in TensorRT 11). Needs ONNX Runtime built against TensorRT >= 10 (sources: "
                     "serving/repository.py docstring).")
        lines.append("The accelerator's trt_profile_*_shapes are the same profile; the engine built at load "
                     "covers only that range, so widen the card's trt_profile and regenerate for larger inputs.")
    if target == "gpu" and src.plan is not None:
        lines.append(f"The plan was built strongly typed from {src.onnx.name}; {PLAN_JSON} is its JSON "
                     f"({src.plan.with_suffix('.json').name}): passed gate, profile, I/O, checksums, re-checked "
                     "by `unroll repo`/`unroll triton` validation.")
    return "".join(f"# {ln}\n" for ln in lines)


def write_repository(target: Target, models: list[str], out: Path, precision: str = "fp32",
                     onnx_dir: Path = Path("build/onnx"), plan_dir: Path = Path("build/trt"), threads: int = 2,
                     max_batch_size: int | None = None, queue_delay_us: int = DEFAULT_QUEUE_DELAY_US,
                     instances: int = 1, cpu_stand_in: bool = False, spinning: bool = INTRA_OP_SPINNING) -> list[Path]:
    """Write ``out/<model>/config.pbtxt`` + ``out/<model>/1/…`` (+ ``labels.txt``) for each model; validate.

    ``models`` are ONNX file stems in ``onnx_dir`` (a model's name; its λ-rule companion is a model of its
    own, named on its card). ``max_batch_size=None`` takes :func:`default_max_batch_size` per model; an int applies
    to every model. Each model directory is rebuilt from scratch (so switching targets leaves no stale
    ``model.py`` or plan), other directories in ``out`` are left alone. Returns the files written.

    ``cpu_stand_in`` (TEST-ONLY, ``target="gpu"`` only): the GPU configs with the Python backend running the same
    graph with ONNX Runtime on the CPU, so the bundled Triton can load them (see the module docstring).
    """
    if target not in ("cpu", "gpu"):
        raise RepositoryError(f"target must be cpu or gpu, not {target!r}")
    if precision not in PRECISIONS:
        raise RepositoryError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if (max_batch_size is not None and max_batch_size < 1) or queue_delay_us < 0 or threads < 1 or instances < 1:
        raise RepositoryError("max_batch_size, threads and instances must be ≥ 1 and queue_delay_us ≥ 0")
    if cpu_stand_in and target != "gpu":
        raise RepositoryError("cpu_stand_in stands in for GPU configs: use it with target='gpu'")
    if not models:
        raise RepositoryError("no models given")
    sources = [_source(m, target, precision, Path(onnx_dir), Path(plan_dir)) for m in dict.fromkeys(models)]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for src in sources:
        cfg, labels = build_config(src, target, precision, threads, max_batch_size, queue_delay_us, instances,
                                   cpu_stand_in, spinning)
        tmp = out / f".{src.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / VERSION).mkdir(parents=True)
        files = {"config.pbtxt": None}
        (tmp / "config.pbtxt").write_text(_header(src, target, precision, cfg, cpu_stand_in)
                                          + text_format.MessageToString(cfg))
        if labels is not None:
            (tmp / LABELS_FILE).write_text("\n".join(labels) + "\n")
            files[LABELS_FILE] = None
        if src.plan is not None:
            shutil.copyfile(src.plan, tmp / VERSION / "model.plan")
            shutil.copyfile(src.plan.with_suffix(".json"), tmp / PLAN_JSON)
            files[f"{VERSION}/model.plan"] = files[PLAN_JSON] = None
        else:
            shutil.copyfile(src.onnx, tmp / VERSION / "model.onnx")
            files[f"{VERSION}/model.onnx"] = None
        if cfg.backend == "python":
            shutil.copyfile(BACKEND_MODEL, tmp / VERSION / "model.py")
            files[f"{VERSION}/model.py"] = None
        try:
            validate_model(tmp, reference_onnx=src.onnx, name=src.name)
        except RepositoryError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
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
    (a plan-only model needs ``reference_onnx``). A GPU config's served profile (``unroll.profile``) is
    checked against the graph, ``max_batch_size``, the warm-ups and the TensorRT accelerator's shapes and
    precision mode; a plan against its JSON (:data:`PLAN_JSON`). Every problem is collected; one
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
    errors += _gpu_errors(cfg, model_dir, inputs, outputs, artifact, Path(reference_onnx))
    if errors:
        raise RepositoryError(f"{name} ({path}) does not match {Path(reference_onnx).name}:\n  " + "\n  ".join(errors))
    return cfg


def _is_gpu_config(cfg: mc.ModelConfig) -> bool:
    """Written for the GPU target (or its test-only CPU stand-in): these carry a TensorRT profile."""
    accelerated = any(a.name == "tensorrt" for a in cfg.optimization.execution_accelerators.gpu_execution_accelerator)
    return cfg.platform == "tensorrt_plan" or accelerated or STAND_IN_KEY in cfg.parameters


def _gpu_errors(cfg: mc.ModelConfig, model_dir: Path, inputs: list[Tensor], outputs: list[Tensor],
                artifact: Path | None, reference: Path) -> list[str]:
    """The served profile against the graph, batching, warm-ups and the accelerator; a plan against its JSON."""
    if not _is_gpu_config(cfg):
        return []
    if PROFILE_KEY not in cfg.parameters:
        return [f"no {PROFILE_KEY} parameter (the TensorRT profile served): rewrite the config with `unroll repo`"]
    try:
        profile = ServedProfile.from_json(cfg.parameters[PROFILE_KEY].string_value, PROFILE_KEY)
    except ProfileError as e:
        return [str(e)]
    errors = _profile_errors(cfg, inputs, profile)
    for acc in cfg.optimization.execution_accelerators.gpu_execution_accelerator:
        if acc.name != "tensorrt":
            continue
        mode = acc.parameters.get("precision_mode", "FP32")
        if mode in WEAKLY_TYPED_MODES:
            errors.append(f"precision_mode {mode} makes ONNX Runtime's TensorRT provider build a weakly typed network "
                          f"(TensorRT casts the graph; removed in TensorRT 11): serve the {mode.lower()} graph from "
                          "`unroll quantize` with precision_mode FP32 (`unroll repo --target gpu --precision "
                          f"{mode.lower()}`)")
        for k, v in ort_profile_params(profile).items():
            if acc.parameters.get(k) != v:
                errors.append(f"accelerator {k} {acc.parameters.get(k)!r} differs from {PROFILE_KEY} ({v!r})")
    if cfg.platform == "tensorrt_plan":
        errors += _plan_errors(cfg, model_dir, inputs, outputs, artifact, reference, profile)
    return errors


def _profile_errors(cfg: mc.ModelConfig, inputs: list[Tensor], profile: ServedProfile) -> list[str]:
    errors = []
    names = [i.name for i in cfg.input]
    if set(profile.inputs) != set(names):
        errors.append(f"{PROFILE_KEY} covers inputs {sorted(profile.inputs)}, the config has {sorted(names)}")
    graph = {t.name: t.dims for t in inputs}
    for n, r in profile.inputs.items():
        g = graph.get(n)
        if g is None:
            continue
        if len(r.max) != len(g):
            errors.append(f"{PROFILE_KEY}: input {n!r} has rank {len(r.max)}, the graph's {_fmt(g)} has {len(g)}")
            continue
        for axis, (d, lo, mid, hi) in enumerate(zip(g, r.min, r.opt, r.max, strict=True)):
            if d >= 0 and not lo == mid == hi == d:
                errors.append(f"{PROFILE_KEY}: input {n!r} axis {axis} is {d} in the graph but {lo}/{mid}/{hi} in "
                              "the profile")
    if cfg.max_batch_size > 0 and profile.inputs:
        if cfg.max_batch_size > profile.max_batch:
            errors.append(f"max_batch_size {cfg.max_batch_size} exceeds the TensorRT profile's max batch "
                          f"{profile.max_batch} ({profile.source or PROFILE_KEY})")
        if profile.min_batch > 1:
            errors.append(f"the TensorRT profile's min batch is {profile.min_batch}, but Triton sends batches from 1")
    by_name = {i.name: i for i in cfg.input}
    for w in cfg.model_warmup:
        lead = [w.batch_size] if cfg.max_batch_size > 0 else []
        shapes = {k: tuple(lead + (_graph_dims(by_name[k]) if by_name[k].HasField("reshape") else list(wi.dims)))
                  for k, wi in w.inputs.items() if k in by_name}
        errors += [f"warm-up {w.name!r}: {v}" for v in profile.violations(shapes)]
    return errors


def _plan_errors(cfg: mc.ModelConfig, model_dir: Path, inputs: list[Tensor], outputs: list[Tensor],
                 plan: Path | None, reference: Path, profile: ServedProfile) -> list[str]:
    """A served plan against the JSON ``unroll build`` wrote beside it (copied as :data:`PLAN_JSON`)."""
    path = model_dir / PLAN_JSON
    if not path.exists():
        return [f"{PLAN_JSON} (the plan's JSON from `unroll build`) is missing: rewrite with `unroll repo`"]
    try:
        rep = json.loads(path.read_text())
        built = plan_profile(rep, PLAN_JSON)
    except (ValueError, ProfileError) as e:
        return [f"{PLAN_JSON}: {e}"]
    errors = []
    if rep.get("passed") is not True:
        errors.append(f"{PLAN_JSON} says passed: {rep.get('passed')!r}: the engine failed its parity gate")
    if built.inputs != profile.inputs:
        errors.append(f"{PROFILE_KEY} differs from the plan's profile in {PLAN_JSON}")
    if cfg.max_batch_size > built.max_batch:
        errors.append(f"max_batch_size {cfg.max_batch_size} exceeds the plan profile's max batch {built.max_batch}")
    if plan is not None and plan.exists() and rep.get("plan_sha256") and rep["plan_sha256"] != _sha256(plan):
        errors.append(f"{plan.name} is not the plan {PLAN_JSON} describes (sha256 differs)")
    if rep.get("onnx_sha256") and reference.exists() and rep["onnx_sha256"] != _sha256(reference):
        errors.append(f"{reference.name} changed since the plan was built from it (sha256 differs): the plan is stale")
    if isinstance(rep.get("io"), list):
        errors += plan_io_errors(rep["io"], inputs, outputs)
    return errors


def plan_io_errors(io: list[dict], inputs: list[Tensor], outputs: list[Tensor]) -> list[str]:
    """A plan JSON's ``io`` (name, mode, dtype, shape with -1 where dynamic) against the ONNX graph's tensors."""
    errors = []
    for mode, tensors in (("input", inputs), ("output", outputs)):
        plan = {str(e.get("name")): e for e in io if isinstance(e, dict) and e.get("mode") == mode}
        graph = {t.name: t for t in tensors}
        if set(plan) != set(graph):
            errors.append(f"the plan's {mode}s {sorted(plan)} differ from the ONNX graph's {sorted(graph)}")
        for n in sorted(set(plan) & set(graph)):
            e, t = plan[n], graph[n]
            dtype = _PLAN_DTYPES.get(str(e.get("dtype")))
            if dtype != t.data_type:
                errors.append(f"plan {mode} {n!r} is {e.get('dtype')}, the ONNX graph's is {t.data_type}")
            shape = e.get("shape")
            if not isinstance(shape, list) or len(shape) != len(t.dims) or any(
                    int(p) >= 0 and d >= 0 and int(p) != d for p, d in zip(shape, t.dims, strict=True)):
                errors.append(f"plan {mode} {n!r} has shape {shape}, the ONNX graph's is {_fmt(t.dims)}")
    return errors


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
