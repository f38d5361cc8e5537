"""``unroll build``: a TensorRT engine from the exported (and possibly quantized) ONNX, checked before it is kept.

Engines are built strongly typed from the graph of their precision (``NAME.onnx``, ``NAME.fp16.onnx``,
``NAME.int8.onnx``), because TensorRT 11 removed the FP16/INT8 builder flags. One optimization profile covers every
input, from the card's ``trt_profile`` unless overridden. Before TensorRT sees the graph it is linted and its GPU
memory estimated (:func:`preflight`); after the build the engine is run through the one accuracy gate
(:mod:`unroll.gates`) and the plan is kept only if it passes; the JSON beside it says what was checked.
TensorRT 10.x and 11.x share this code (:func:`_network_flags`).

This module builds the plan and writes its JSON; the profile (input axes, their ranges, :func:`profile_shapes`) is in
:mod:`unroll.trt_profile`, running and checking an engine in :mod:`.trt_engine`, the errors in :mod:`unroll.errors` (all
re-exported here, see ``__all__``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import onnx

from unroll import artifacts
from unroll import gates as gate
from unroll.card import ModelCard, from_onnx
from unroll.errors import (
    GateError,
    LintError,
    MissingOnnxError,
    ProfileMemoryError,
    TrtBuildError,
    TrtUnavailableError,
    UnknownDimError,
)
from unroll.export import trt_lint, trt_memory
from unroll.export.trt_engine import (
    ENGINE_DEVICE,
    EngineRunner,
    Progress,
    engine_gate_cases,
    parity_check,
    require_tensorrt,
    run_engine,
    tensorrt_available,
    trt_logger,
)
from unroll.trt_profile import (
    ProfileShapes,
    Range,
    axis_key,
    card_dim_ranges,
    dim_range_names,
    dynamic_axes,
    graph_inputs,
    has_dynamic_image,
    profile_shapes,
    resolve_dim_ranges,
)

__all__ = [
    "PRECISIONS", "EngineRunner", "GateError", "LintError", "MissingOnnxError", "Preflight", "ProfileMemoryError",
    "TrtBuildError", "TrtUnavailableError", "UnknownDimError", "axis_key", "build_engine", "card_dim_ranges",
    "dim_range_names", "dynamic_axes", "engine_gate_cases", "graph_inputs", "has_dynamic_image", "lint_graph",
    "parity_check", "preflight", "profile_shapes", "read_card", "read_report", "resolve_dim_ranges",
    "run_engine", "tensorrt_available",
]

PRECISIONS = ("fp32", "fp16", "int8")
MAX_OPT_LEVEL = 5  # TensorRT's builder optimization levels are 0…5 (3 is its default)



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


# --------------------------------------------------------------------------------------------- profiles


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")


def read_card(path: Path) -> ModelCard:
    """The card of the ONNX being built (a graph without one is an error saying how to get one)."""
    try:
        return from_onnx(path)
    except ValueError as e:
        raise TrtBuildError(str(e)) from None


# --------------------------------------------------------------------------------------------- build


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
    _check_precision(precision)
    src, ref = artifacts.graph(name, precision, onnx_dir), artifacts.graph(name, "fp32", onnx_dir)
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


def build_engine(name: str, precision: str = "fp32", onnx_dir: Path = artifacts.ONNX_DIR,
                 out_dir: Path = artifacts.TRT_DIR, batch: Range | None = None,
                 image_sizes: tuple[tuple[int, int], tuple[int, int], tuple[int, int]] | None = None,
                 workspace_gib: float = 4.0, opt_level: int = 3,
                 timing_cache: Path | None = artifacts.TIMING_CACHE, verify: bool = True,
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

    trt = require_tensorrt()
    say("parsing ONNX")
    logger = trt_logger(trt)
    builder = trt.Builder(logger)
    network, _parser = _parse(trt, builder, logger, src, list(profile))  # the network keeps its parser alive
    config, cache_note = _builder_config(trt, builder, profile, workspace_gib, opt_level, tf32, timing_cache)
    say(f"building the {precision} engine (TensorRT is timing kernels; this can take minutes)")
    t0 = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    build_s = time.perf_counter() - t0
    if plan is None:
        raise TrtBuildError(f"TensorRT could not build the {precision} engine for {name}: "
                            + ("; ".join(logger.errors[-3:]) or "see the builder messages above"))
    blob = bytes(plan)
    if timing_cache is not None:
        Path(timing_cache).parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(Path(timing_cache), bytes(config.get_timing_cache().serialize()))

    out_dir.mkdir(parents=True, exist_ok=True)
    plan_path = artifacts.plan(name, precision, out_dir)
    json_path = artifacts.plan_report(name, precision, out_dir)
    tmp_plan = plan_path.with_name(f".{plan_path.name}.partial")
    tmp_plan.write_bytes(blob)
    report = _plan_report(trt, name, precision, src, plan_path, blob, card, checked, batch[2],
                          {"workspace_gib": workspace_gib, "optimization_level": opt_level, "tf32": tf32,
                           "timing_cache": {"path": None if timing_cache is None else str(timing_cache),
                                            "status": cache_note}}, build_s)
    runner = EngineRunner(blob, ENGINE_DEVICE)
    report["io"] = runner.io_info()
    failures = _verify(report, runner, ref, card, profile, batch[0], tolerances, say) if verify else []
    if not verify:
        report["parity"] = None
        report["gate"] = "skipped (verify=False)"
    _finish(tmp_plan, plan_path, json_path, report, failures)
    return report


def _parse(trt: Any, builder: Any, logger: Any, src: Path, input_names: list[str]) -> tuple[Any, Any]:
    """The strongly typed network TensorRT's ONNX parser makes of ``src``, and the parser; a parse error names
    each failing node, and the network must have the graph's inputs."""
    network = builder.create_network(_network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(src)):
        rows = _parser_errors(parser)
        raise TrtBuildError(f"TensorRT's ONNX parser rejected {src} with {len(rows)} error(s):\n  "
                            + "\n  ".join(rows or ["(no details)"]))
    net_inputs = [network.get_input(i).name for i in range(network.num_inputs)]
    if sorted(net_inputs) != sorted(input_names):
        raise TrtBuildError(f"TensorRT sees inputs {net_inputs} but the ONNX declares {input_names}")
    return network, parser


