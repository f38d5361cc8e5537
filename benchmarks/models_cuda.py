"""``unroll bench models --device cuda``: PyTorch eager and torch.compile on the GPU vs ONNX Runtime's CUDA provider,
FP32/FP16 at batch 1 and 64, plus the FP16/INT8 accuracy gates evaluated with the candidate on the GPU. Which
rows run is decided up front (:func:`cuda_plan`, from a real probe of this machine: :func:`cuda_environment`),
and every row that does not run says why. ``device="cpu"`` runs the very same code on the CPU: a dry run of
the plumbing for the tests on machines without a GPU, never written as GPU results by the command line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch

import unroll
from unroll import artifacts, tasks
from unroll import gates as gate
from unroll import machine as probes
from unroll.benchmarks.common import machine_info, progress_bars, quantizable, time_call, write_results
from unroll.benchmarks.models_inputs import (
    CUDA_PRECISIONS,
    QUANTIZED,
    case_inputs,
    ensure_export,
    lam_default,
    noisy_image,
    prepare_run,
    quant_report,
    quantized_graphs,
    torch_call,
)
from unroll.benchmarks.models_markdown import markdown_cuda
from unroll.card import from_onnx
from unroll.errors import BenchError, NoCuda, NothingMeasured
from unroll.registry import get_spec

CUDA_BATCHES = (1, 64)


#: Denoisers take a batch of this side² crops of their card's test image (their "batch" axis is real images).
CUDA_DENOISE_SIDE = 256


CUDA_QUICK = {"batches": (1, 4), "denoise_side": 64, "budget_s": 0.2}


#: ONNX Runtime's IOBinding element types for the graph input types it reports.
_ORT_TORCH_DTYPES = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16, "tensor(int64)": torch.int64,
                     "tensor(int32)": torch.int32, "tensor(bool)": torch.bool}


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.int32: np.int32,
                 torch.bool: np.bool_}


@dataclass(frozen=True)
class CudaEnv:
    """What a CUDA run can use on this machine, from a real probe (:func:`cuda_environment`)."""

    #: torch device type the rows run on: ``cuda`` (``cpu`` only for the tests' dry run).
    device: str
    #: Why nothing can run (no CUDA), else ``None``.
    reason: str | None
    #: ONNX Runtime provider of the ``onnxruntime`` rows and the gates' candidates, and why not usable (or ``None``).
    ort_provider: str
    ort_reason: str | None
    #: Why torch.compile cannot run here (or ``None``).
    compile_reason: str | None
    #: GPU name, memory, compute capability, driver, CUDA, cuDNN, torch and ONNX Runtime versions.
    machine: dict = field(default_factory=dict)

    @property
    def ort_runtime(self) -> str:
        return f"onnxruntime {self.device}"

    @property
    def gate_runtime(self) -> str:
        return f"gate: onnxruntime {self.device} vs cpu fp32"


@dataclass(frozen=True)
class PlanRow:
    """One measurement: ``batch`` is ``None`` for a gate (it runs on the card's whole gate data)."""

    model: str
    runtime: str
    precision: str
    batch: int | None


@dataclass
class CudaPlan:
    rows: list[PlanRow]
    skipped: list[tuple[PlanRow, str]]

    def reasons(self) -> dict[str, list[PlanRow]]:
        """The skipped rows grouped by reason."""
        out: dict[str, list[PlanRow]] = {}
        for row, why in self.skipped:
            out.setdefault(why, []).append(row)
        return out


def cuda_environment(device: str = "cuda") -> CudaEnv:
    """Probe this machine for a CUDA run (the probes ``unroll doctor`` runs): CUDA through PyTorch with a kernel
    that really runs, ONNX Runtime's CUDA provider with a session that really takes it, torch.compile's Triton."""
    if device == "cpu":
        ort_c = probes.guarded("ort-cpu", lambda: probes.probe_ort_provider("CPUExecutionProvider"))
        return CudaEnv("cpu", None, "CPUExecutionProvider", None if ort_c.ok else ort_c.summary, None,
                       {"device": "cpu (dry run of the CUDA benchmark's code)"})
    if device != "cuda":
        raise ValueError(f"device must be cuda (or cpu for a dry run), not {device!r}")
    cuda = probes.guarded("cuda", probes.probe_cuda)
    if not cuda.ok:
        return CudaEnv("cuda", f"no usable CUDA here ({cuda.summary})", probes.CUDA_EP, None, None)
    ort_c = probes.guarded("ort-cuda", lambda: probes.probe_ort_provider(probes.CUDA_EP))
    tc = cuda.facts.get("torch_compile") or {}
    smi, drv = probes.guarded("nvidia-smi", probes.check_nvidia_smi), probes.guarded("driver", probes.probe_driver)
    dev = cuda.facts["devices"][0]
    gpus = smi.facts.get("gpus") or []
    import onnxruntime as ort

    machine = {"gpu": dev["name"], "gpu_memory_gib": dev["memory_gib"], "compute_capability": dev["compute_capability"],
               "gpu_count": len(cuda.facts["devices"]),
               "driver": (gpus[0]["driver_version"] if gpus else None) or drv.facts.get("kernel_module"),
               "cuda_driver_api": drv.facts.get("cuda_driver_api"), "cuda_runtime": cuda.facts["runtime"],
               "cudnn": cuda.facts.get("cudnn"), "torch": torch.__version__, "onnxruntime": ort.__version__,
               "onnxruntime_wheels": probes.ort_distributions(), "ort_providers": ort.get_available_providers(),
               "triton_for_torch_compile": tc.get("triton")}
    return CudaEnv("cuda", None, probes.CUDA_EP, None if ort_c.ok else ort_c.summary,
                   None if tc.get("ok") else tc.get("reason", "torch.compile's GPU backend was not checked"), machine)


def cuda_batches(quick: bool = False) -> tuple[int, ...]:
    return CUDA_QUICK["batches"] if quick else CUDA_BATCHES


def _graph_reason(name: str, precision: str, onnx_dir: Path) -> str | None:
    """Why the ONNX Runtime ``precision`` graph of ``name`` cannot be measured (FP32 is exported on demand)."""
    if precision == "fp32":
        return None
    why = quantized_graphs(name, onnx_dir)[1].get(precision)
    if why is None:
        return None
    if quantizable(name):
        return f"{why} (unroll quantize {name} --precision {precision})"
    return f"{why}: its card names no calibration/gate data for unroll quantize"


def cuda_plan(models: list[str], env: CudaEnv, onnx_dir: Path, quick: bool = False,
              with_compile: bool = True) -> CudaPlan:
    """Every (model, runtime, precision, batch) a CUDA run measures, and the ones it skips with the reason.

    Runtimes: ``pytorch eager`` and ``torch.compile`` (FP16: under ``torch.autocast``), ONNX Runtime on the
    provider of ``env`` (the FP32 graph, and the FP16 graph ``unroll quantize`` wrote), at each of
    :func:`cuda_batches`; then the FP16/INT8 gates of the quantizable models (``batch`` ``None``).
    """
    onnx_dir = Path(onnx_dir)
    rows: list[PlanRow] = []
    skipped: list[tuple[PlanRow, str]] = []

    def add(row: PlanRow, why: str | None) -> None:
        why = env.reason or why
        (skipped.append((row, why)) if why else rows.append(row))

    for name in models:
        for batch in cuda_batches(quick):
            for p in CUDA_PRECISIONS:
                add(PlanRow(name, "pytorch eager", p, batch), None)
            for p in CUDA_PRECISIONS:
                add(PlanRow(name, "torch.compile", p, batch),
                    None if with_compile and env.compile_reason is None
                    else "--no-compile" if not with_compile else env.compile_reason)
            for p in CUDA_PRECISIONS:
                add(PlanRow(name, env.ort_runtime, p, batch), env.ort_reason or _graph_reason(name, p, onnx_dir))
        if quantizable(name):
            for p in QUANTIZED:
                add(PlanRow(name, env.gate_runtime, p, None), env.ort_reason or _graph_reason(name, p, onnx_dir))
    return CudaPlan(rows, skipped)


def cuda_inputs(name: str, batch: int, lam: float | None, quick: bool = False) -> dict[str, torch.Tensor]:
    """Graph-named inputs of ``batch`` samples: :func:`case_inputs`, and for denoisers ``batch`` noisy crops."""
    if tasks.get(get_spec(name).task).data == "noisy":
        one = noisy_image(name, CUDA_QUICK["denoise_side"] if quick else CUDA_DENOISE_SIDE)
        return {k: v.expand(batch, *v.shape[1:]).contiguous() for k, v in one.items()}
    return case_inputs(name, batch, lam)


def cuda_case(name: str, batch: int, quick: bool = False) -> str:
    if tasks.get(get_spec(name).task).data == "noisy":
        side = CUDA_QUICK["denoise_side"] if quick else CUDA_DENOISE_SIDE
        return f"batch {batch} × {side}×{side}"
    return f"batch {batch}"


def device_session(path: Path, env: CudaEnv, threads: int = 2):
    """An ONNX Runtime session on ``env.ort_provider``; an error when ONNX Runtime did not take the provider."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    providers = list(dict.fromkeys([env.ort_provider, "CPUExecutionProvider"]))
    sess = ort.InferenceSession(str(path), so, providers=providers)
    if sess.get_providers()[0] != env.ort_provider:
        raise BenchError(f"ONNX Runtime did not take {env.ort_provider} for {path.name} "
                           f"(session providers: {', '.join(sess.get_providers())})")
    return sess


def _bound_call(sess, feeds: dict[str, torch.Tensor], device: torch.device) -> Callable[[], object]:
    """One ``run_with_iobinding`` on inputs already on ``device``, outputs left there (no host copies timed)."""
    binding = sess.io_binding()
    kind, index = device.type, device.index or 0
    keep = []
    for i in sess.get_inputs():
        if i.name not in feeds:
            raise KeyError(f"the graph input {i.name!r} has no benchmark input (have: {', '.join(feeds)})")
        t = feeds[i.name].to(device=device, dtype=_ORT_TORCH_DTYPES.get(i.type, torch.float32)).contiguous()
        keep.append(t)
        binding.bind_input(i.name, kind, index, _NUMPY_DTYPES[t.dtype], tuple(t.shape), t.data_ptr())
    for o in sess.get_outputs():
        binding.bind_output(o.name, kind, index)

    def call() -> object:
        sess.run_with_iobinding(binding)
        return keep  # keeps the bound input buffers alive as long as the call

    return call


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _measure_rows(name: str, rows: list[PlanRow], env: CudaEnv, onnx_dir: Path, budget_s: float, quick: bool,
                  threads: int, status: Callable[[str], None]) -> tuple[list[dict], list[dict]]:
    """Time one model's planned rows; a row that fails (out of memory, an op the provider lacks) is skipped."""
    spec = get_spec(name)
    device = torch.device(env.device)
    sync = _sync(device)
    measured: list[dict] = []
    failed: list[dict] = []
    model = unroll.load(name, pretrained=spec.has_weights).to(device).eval()
    lam = lam_default(name, onnx_dir)
    compiled = None
    sessions: dict[str, object] = {}
    for batch in sorted({r.batch for r in rows if r.batch is not None}):
        feeds = {k: v.to(device) for k, v in cuda_inputs(name, batch, lam, quick).items()}
        sync()
        eager_ms = None
        for r in [r for r in rows if r.batch == batch]:
            status(f"{name} {cuda_case(name, batch, quick)}: {r.runtime} {r.precision}")
            try:
                with torch.inference_mode():
                    if r.runtime in ("pytorch eager", "torch.compile"):
                        if r.runtime == "torch.compile" and compiled is None:
                            compiled = torch.compile(model, dynamic=False)
                        base = torch_call(compiled if r.runtime == "torch.compile" else model, name, feeds)
                        fn = base if r.precision == "fp32" else partial(_autocast, base, device)
                    else:
                        if r.precision not in sessions:
                            graph = artifacts.graph(name, r.precision, onnx_dir)
                            sessions[r.precision] = device_session(graph, env, threads)
                        fn = _bound_call(sessions[r.precision], feeds, device)
                        sync()  # the bound inputs are written (ONNX Runtime computes on a stream of its own)

                    def timed(fn=fn) -> None:
                        fn()
                        sync()

                    timed()  # first call: compilation, cuDNN algorithm search, allocations
                    t = time_call(timed, warmup=1 if quick else 3, min_repeats=3, max_repeats=500, budget_s=budget_s)
            except Exception as e:
                failed.append({**asdict(r), "reason": f"failed: {type(e).__name__}: {_first(e)}"})
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            row = {**asdict(r), "model": name, "task": spec.task, "case": cuda_case(name, batch, quick),
                   "weights": spec.has_weights, **t, "items_per_s": batch / (t["median_ms"] / 1e3)}
            if r.runtime == "pytorch eager" and r.precision == "fp32":
                eager_ms = t["median_ms"]
            row["speedup_vs_eager_fp32"] = eager_ms / t["median_ms"] if eager_ms else None
            measured.append(row)
    del model, compiled, sessions
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return measured, failed


def _autocast(fn: Callable[[], object], device: torch.device) -> object:
    with torch.autocast(device.type, dtype=torch.float16):
        return fn()


def _first(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def device_gate(name: str, precision: str, env: CudaEnv, onnx_dir: Path, threads: int = 2) -> dict:
    """The ``precision`` graph's accuracy gate with the candidate on ``env``'s provider (the reference: the FP32
    graph in ONNX Runtime on the CPU), on the card's gate data and tolerances (:mod:`unroll.gates`)."""
    fp32, cand = artifacts.graph(name, onnx_dir=onnx_dir), artifacts.graph(name, precision, onnx_dir)
    card = from_onnx(fp32)
    cases = gate.gate_cases(card)
    refs = gate.reference_outputs(cases, gate.onnxruntime_run(fp32, card.output, threads))
    sess = device_session(cand, env, threads)
    result = gate.evaluate(card, cases, refs, lambda feeds: sess.run([card.output], feeds)[0],
                           gate.tolerances(card, precision))
    cpu = (quant_report(name, precision, onnx_dir) or {}).get("metrics") or {}
    return {"model": name, "runtime": env.gate_runtime, "precision": precision, "passed": result.passed,
            "failures": result.failures, "tolerances": result.tolerances, "margin": result.margin,
            "metrics": result.metrics,
            "cpu_gate": {k: cpu.get(k) for k in result.tolerances}}  # what unroll quantize measured on the CPU


def run_cuda(models: list[str] | None = None, budget_s: float = 1.0, with_compile: bool = True, quick: bool = False,
             threads: int = 2, onnx_dir: Path = artifacts.ONNX_DIR, out_dir: Path | None = None,
             progress: bool = True, env: CudaEnv | None = None) -> dict:
    """Run :func:`cuda_plan` on this machine's GPU; write ``models_cuda.json|md`` in ``out_dir`` when given.

    Raises :class:`NoCuda` (no usable CUDA) or :class:`NothingMeasured` (every row skipped or failed) before
    anything is written. FP32 graphs missing or stale are exported first; FP16/INT8 ones are not made here.
    """
    env = env or cuda_environment()
    if env.reason:
        raise NoCuda(env.reason)
    onnx_dir, names, budget_s = prepare_run(models, threads, onnx_dir, budget_s,
                                            CUDA_QUICK["budget_s"] if quick else None)
    export_failed = {}
    for name in names:
        try:
            ensure_export(name, onnx_dir)
        except Exception as e:  # its ONNX Runtime rows are skipped with this reason
            export_failed[name] = f"export failed: {type(e).__name__}: {_first(e)}"
    plan = cuda_plan(names, env, onnx_dir, quick, with_compile)
    skipped = [{**asdict(r), "reason": why} for r, why in plan.skipped]
    rows, gates = [], []
    with progress_bars(progress) as bars:
        task = bars.add_task("models (cuda)" if env.device == "cuda" else "models (dry run)", total=len(names),
                             info="")

        def status(msg: str) -> None:
            bars.update(task, info=msg)

        for name in names:
            mine = [r for r in plan.rows if r.model == name]
            if name in export_failed:
                skipped += [{**asdict(r), "reason": export_failed[name]} for r in mine if r.runtime != "pytorch eager"
                            and r.runtime != "torch.compile"]
                mine = [r for r in mine if r.runtime in ("pytorch eager", "torch.compile")]
            timed, failed = _measure_rows(name, [r for r in mine if r.batch is not None], env, onnx_dir, budget_s,
                                          quick, threads, status)
            rows += timed
            skipped += failed
            for r in (r for r in mine if r.batch is None):
                status(f"{name}: {r.precision} gate")
                try:
                    gates.append(device_gate(name, r.precision, env, onnx_dir, threads))
                except Exception as e:
                    skipped.append({**asdict(r), "reason": f"failed: {type(e).__name__}: {_first(e)}"})
            bars.advance(task)
    if not rows and not gates:
        reasons = sorted({s["reason"] for s in skipped})
        raise NothingMeasured("every row was skipped or failed: " + "; ".join(reasons))
    payload = {"benchmark": "models_cuda", "device": env.device, "machine": {**machine_info(threads), **env.machine},
               "config": {"batches": list(cuda_batches(quick)), "precisions": list(CUDA_PRECISIONS),
                          "budget_s": budget_s, "torch_compile": with_compile, "quick": quick, "threads_cpu": threads,
                          "denoise_side": CUDA_QUICK["denoise_side"] if quick else CUDA_DENOISE_SIDE,
                          "ort_provider": env.ort_provider,
                          "timing": f"a first call, {1 if quick else 3} warm-up call(s), then repeats until the "
                                    "budget (≥ 3), each followed by a device synchronise: median",
                          "onnx_dir": str(onnx_dir)},
               "rows": rows, "gates": gates, "skipped": skipped}
    if out_dir is not None:
        write_results("models_cuda", payload, markdown_cuda(payload), Path(out_dir))
    return payload
