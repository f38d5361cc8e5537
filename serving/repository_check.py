"""Reading and validating a Triton model repository that ``unroll repo`` wrote.

Every config is re-parsed with Triton's ``model_config`` schema and checked tensor by tensor against its ONNX graph
(name, type, dims, reshape); on the GPU target also the served TensorRT profile (``unroll.profile``) against the
graph, ``max_batch_size`` and the warm-ups, and a plan against the JSON ``unroll build`` wrote beside it (passed
gate, profile, I/O, checksums). The writer (:mod:`unroll.serving.repository`) runs the same checks on what it wrote.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import onnx
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from unroll import artifacts
from unroll.errors import ProfileError, RepositoryError
from unroll.serving.imaging import wire
from unroll.serving.profile import PROFILE_KEY, ServedProfile, from_plan_profile

#: The plan's JSON (``unroll build``), copied beside config.pbtxt so validation can re-check the plan.
PLAN_JSON = "trt_plan.json"
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


@dataclass(frozen=True)
class Tensor:
    """One graph input/output: Triton type and full dims (batch included, -1 where dynamic)."""

    name: str
    data_type: str
    dims: tuple[int, ...]


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


def load_json(path: Path, name: str) -> dict:
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
    path = artifacts.plan_json(plan)
    rebuild = f"rebuild with `unroll build {name} --precision {precision}`"
    if not path.exists():
        raise RepositoryError(f"{name}: {plan} has no {path.name} beside it (unroll build writes both; without it "
                              f"the plan's profile and parity gate are unknown); {rebuild}")
    rep = load_json(path, name)
    errors = []
    if rep.get("passed") is not True:
        errors.append(f"it says passed: {rep.get('passed')!r} (the engine's parity gate against ONNX Runtime FP32 "
                      f"did not pass: {'; '.join(rep.get('failures') or []) or 'no details'})")
    if rep.get("precision") not in (None, precision):
        errors.append(f"it describes a {rep.get('precision')} engine, not {precision}")
    if rep.get("onnx_sha256") and rep["onnx_sha256"] != artifacts.sha256(graph):
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


def split_batch(t: Tensor, batching: bool) -> list[int]:
    return list(t.dims[1:]) if batching else list(t.dims)


def _graph_dims(inp) -> list[int]:
    """Per-sample graph dims of a config input (its ``reshape`` where it has one)."""
    return list(inp.reshape.shape) if inp.HasField("reshape") else list(inp.dims)


def ort_profile_params(profile: ServedProfile) -> dict[str, str]:
    """ONNX Runtime's ``trt_profile_{min,opt,max}_shapes`` strings (``name:AxBxC,…``) for ``profile``."""
    def fmt(which: str) -> str:
        return ",".join(f"{n}:{'x'.join(map(str, getattr(r, which)))}" for n, r in profile.inputs.items())

    return {f"trt_profile_{w}_shapes": fmt(w) for w in ("min", "opt", "max")}


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
    path = artifacts.model_config(model_dir)
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
    protocol = _image_protocol_errors(cfg, inputs + outputs)
    errors += protocol
    extra = set(wire.NAMES) if not protocol and cfg.backend == "python" else set()
    errors += _check_tensors("input", [i for i in cfg.input if i.name not in extra], inputs, batching, exact=True)
    errors += _check_tensors("output", [o for o in cfg.output if o.name not in extra], outputs, batching, exact=False)
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


def _image_protocol_errors(cfg: mc.ModelConfig, graph: list[Tensor]) -> list[str]:
    """The encoded-image protocol's tensors (:mod:`unroll.serving.imaging.wire`), where a config has them: Python
    backend only, the types and dims of :data:`.wire.TYPES` / :data:`.wire.DIMS`, optional inputs, no graph tensor
    of the same name."""
    names = {t.name for t in graph}
    extra = [io for io in [*cfg.input, *cfg.output] if io.name in wire.NAMES and io.name not in names]
    if not extra:
        return []
    errors = []
    if cfg.backend != "python":
        errors.append(f"{', '.join(repr(io.name) for io in extra)}: encoded images are decoded by the Python "
                      "backend's model only")
    if wire.IMAGE_BYTES not in {i.name for i in cfg.input}:
        errors.append(f"{', '.join(repr(io.name) for io in extra)} without the input {wire.IMAGE_BYTES!r}")
    for io in extra:
        if mc.DataType.Name(io.data_type) != wire.TYPES[io.name] or list(io.dims) != wire.DIMS[io.name]:
            errors.append(f"{io.name!r}: the encoded-image protocol has it {wire.TYPES[io.name]} dims "
                          f"{wire.DIMS[io.name]}")
        if isinstance(io, mc.ModelInput) and not io.optional:
            errors.append(f"input {io.name!r} must be optional (a request sends encoded images or float tensors)")
    return errors


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
    names = [i.name for i in cfg.input if i.name not in wire.INPUTS]
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
    if plan is not None and plan.exists() and rep.get("plan_sha256") and rep["plan_sha256"] != artifacts.sha256(plan):
        errors.append(f"{plan.name} is not the plan {PLAN_JSON} describes (sha256 differs)")
    if rep.get("onnx_sha256") and reference.exists() and rep["onnx_sha256"] != artifacts.sha256(reference):
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
        graph_dims = split_batch(t, batching)
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
            text_format.Parse((artifacts.model_config(model_dir)).read_text(), cfg)
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
