"""``unroll repo``: write (and validate) a Triton model repository for the exported ONNX models.

Two targets, one layout (``<model>/config.pbtxt``, ``<model>/1/…``, ``labels.txt``). ``cpu`` serves every model
through the Python backend (:mod:`unroll.serving.triton_backend_model` with the card's ``cpu_runtime``), the only
backend of the bundled Triton. ``gpu`` with runtime ``torch`` is the same Python backend on the bundled Triton with
``KIND_GPU`` instances running each model's PyTorch module (:mod:`unroll.serving.torch_runtime`): what a CUDA
machine without NVIDIA's container serves; its precision (``fp16``, or ``bf16``) is the module's, behind the card's
fp16 gate at load, and its dynamic batcher's preferred sizes (:data:`TORCH_PREFERRED_BATCH`) are the batch sizes
whose CUDA graphs are captured at load. ``gpu`` otherwise (the NGC container) serves an ``unroll build`` plan
whose JSON says it passed and matches, else ``onnxruntime_onnx`` with the TensorRT accelerator at
``precision_mode`` FP32: a strongly typed network that runs the graph's own precision (``NAME.fp16/int8.onnx``;
ONNX Runtime's TensorRT provider since microsoft/onnxruntime#19695, built against TensorRT ≥ 10), because TensorRT
11 removed weak typing. Everything model-specific comes from the card in the ONNX and is copied into each config as
``unroll.card``; configs are protobufs, and :func:`validate_repository` re-checks each against its graph (and its
profile and plan on GPU).
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

from unroll import artifacts, tasks
from unroll.card import CARD_KEY, CardError, ModelCard, OodCard, from_onnx
from unroll.errors import RepositoryError  # re-exported: callers import it from here
from unroll.serving import torch_runtime
from unroll.serving.imaging import prepare, wire
from unroll.serving.profile import PROFILE_KEY, Range, ServedProfile
from unroll.serving.repository_check import (
    PLAN_JSON,
    STAND_IN_KEY,
    Tensor,
    load_json,
    onnx_io,
    ort_profile_params,
    read_plan_report,
    split_batch,
    validate_model,
)
from unroll.trt_profile import profile_shapes

Target = Literal["cpu", "gpu"]
PRECISIONS = artifacts.PRECISIONS
DEFAULT_MAX_BATCH_SIZE = 32
#: CPU exceptions to DEFAULT_MAX_BATCH_SIZE by task: a denoiser's cost grows with the image area, so a large batch
#: of large images would make every request wait for all the others.
CPU_MAX_BATCH_SIZE = {t.name: t.cpu_max_batch for t in tasks.all_tasks() if t.cpu_max_batch}
#: No delay: a lone request must not wait for a batch that is not coming, and a busy instance still batches what
#: queued meanwhile. ``unroll bench serve`` measures delays against each other (``benchmarks/results/serve.md``).
DEFAULT_QUEUE_DELAY_US = 0
#: ONNX Runtime's intra-op threads spin briefly for the next piece of work before they sleep (ONNX Runtime's own
#: default): lower latency per request, at the cost of CPU taken from neighbours on the same cores (the gateway).
#: `unroll repo --no-spinning` turns it off; compare both with `unroll bench serve` on your machine.
INTRA_OP_SPINNING = True
VERSION = "1"
#: The AOTInductor package's file name in a version directory (with its ``.json`` sidecar beside it).
AOTI_PACKAGE = "model.pt2"
#: Runtimes of ``target="gpu"`` configs for the bundled Triton (``KIND_GPU`` Python-backend instances); a GPU config
#: without one is for NVIDIA's container (TensorRT / ONNX Runtime).
GPU_RUNTIMES = ("torch",)
#: The torch runtime's GPU configs: the dynamic batcher's preferred batch sizes (those up to ``max_batch_size``, and
#: it): the sizes whose CUDA graphs the instance captures at load, a smaller batch padded up to the next of them
#: (serving/torch_runtime.py), so at most half of a replay's rows are padding.
TORCH_PREFERRED_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: The precisions the torch runtime serves (``inference_precision``): FP32, and half precision behind the card's fp16
#: gate (``--precision fp16`` on a GPU; ``bf16`` anywhere).
TORCH_PRECISIONS = ("fp32", "fp16")


def bundled_gpu(target: str, runtime: str | None) -> bool:
    """Whether a config of ``target`` with ``runtime`` is the bundled Triton's on a GPU: our Python-backend model,
    no TensorRT plan."""
    return target == "gpu" and runtime in GPU_RUNTIMES


#: Config parameter that says why a model asked to run on the ``torch`` runtime is served by its card's instead.
TORCH_NOTE_KEY = "unroll.runtime_note"
LABELS_FILE = "labels.txt"
BACKEND_MODEL = Path(__file__).with_name("triton_backend_model.py")
#: Where the NGC container keeps ONNX Runtime's TensorRT engines (must be writable inside it).
GPU_ENGINE_CACHE = "/tmp/unroll-trt-cache"


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


def _source(name: str, target: Target, precision: str, onnx_dir: Path, plan_dir: Path, plans: bool = True) -> Source:
    fp32 = artifacts.graph(name, onnx_dir=onnx_dir)
    if not fp32.exists():
        raise RepositoryError(f"{name}: no ONNX export at {fp32}; run `unroll export {name}` first")
    graph = artifacts.graph(name, precision, onnx_dir)
    if not graph.exists():  # both targets serve the graph that carries the precision; nothing is cast at load
        why = (" (GPU configs run the graph's own precision, strongly typed: TensorRT is not asked to cast the FP32 "
               "graph)" if target == "gpu" else "")
        raise RepositoryError(f"{name}: no {precision} model at {graph}; run `unroll quantize {name} --precision "
                              f"{precision}` first{why}")
    report_path = artifacts.graph_report(name, onnx_dir=onnx_dir)
    if not report_path.exists():
        raise RepositoryError(f"{name}: {report_path} is missing; re-run `unroll export {name}`")
    try:
        card = from_onnx(fp32)
    except CardError as e:
        raise RepositoryError(str(e)) from None
    if card.name != name:  # the Triton model name, the gateway's model= and the card must agree
        raise RepositoryError(f"{fp32} carries the card of {card.name!r}: a graph's file stem must be its card's name")
    if precision != "fp32" and card.ood is not None and card.ood.calibrated:
        card = card.model_copy(update={"ood": _quantized_rule(name, precision, graph)})
    plan = artifacts.plan(name, precision, plan_dir) if target == "gpu" and plans else None
    plan_report = profile = None
    if plan is not None and plan.exists():
        plan_report, profile = read_plan_report(name, precision, plan, graph)
    elif plan is not None and artifacts.plan_json(plan).exists():
        rep = load_json(artifacts.plan_json(plan), name)
        if rep.get("passed") is False:  # the engine disagreed with ONNX Runtime FP32 on this GPU: say so
            why = "; ".join(rep.get("failures") or []) or "no details"
            raise RepositoryError(
                f"{name}: the last `unroll build {name} --precision {precision}` failed its parity gate "
                f"({artifacts.plan_json(plan)} says passed: false: {why}) "
                "and left no plan; fix and rebuild, or delete that JSON to serve the ONNX through ONNX Runtime's "
                "TensorRT provider instead")
    else:
        plan = None
    return Source(name, graph, json.loads(report_path.read_text()), card, plan, plan_report, profile)


def _quantized_rule(name: str, precision: str, graph: Path) -> OodCard:
    """The out-of-distribution rule measured on the quantized graph itself (``unroll quantize`` measures it again:
    a quantized solver's residual moves), or a clear error for a graph quantized before it did."""
    try:
        rule = from_onnx(graph).ood
    except CardError as e:
        raise RepositoryError(str(e)) from None
    if rule is None or not rule.calibrated or rule.measured_on != precision:
        raise RepositoryError(f"{name}: {graph} carries no out-of-distribution rule measured on its own {precision} "
                              f"outputs (the FP32 rule would misjudge them); re-run `unroll quantize {name} "
                              f"--precision {precision}`")
    return rule


def class_labels(card: ModelCard, num_classes: int) -> list[str]:
    """Label strings for Triton's classification extension (``score:index:label``): the card's, else indices."""
    if card.labels is not None:
        if len(card.labels) != num_classes:
            raise RepositoryError(f"{card.name}: the card has {len(card.labels)} labels for {num_classes} logits")
        return list(card.labels)
    return [str(i) for i in range(num_classes)]


def _io_config(cls: type, t: Tensor, batching: bool):
    """A ModelInput/ModelOutput for ``t``; a batch-only tensor ([B]) becomes dims [1] + reshape []."""
    dims = split_batch(t, batching)
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
            if inp.name in image_inputs(cfg):  # encoded images: warmed up through the float input they replace
                continue
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


def card_profile(src: Source, cfg: mc.ModelConfig) -> ServedProfile:
    """One TensorRT optimization profile from the card (:func:`unroll.trt_profile.profile_shapes`, the one builder
    ``unroll build`` uses too), its batch capped at the config's ``max_batch_size``, which is the profile's max."""
    b = cfg.max_batch_size
    prof = src.card.trt_profile
    batch = (min(prof.batch[0], b), min(prof.batch[1], b), b) if b else None
    try:
        shapes = profile_shapes(onnx.load(str(src.onnx), load_external_data=False), src.card, batch)
    except ValueError as e:
        raise RepositoryError(f"{src.name}: {e} (the TensorRT profile of its GPU config)") from None
    return ServedProfile({n: Range(*t) for n, t in shapes.items()}, "card trt_profile")


def default_max_batch_size(target: Target, card: ModelCard, profile: ServedProfile | None = None) -> int:
    """GPU: the plan's profile maximum (``profile``), else the card's; CPU: :data:`DEFAULT_MAX_BATCH_SIZE` or the
    task's exception."""
    if target == "gpu":
        return profile.max_batch if profile is not None else card.trt_profile.batch[2]
    return tasks.get(card.task).cpu_max_batch or DEFAULT_MAX_BATCH_SIZE


def build_config(src: Source, target: Target, precision: str = "fp32", threads: int = 2,
                 max_batch_size: int | None = None, queue_delay_us: int = DEFAULT_QUEUE_DELAY_US,
                 instances: int = 1, cpu_stand_in: bool = False, spinning: bool = INTRA_OP_SPINNING,
                 max_pixels: int = wire.DEFAULT_MAX_PIXELS, max_aspect_ratio: float = wire.DEFAULT_MAX_ASPECT_RATIO,
                 runtime: str | None = None, static_shapes: bool | None = None, bf16: bool = False,
                 ) -> tuple[mc.ModelConfig, list[str] | None]:
    """The ModelConfig for one model, and its labels (classifiers) or None (``cpu_stand_in``: see the module doc).

    A CPU config of a model whose card takes an image and whose task has a gateway route (classifiers, denoisers)
    also takes encoded images (:func:`_image_protocol`), within ``max_pixels`` and ``max_aspect_ratio`` (defaults:
    the gateway's). ``runtime`` / ``static_shapes`` (CPU): the card's ``cpu_runtime`` / ``cpu_static_shapes`` unless
    given (``unroll optimize``'s choice); ``bf16``: OpenVINO's bfloat16 maths on the graph."""
    if max_batch_size is None:
        max_batch_size = default_max_batch_size(target, src.card, src.profile)
    torch_gpu = bundled_gpu(target, runtime)  # the bundled Triton on a CUDA machine (module doc)
    python = target == "cpu" or torch_gpu  # our Python-backend model runs it
    inputs, outputs = onnx_io(src.onnx)
    batching = all(t.dims and t.dims[0] == -1 for t in inputs + outputs)
    cfg = _base_config(src, python, max_batch_size, batching)
    defaults = _add_inputs(cfg, src, inputs, batching, python)
    labels = _add_outputs(cfg, src, outputs, batching)
    kind = _protocol_kind(src, inputs + outputs) if python and not cpu_stand_in else None
    if kind is not None:
        _image_protocol(src, cfg, kind)
    if batching:
        cfg.dynamic_batching.SetInParent()  # present even with delay 0 (the default): dynamic batching on
        cfg.dynamic_batching.max_queue_delay_microseconds = queue_delay_us
    device = mc.ModelInstanceGroup.KIND_CPU if target == "cpu" else mc.ModelInstanceGroup.KIND_GPU
    cfg.instance_group.add(kind=device, count=instances)
    params = {"unroll_source_onnx": src.onnx.name, CARD_KEY: src.card.to_json()}
    if python:
        params |= _backend_params(threads, spinning)
        params |= _runtime_params(src, cfg, precision, runtime or src.card.cpu_runtime, torch_gpu, static_shapes,
                                  bf16, defaults)
        if kind is not None:
            params |= {wire.MAX_PIXELS_KEY: str(max_pixels), wire.MAX_ASPECT_RATIO_KEY: f"{max_aspect_ratio:g}"}
    else:
        params |= _gpu_params(src, cfg)
    if cpu_stand_in:
        params |= _stand_in(src, cfg) | _backend_params(threads, spinning)
    for k, v in params.items():
        cfg.parameters[k].string_value = v
    _warmup(src, cfg, sorted({1, max_batch_size}) if batching else [1])
    return cfg, labels


def _base_config(src: Source, python: bool, max_batch_size: int, batching: bool) -> mc.ModelConfig:
    """An empty config with its name, batch size and what runs it (our Python backend, a plan, or ONNX Runtime);
    a batch larger than the plan's profile allows is refused here, with how to fix it."""
    if batching and src.profile is not None and max_batch_size > src.profile.max_batch:
        raise RepositoryError(f"{src.name}: max_batch_size {max_batch_size} exceeds the max batch "
                              f"{src.profile.max_batch} of the optimization profile {src.plan.name} was built with "
                              f"({artifacts.plan_json(src.plan).name}); lower --max-batch-size or rebuild the plan "
                              "with a larger batch")
    cfg = mc.ModelConfig(name=src.name, max_batch_size=max_batch_size if batching else 0)
    if python:
        cfg.backend = "python"
    else:
        cfg.platform = "tensorrt_plan" if src.plan is not None else "onnxruntime_onnx"
    return cfg


def _add_inputs(cfg: mc.ModelConfig, src: Source, inputs: list[Tensor], batching: bool,
                python: bool) -> dict[str, float]:
    """The graph's inputs into ``cfg``; returns the defaults of those made optional (λ, in the Python backend)."""
    defaults: dict[str, float] = {}
    for t in inputs:
        io = cfg.input.add()
        io.CopyFrom(_io_config(mc.ModelInput, t, batching))
        if src.card.lam is not None and t.name == src.card.lam.input and python:
            # optional with the model's own λ: the Python model fills it in. The GPU backends cannot
            # default a missing input, so there it stays required and the gateway always sends it.
            io.optional = True
            defaults[t.name] = src.card.lam.default
    return defaults


def _add_outputs(cfg: mc.ModelConfig, src: Source, outputs: list[Tensor], batching: bool) -> list[str] | None:
    """The graph's outputs into ``cfg``; returns a classifier's labels (its logits output names the labels file)."""
    labels = None
    for t in outputs:
        io = cfg.output.add()
        io.CopyFrom(_io_config(mc.ModelOutput, t, batching))
        if tasks.get(src.card.task).logits and t.name == src.card.output:
            labels = class_labels(src.card, t.dims[-1])
            io.label_filename = LABELS_FILE
    return labels


def _protocol_kind(src: Source, graph_io: list[Tensor]) -> str | None:
    """Which half of the encoded-image protocol a Python-backend config takes (:func:`.prepare.protocol_kind`), or
    None: for a card without it, and for a graph with a tensor of one of the protocol's names (see :func:`_header`)."""
    kind = prepare.protocol_kind(src.card)
    if kind is not None and {t.name for t in graph_io} & set(wire.NAMES):
        return None  # served as its graph only
    return kind


def _backend_params(threads: int, spinning: bool) -> dict[str, str]:
    """What serving/triton_backend_model.py reads to open ONNX Runtime (the CPU target, and the test-only stand-in
    of a GPU config)."""
    return {"onnx_file": "model.onnx", "intra_op_num_threads": str(threads),
            "intra_op_spinning": "1" if spinning else "0"}


def _runtime_params(src: Source, cfg: mc.ModelConfig, precision: str, asked: str, torch_gpu: bool,
                    static_shapes: bool | None, bf16: bool, defaults: dict[str, float]) -> dict[str, str]:
    """The Python backend's runtime parameters: the runtime that serves (``asked``, else the card's where the
    torch runtime cannot serve the model: said in :data:`TORCH_NOTE_KEY`, on CPU instances), its shape mode and
    maths precision, the λ default; a torch GPU config's preferred batch sizes go into ``cfg``."""
    params: dict[str, str] = {}
    runtime = asked
    if asked == "torch" and (why := torch_runtime.why_not(src.card)) is not None:
        runtime = src.card.cpu_runtime  # said in the config's header and served as such (/v1/models: runtime)
        where = " on the CPU (the bundled Triton has no other GPU runtime)" if torch_gpu else ""
        params[TORCH_NOTE_KEY] = f"torch was asked for; {runtime} serves it{where}: {why}"
        cfg.instance_group[0].kind = mc.ModelInstanceGroup.KIND_CPU
    static = (src.card.cpu_static_shapes if static_shapes is None else static_shapes) and runtime != "torch"
    half = "bf16" if bf16 else "fp16" if precision == "fp16" and asked == "torch" else None
    if half is not None and runtime != "torch" and asked == "torch":  # no PyTorch module: its graph, in FP32
        params[TORCH_NOTE_KEY] += f" (in FP32: {half} is the torch runtime's, behind the card's fp16 gate)"
        half = None
    if bf16 and asked != "torch" and runtime != "openvino":
        raise RepositoryError(f"{src.name}: bf16 maths is an OpenVINO or torch setting, not one of {runtime}")
    params |= {"cpu_runtime": runtime, "static_shapes": "1" if static else "0", "inference_precision": half or "f32",
               "input_defaults": json.dumps(defaults)}
    if runtime == "torch" and torch_gpu:
        # the inputs where Triton holds them (on the GPU when a client or model put them there): DLPack in
        params["FORCE_CPU_ONLY_INPUT_TENSORS"] = "no"
        if cfg.HasField("dynamic_batching"):  # batching
            cfg.dynamic_batching.preferred_batch_size.extend(
                sorted({b for b in TORCH_PREFERRED_BATCH if b <= cfg.max_batch_size} | {cfg.max_batch_size}))
    if runtime == "aotinductor":
        params["aoti_package"] = AOTI_PACKAGE
    return params


def _gpu_params(src: Source, cfg: mc.ModelConfig) -> dict[str, str]:
    """A GPU platform's parameters: the TensorRT profile served (the plan's, else the card's); without a plan, ONNX
    Runtime's TensorRT accelerator on that profile goes into ``cfg``."""
    profile = src.profile if src.profile is not None else card_profile(src, cfg)
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
    return {PROFILE_KEY: profile.to_json()}


def _stand_in(src: Source, cfg: mc.ModelConfig) -> dict[str, str]:
    """Turn a GPU config into its test-only CPU stand-in (module doc): the Python backend on CPU instances in place of
    ONNX Runtime's TensorRT provider; returns the parameter that records the platform it stands in for."""
    if src.plan is not None:
        raise RepositoryError(f"{src.name}: the CPU stand-in replaces ONNX Runtime's TensorRT provider only; a "
                              f"TensorRT plan ({src.plan}) cannot be stood in for")
    params = {STAND_IN_KEY: cfg.platform}
    cfg.ClearField("platform")
    cfg.ClearField("optimization")
    cfg.backend = "python"
    cfg.instance_group[0].kind = mc.ModelInstanceGroup.KIND_CPU
    return params


def image_inputs(cfg: mc.ModelConfig) -> set[str]:
    """The encoded-image protocol's inputs in ``cfg`` (:mod:`unroll.serving.imaging.wire`; none in GPU configs)."""
    names = {i.name for i in cfg.input}
    return set(wire.INPUTS) & names if wire.IMAGE_BYTES in names else set()


def _image_protocol(src: Source, cfg: mc.ModelConfig, kind: str) -> None:
    """Add the encoded-image protocol to a CPU config (``serving/triton_backend_model.py``'s docstring):
    ``image_bytes`` (+ ``invert`` for classifiers, ``format`` for image-to-image graphs) as optional inputs,
    ``image_info`` (+ ``encoded``) as outputs (types: :data:`.wire.TYPES`); the card's float input (and σ, then
    estimated) become optional, since a request carries either the float tensor or the encoded image. Not for a
    graph with a tensor of one of the protocol's names (:data:`.wire.NAMES`)."""
    card = src.card
    alternatives = {card.input.name} | ({card.sigma.input} if kind == "image" and card.sigma is not None else set())
    for io in cfg.input:
        if io.name in alternatives:
            io.optional = True
    added = [wire.IMAGE_BYTES, wire.INVERT if kind == "predictions" else wire.FORMAT]
    for name in added:
        cfg.input.add(name=name, data_type=mc.DataType.Value(wire.TYPES[name]), dims=wire.DIMS[name], optional=True)
    for name in ([wire.ENCODED] if kind == "image" else []) + [wire.IMAGE_INFO]:
        cfg.output.add(name=name, data_type=mc.DataType.Value(wire.TYPES[name]), dims=wire.DIMS[name])


def _graph_io(src: Source) -> list[Tensor]:
    inputs, outputs = onnx_io(src.onnx)
    return inputs + outputs


def _header(src: Source, target: Target, precision: str, cfg: mc.ModelConfig, cpu_stand_in: bool = False) -> str:
    python = cfg.backend == "python" and not cpu_stand_in  # our model.py, not a GPU platform (or its stand-in)
    ngc = target == "gpu" and not python
    asked = " --runtime torch" if target == "gpu" and python else ""
    lines = [f"Generated by `unroll repo --target {target}{asked} --precision {precision}` from {src.onnx.name}"
             + (f" and {src.plan.name}" if src.plan else "") + "; regenerate instead of editing."]
    if target == "gpu" and python and cfg.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU:
        half = cfg.parameters["inference_precision"].string_value
        lines.append("The bundled Triton on a CUDA machine: the Python backend runs the model's PyTorch module on the "
                     "instance's GPU (serving/torch_runtime.py: the registered module with the weights this graph "
                     "was exported from, checked against the graph at load; inputs and outputs by DLPack; CUDA "
                     "graphs captured at load for the preferred batch sizes, a smaller batch padded up to the next).")
        if half in ("fp16", "bf16"):
            lines.append(f"inference_precision {half}: the module in {half} only if it passes the card's fp16 gate "
                         "on its gate data at load, on the instance's GPU; otherwise it serves FP32 and Triton's log "
                         "says why.")
    if cpu_stand_in:
        lines.append("TEST-ONLY CPU STAND-IN (write_repository(cpu_stand_in=True)): the GPU config with the Python "
                     "backend running this graph with ONNX Runtime on the CPU, refusing inputs outside "
                     f"{PROFILE_KEY} as TensorRT would. Never deploy it.")
    if TORCH_NOTE_KEY in cfg.parameters:
        lines.append(cfg.parameters[TORCH_NOTE_KEY].string_value)
    lines += ["dims exclude the batch dimension (-1 = dynamic); a [B] graph tensor is dims [1] + reshape [] "
              "(clients send it as [B, 1]).",
              "max_queue_delay_microseconds and max_batch_size: defaults explained in serving/repository.py "
              "(re-measure with `unroll bench serve`).",
              "model_warmup runs before the model reports ready."]
    clash = sorted({i.name for i in _graph_io(src)} & set(wire.NAMES))
    if clash and python and prepare.protocol_kind(src.card) is not None:
        lines.append(f"No encoded-image inputs: the graph's {', '.join(clash)} take the protocol's names "
                     f"({', '.join(wire.NAMES)}).")
    if image_inputs(cfg):
        lines.append(f"{wire.IMAGE_BYTES}: encoded images (PNG/JPEG/WebP/TIFF/BMP, one per batch item) instead of "
                     f"{src.card.input.name}, decoded and fitted to the card in the model; outputs "
                     f"{', '.join(o.name for o in cfg.output if o.name in wire.OUTPUTS)} (protocol: "
                     "serving/triton_backend_model.py docstring).")
    if src.card.lam is not None:
        lines.append("lam is optional (default = the trained λ) in the Python backend only: TensorRT and ONNX Runtime "
                     "cannot default a missing input, so there the gateway always sends lam." if python
                     else "lam is required here (Triton's TensorRT/ONNX Runtime backends cannot default a missing "
                     "input); the gateway always sends it: the card's default when a request gives none.")
    if ngc:
        lines.append(f"{PROFILE_KEY}: the TensorRT optimization profile served (per input min/opt/max, batch "
                     f"first; from {src.profile.source if src.profile else 'the card trt_profile'}). The engine "
                     "covers nothing outside it: the gateway answers 413/422 for images outside it and splits "
                     "batches at its max batch.")
    if ngc and src.plan is None:
        what = {"fp32": "FP32 tensors", "fp16": "FP16 tensors written by `unroll quantize`",
                "int8": "explicit Q/DQ written by `unroll quantize`; no calibration table"}[precision]
        lines.append(f"Precision lives in the graph: model.onnx is {src.onnx.name} ({what}); precision_mode FP32 sets "
                     "neither trt_fp16_enable nor trt_int8_enable, so ONNX Runtime's TensorRT provider builds a "
                     "strongly typed network that runs the graph's own precision (TensorRT is not asked to cast; weak "
                     "typing is removed in TensorRT 11). Needs ONNX Runtime built against TensorRT >= 10 (sources: "
                     "serving/repository.py docstring).")
        lines.append("The accelerator's trt_profile_*_shapes are the same profile; the engine built at load "
                     "covers only that range, so widen the card's trt_profile and regenerate for larger inputs.")
    if ngc and src.plan is not None:
        lines.append(f"The plan was built strongly typed from {src.onnx.name}; {PLAN_JSON} is its JSON "
                     f"({artifacts.plan_json(src.plan).name}): passed gate, profile, I/O, checksums, re-checked "
                     "by `unroll repo`/`unroll triton` validation.")
    return "".join(f"# {ln}\n" for ln in lines)


def repository_inputs(name: str, target: Target, precision: str = "fp32", onnx_dir: Path = artifacts.ONNX_DIR,
                      plan_dir: Path = artifacts.TRT_DIR, threads: int = 2, max_batch_size: int | None = None,
                      queue_delay_us: int = DEFAULT_QUEUE_DELAY_US, instances: int = 1, cpu_stand_in: bool = False,
                      spinning: bool = INTRA_OP_SPINNING, runtime: str | None = None,
                      static_shapes: bool | None = None, aoti_dir: Path = artifacts.AOTI_DIR,
                      bf16: bool = False) -> dict[str, str | None]:
    """What ``out/NAME`` is written from, as hashes (:func:`unroll.artifacts.built_from`): the served graph, the
    FP32 graph whose card and report it takes, the plan (GPU, when there is one), the Python backend's model.py
    (CPU and stand-ins) and the options. Recorded beside its config.pbtxt; :mod:`unroll.pipeline` compares it."""
    def present(path: Path) -> Path | None:
        return path if path.exists() else None

    bundled = bundled_gpu(target, runtime)
    plan = present(artifacts.plan(name, precision, plan_dir)) if target == "gpu" and not bundled else None
    python = target == "cpu" or cpu_stand_in or bundled
    served = "fp32" if runtime == "torch" else precision  # the torch runtime's precision is the module's
    return artifacts.built_from(
        upstream=present(artifacts.graph(name, served, onnx_dir)),
        fp32=present(artifacts.graph(name, onnx_dir=onnx_dir)),
        export_report=present(artifacts.graph_report(name, onnx_dir=onnx_dir)),
        plan=plan, backend=BACKEND_MODEL if python else None,
        package=present(artifacts.aoti_package(name, aoti_dir)) if runtime == "aotinductor" else None,
        options={"target": target, "precision": precision, "threads": threads, "max_batch_size": max_batch_size,
                 "queue_delay_us": queue_delay_us, "instances": instances, "cpu_stand_in": cpu_stand_in,
                 "spinning": spinning, "runtime": runtime, "static_shapes": static_shapes, "bf16": bf16})


def write_repository(target: Target, models: list[str], out: Path, precision: str = "fp32",
                     onnx_dir: Path = artifacts.ONNX_DIR, plan_dir: Path = artifacts.TRT_DIR, threads: int = 2,
                     max_batch_size: int | None = None, queue_delay_us: int = DEFAULT_QUEUE_DELAY_US,
                     instances: int = 1, cpu_stand_in: bool = False, spinning: bool = INTRA_OP_SPINNING,
                     runtime: str | None = None, static_shapes: bool | None = None,
                     aoti_dir: Path = artifacts.AOTI_DIR, bf16: bool = False) -> list[Path]:
    """Write ``out/<model>/config.pbtxt`` + ``out/<model>/1/…`` (+ ``labels.txt``) for each model; validate.

    ``models`` are ONNX file stems in ``onnx_dir`` (a model's name; its λ-rule companion is a model of its
    own, named on its card). ``max_batch_size=None`` takes :func:`default_max_batch_size` per model; an int applies
    to every model. Each model directory is rebuilt from scratch (so switching targets leaves no stale
    ``model.py`` or plan), other directories in ``out`` are left alone. Returns the files written.

    ``cpu_stand_in`` (TEST-ONLY, ``target="gpu"`` only): the GPU configs with the Python backend running the same
    graph with ONNX Runtime on the CPU, so the bundled Triton can load them; it refuses inputs outside the profile, as
    TensorRT does. Never deploy a stand-in: it is not what the GPU runs.

    ``runtime`` / ``static_shapes``: the CPU runtime and its shape mode for every model (default: each card's);
    ``aotinductor`` serves ``aoti_dir/NAME.pt2`` (``unroll optimize`` builds it); ``bf16``: OpenVINO's bfloat16 maths.
    ``target="gpu", runtime="torch"``: the bundled Triton on a CUDA machine (``KIND_GPU`` Python-backend instances
    running the model's PyTorch module, :mod:`unroll.serving.torch_runtime`); a model without one is served on the
    CPU by its card's runtime, and its config says why (``unroll.runtime_note``). The torch runtime's precision is
    the module's (:data:`TORCH_PRECISIONS`; ``bf16`` too, on either target): half precision behind the card's fp16
    gate at load, from the FP32 graph (no ``NAME.fp16.onnx`` is needed).
    """
    _check_options(target, precision, threads, max_batch_size, queue_delay_us, instances, cpu_stand_in, runtime, bf16)
    if not models:
        raise RepositoryError("no models given")
    plans = target == "gpu" and not bundled_gpu(target, runtime)  # TensorRT plans: the NGC container's only
    served = "fp32" if runtime == "torch" else precision  # the torch runtime casts the module itself (behind a gate)
    sources = [_source(m, target, served, Path(onnx_dir), Path(plan_dir), plans) for m in dict.fromkeys(models)]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for src in sources:
        cfg, labels = build_config(src, target, precision, threads, max_batch_size, queue_delay_us, instances,
                                   cpu_stand_in, spinning, runtime=runtime, static_shapes=static_shapes, bf16=bf16)
        tmp = out / f".{src.name}.tmp"
        files = _write_model_dir(tmp, src, cfg, labels, _header(src, target, precision, cfg, cpu_stand_in),
                                 Path(aoti_dir))
        inputs = repository_inputs(src.name, target, precision, Path(onnx_dir), Path(plan_dir), threads,
                                   max_batch_size, queue_delay_us, instances, cpu_stand_in, spinning, runtime,
                                   static_shapes, Path(aoti_dir), bf16)
        record = {artifacts.BUILT_FROM_KEY: inputs, "files": {f: artifacts.sha256(tmp / f) for f in files}}
        (tmp / artifacts.REPOSITORY_SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
        dst = out / src.name
        if dst.exists():
            shutil.rmtree(dst)
        tmp.rename(dst)
        written += [dst / f for f in files]
    return written


def _check_options(target: Target, precision: str, threads: int, max_batch_size: int | None, queue_delay_us: int,
                   instances: int, cpu_stand_in: bool, runtime: str | None, bf16: bool) -> None:
    """Refuse :func:`write_repository` options that cannot go together, each with what to ask for instead."""
    if target not in ("cpu", "gpu"):
        raise RepositoryError(f"target must be cpu or gpu, not {target!r}")
    if precision not in PRECISIONS:
        raise RepositoryError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if (max_batch_size is not None and max_batch_size < 1) or queue_delay_us < 0 or threads < 1 or instances < 1:
        raise RepositoryError("max_batch_size, threads and instances must be ≥ 1 and queue_delay_us ≥ 0")
    if cpu_stand_in and target != "gpu":
        raise RepositoryError("cpu_stand_in stands in for GPU configs: use it with target='gpu'")
    if target == "gpu" and runtime is not None and not bundled_gpu(target, runtime):
        raise RepositoryError(f"runtime {runtime!r} is a CPU runtime; on a GPU: torch (the bundled Triton), or none "
                              "for the NGC container's TensorRT / ONNX Runtime configs")
    if runtime == "torch" and cpu_stand_in:
        raise RepositoryError("the torch runtime's GPU configs have no CPU stand-in: write them for the CPU (target "
                              "cpu, runtime torch) to run the same model.py there")
    if runtime == "torch" and (precision not in TORCH_PRECISIONS or (precision == "fp16" and target != "gpu")
                               or (bf16 and precision != "fp32")):
        raise RepositoryError(f"the torch runtime runs the model's PyTorch module in FP32, or in half precision behind "
                              f"the card's fp16 gate: --precision fp16 on a GPU, or bf16 (not --precision {precision}"
                              f"{' with bf16' if bf16 else ''} on the {target} target)")


def _write_model_dir(tmp: Path, src: Source, cfg: mc.ModelConfig, labels: list[str] | None, header: str,
                     aoti_dir: Path) -> dict[str, None]:
    """Write one model's directory afresh at ``tmp`` (config, labels, the graph or plan, model.py, the AOTInductor
    package) and validate it against its graph, removing it if that fails; the files written, relative to it."""
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / VERSION).mkdir(parents=True)
    files = {artifacts.TRITON_CONFIG: None}
    artifacts.model_config(tmp).write_text(header + text_format.MessageToString(cfg))
    if labels is not None:
        (tmp / LABELS_FILE).write_text("\n".join(labels) + "\n")
        files[LABELS_FILE] = None
    if src.plan is not None:
        shutil.copyfile(src.plan, tmp / VERSION / "model.plan")
        shutil.copyfile(artifacts.plan_json(src.plan), tmp / PLAN_JSON)
        files[f"{VERSION}/model.plan"] = files[PLAN_JSON] = None
    else:
        shutil.copyfile(src.onnx, tmp / VERSION / "model.onnx")
        files[f"{VERSION}/model.onnx"] = None
    if cfg.backend == "python":
        shutil.copyfile(BACKEND_MODEL, tmp / VERSION / "model.py")
        files[f"{VERSION}/model.py"] = None
    if "aoti_package" in cfg.parameters:
        files |= _copy_package(src.name, aoti_dir, tmp / VERSION)
    try:
        validate_model(tmp, reference_onnx=src.onnx, name=src.name)
    except RepositoryError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return files


def _copy_package(name: str, aoti_dir: Path, version_dir: Path) -> dict[str, None]:
    """Copy ``NAME.pt2`` and its sidecar into a version directory; the files written, relative to the model's."""
    package = artifacts.aoti_package(name, aoti_dir)
    sidecar = package.with_suffix(".json")
    if not package.exists() or not sidecar.exists():
        raise RepositoryError(f"{name}: runtime aotinductor needs {package} and {sidecar.name}; run `unroll optimize "
                              f"{name}` (it builds the package) or serve another runtime")
    shutil.copyfile(package, version_dir / AOTI_PACKAGE)
    shutil.copyfile(sidecar, version_dir / Path(AOTI_PACKAGE).with_suffix(".json"))
    return {f"{VERSION}/{AOTI_PACKAGE}": None, f"{VERSION}/{Path(AOTI_PACKAGE).with_suffix('.json')}": None}