def _builder_config(trt: Any, builder: Any, profile: ProfileShapes, workspace_gib: float, opt_level: int,
                    tf32: bool, timing_cache: Path | None) -> tuple[Any, str]:
    """The builder config: workspace, optimization level, TF32 off unless asked, the one optimization profile and
    the timing cache; with what became of the cache (``disabled``, loaded, new)."""
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
        _, cache_note = _load_timing_cache(config, Path(timing_cache))
    return config, cache_note


def _plan_report(trt: Any, name: str, precision: str, src: Path, plan_path: Path, blob: bytes, card: ModelCard,
                 checked: Preflight, max_batch: int, builder: dict, build_s: float) -> dict[str, Any]:
    """The JSON beside the plan, before the engine is checked: what was built from what, where and how."""
    import torch  # here, not at the top: a machine without torch must still be told why it cannot build

    dev = torch.cuda.current_device()
    cc = torch.cuda.get_device_capability(dev)
    return {
        "model": name, "task": card.task, "precision": precision,
        "onnx": str(src), "onnx_sha256": artifacts.sha256(src),
        "plan": str(plan_path), "plan_bytes": len(blob), "plan_sha256": artifacts.sha256_bytes(blob),
        "tensorrt": str(trt.__version__),
        "network": "strongly typed" + (" (always, TensorRT 11)" if _trt_major(trt) >= 11 else " (STRONGLY_TYPED)"),
        "gpu": {"name": torch.cuda.get_device_name(dev), "compute_capability": f"{cc[0]}.{cc[1]}"},
        "cuda": torch.version.cuda, "torch": torch.__version__,
        "builder": builder,
        "profiles": [{n: {"min": list(lo), "opt": list(mid), "max": list(hi)}
                      for n, (lo, mid, hi) in checked.profile.items()}],
        "max_batch_size": max_batch,
        **checked.report(),
        "build_seconds": round(build_s, 2),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "card": card.model_dump(mode="json"),
    }


def _verify(report: dict, runner: EngineRunner, ref: Path, card: ModelCard, profile: ProfileShapes, bmin: int,
            tolerances: dict, say: Progress) -> list[str]:
    """Run the engine on the card's gate data against ONNX Runtime FP32; record it in ``report``; the failures."""
    say("checking the engine against ONNX Runtime FP32")
    cases, report["gate_data"] = engine_gate_cases(card, profile)
    report["parity"] = parity_check(runner, ref, card, cases, bmin, say)
    report["gate"] = tolerances
    unchecked = gate.unmeasured(report["parity"], tolerances)
    if unchecked:
        report["gate_unmeasured"] = unchecked
    return gate.failures(report["parity"], tolerances)


def read_report(name: str, precision: str, out_dir: Path = artifacts.TRT_DIR) -> dict | None:
    """The JSON written beside a plan, or None."""
    path = artifacts.plan_report(name, precision, out_dir)
    return json.loads(path.read_text()) if path.exists() else None
