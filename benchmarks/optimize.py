"""``unroll optimize``: the fastest correct runtime and Triton configuration for one model, measured here.

Candidates are every CPU runtime present (ONNX Runtime; OpenVINO with dynamic and with static shapes; PyTorch's
AOTInductor package for registered models) × every precision the card lists *and the user allowed*
(:data:`DEFAULT_PRECISIONS`: FP32 and FP16; INT8 only on request, since it trades quality for speed) whose quantized
graph passes its gate. The record says which precisions were allowed and what the chosen one gives up on the gate
data (:func:`quality`).
Each is first checked against the FP32 PyTorch model on the card's gate data (the card's tolerances for its
precision, and ``rel_err`` ≤ :data:`FP32_REL_ERR` for FP32): a wrong candidate is refused and reported, never timed.
The passing ones are timed in process on the card's benchmark cases; the fastest then goes through the Triton
configuration sweep (:mod:`.optimize_sweep`). The choice and its evidence go to :func:`unroll.artifacts.choice`,
which ``unroll repo`` applies. Progress is saved after every measurement, so an interrupted run resumes.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from unroll import artifacts, gates
from unroll.benchmarks import optimize_report, optimize_sweep
from unroll.benchmarks.common import latency_summary, machine_info
from unroll.card import ModelCard, from_onnx
from unroll.errors import OptimizeError
from unroll.serving import runtimes

#: FP32 candidates must also match the PyTorch model this closely (relative L2 over all gate outputs).
FP32_REL_ERR = 1e-4
#: Seconds of timing per candidate and case, split over :data:`ROUNDS` interleaved rounds (at least :data:`MIN_CALLS`
#: calls each).
TIME_PER_CASE_S = 3.0
ROUNDS = 3
MIN_CALLS = 5
#: Warm-up before timing: calls, and at least this long (a static-shape OpenVINO model compiles on its first call
#: and an INT8 one keeps getting faster for several more)
WARMUP_CALLS, WARMUP_S = 5, 0.3
DEFAULT_TIME_BUDGET_MIN = 15.0
#: Precisions ``unroll optimize`` may choose unless told otherwise: INT8 only with the user's consent
#: (``--precision fp32,fp16,int8``). OpenVINO's bfloat16 maths counts as FP16.
PRECISIONS = ("fp32", "fp16", "int8")
DEFAULT_PRECISIONS = ("fp32", "fp16")
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Candidate:
    """One way to run the model on the CPU target."""

    runtime: str
    precision: str  #: the graph's (``NAME.PRECISION.onnx``)
    static_shapes: bool = False
    bf16: bool = False  #: OpenVINO's bfloat16 maths on the FP32 graph (gated as FP16)

    @property
    def key(self) -> str:
        return (f"{self.runtime}/{'bf16' if self.bf16 else self.precision}"
                + ("/static" if self.static_shapes else ""))

    @property
    def gate_precision(self) -> str:
        """The card gate the candidate must pass: its graph's precision, FP16's for bfloat16 maths."""
        return "fp16" if self.bf16 else self.precision


def candidates(card: ModelCard, registered: bool, allowed: tuple[str, ...] = DEFAULT_PRECISIONS
               ) -> tuple[list[Candidate], list[dict]]:
    """The CPU candidates for ``card``'s model, and the ones skipped here with the reason (a runtime missing, or a
    precision not in ``allowed``)."""
    found, skipped = [], []

    def add(cand: Candidate, why: str | None) -> None:
        if cand.gate_precision not in allowed:
            why = why or (f"{cand.gate_precision} not allowed: it gives up quality (its gate's tolerances) for speed; "
                          f"`unroll optimize --precision {','.join([*allowed, cand.gate_precision])}` allows it")
        if why:
            skipped.append({"candidate": cand.key, "reason": why})
        else:
            found.append(cand)

    for runtime in runtimes.RUNTIMES:
        why = runtimes.unavailable_reason(runtime)
        if runtime == "aotinductor":
            why = why or (None if registered else "no PyTorch module: the graph was not exported from a registered "
                                                   "model")
            precisions = ["fp32"]  # (a compiled FP32 PyTorch program; quantized graphs are ONNX)
        else:
            precisions = list(card.precisions)
        shapes = (False, True) if runtime == "openvino" else (False,)
        for precision in precisions:
            for static in shapes:
                add(Candidate(runtime, precision, static), why)
        if runtime == "openvino" and "fp16" in card.precisions:  # reduced-precision maths, judged by the FP16 gate
            why16 = runtimes.bf16_unavailable()  # (OpenVINO missing included)
            for static in shapes:
                add(Candidate(runtime, "fp32", static, bf16=True), why16)
    return found, skipped


# ---------------------------------------------------------------------------------------------- artifacts


def artifact(name: str, cand: Candidate, onnx_dir: Path, aoti_dir: Path, progress: Progress) -> Path:
    """The file ``cand`` runs, made when missing or stale (quantize: the pipeline's rule; AOTInductor: its inputs)."""
    if cand.runtime == "aotinductor":
        package = artifacts.aoti_package(name, aoti_dir)
        if not _package_fresh(name, package):
            from unroll.export.aoti import compile_package

            progress(f"{name}: compiling the AOTInductor package (seconds to a minute)")
            package.parent.mkdir(parents=True, exist_ok=True)
            compile_package(name, package)
            package.with_suffix(".inputs.json").write_text(json.dumps(_package_inputs(name)) + "\n")
        return package
    from unroll.pipeline import quantize_stage

    step = quantize_stage.plan_graph(name, cand.precision, onnx_dir)
    if step is not None:
        progress(f"{name}: {step}")
        step.action()
    return artifacts.graph(name, cand.precision, onnx_dir)


def _package_inputs(name: str) -> dict:
    """What a package is compiled from: the model's export inputs (weights, card, code) and the PyTorch version."""
    import torch

    from unroll.registry import get_spec

    return {**artifacts.export_inputs(get_spec(name)), "torch": torch.__version__}


def _package_fresh(name: str, package: Path) -> bool:
    """Whether ``package`` was compiled from the model's current inputs (recorded beside it)."""
    record = artifacts.read_json(package.with_suffix(".inputs.json"))
    return package.exists() and record == _package_inputs(name)


# ---------------------------------------------------------------------------------------------- measuring


def torch_reference(name: str) -> gates.Run:
    """The FP32 PyTorch model as a gate run (graph-named NumPy feeds → its output)."""
    import torch

    import unroll
    from unroll.benchmarks.models_inputs import torch_call

    model = unroll.load(name).eval()

    def run(feeds: gates.Feeds) -> np.ndarray:
        with torch.inference_mode():
            return torch_call(model, name, {k: torch.from_numpy(v) for k, v in feeds.items()})().numpy()

    return run


def gate_check(card: ModelCard, cand: Candidate, session: runtimes.Session, cases: list[gates.GateCase],
               refs: list[np.ndarray]) -> dict:
    """The candidate against the FP32 reference on the gate data: ``{"passed", "metrics", "failures", …}``."""
    tol = gates.tolerances(card, cand.gate_precision)
    if cand.gate_precision == "fp32":
        tol["rel_err"] = min(tol.get("rel_err", FP32_REL_ERR), FP32_REL_ERR)
    res = gates.evaluate(card, cases, refs, lambda feeds: session(feeds)[card.output], tol)
    return {"passed": res.passed, "metrics": res.metrics, "tolerances": res.tolerances, "failures": res.failures}


def timing_cases(name: str, card: ModelCard) -> list[tuple[str, dict[str, np.ndarray]]]:
    """The card's benchmark cases (denoisers 256² and 512² at σ=25; classifiers batch 1 and full), NumPy feeds."""
    from unroll.benchmarks.models_inputs import case_inputs, cases_for

    lam = card.lam.default if card.lam is not None else None
    return [(label, {k: v.numpy() for k, v in case_inputs(name, case, lam).items()})
            for label, case in cases_for(name)]


def score(rows: list[dict]) -> None:
    """Set each timed row's ``score``: its mean p50 over the cases relative to the fastest row's (1.0 = fastest)."""
    timed = [r for r in rows if r.get("timings")]
    labels = {label for r in timed for label in r["timings"]}
    best = {lb: min(r["timings"][lb]["p50_ms"] for r in timed if lb in r["timings"]) for lb in labels}
    for r in timed:
        r["score"] = float(np.mean([r["timings"][lb]["p50_ms"] / best[lb] for lb in r["timings"]]))


# ---------------------------------------------------------------------------------------------- the run


@dataclass
class Settings:
    name: str
    latency_budget_ms: float | None = None
    time_budget_min: float = DEFAULT_TIME_BUDGET_MIN
    threads: int = max(1, min(2, os.cpu_count() or 1))
    onnx_dir: Path = artifacts.ONNX_DIR
    aoti_dir: Path = artifacts.AOTI_DIR
    optimize_dir: Path = field(default_factory=lambda: artifacts.OPTIMIZE_DIR)
    fresh: bool = False
    sweep: bool = True
    #: time the served choice (Triton direct) against torch.compile in process (registered models only)
    compare: bool = True
    #: the precisions the choice may use (:data:`DEFAULT_PRECISIONS`: INT8 only when asked for)
    precisions: tuple[str, ...] = DEFAULT_PRECISIONS
    #: test hook: measure only these candidate keys (``None``: all)
    only: tuple[str, ...] | None = None


class Journal:
    """The run's measurements so far, saved after each one (``NAME.cpu.partial.json``) and reloaded by a resumed run
    when it was made from the same inputs (graph, card, budgets)."""

    def __init__(self, path: Path, inputs: dict, fresh: bool) -> None:
        self.path = path
        old = None if fresh else artifacts.read_json(path)
        self.data = old if old is not None and old.get("inputs") == inputs else {"inputs": inputs}
        self.resumed = old is not None and self.data is old
        self.data.setdefault("candidates", {})
        self.data.setdefault("sweep", {})

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_jsonable) + "\n")
        tmp.replace(self.path)


def _jsonable(v: object) -> object:
    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    if isinstance(v, Path):
        return str(v)
    raise TypeError(f"not JSON: {type(v).__name__}")


def run(settings: Settings, progress: Progress = print, advance: Callable[[int], None] | None = None,
        total: Callable[[int], None] | None = None) -> dict:
    """Measure, choose and write ``settings.name``'s CPU choice; returns the record written. ``advance`` is called
    after each measurement, ``total`` once with how many there will be at most."""
    s = settings
    start = time.monotonic()
    deadline = start + s.time_budget_min * 60
    name = s.name
    fp32 = artifacts.graph(name, onnx_dir=s.onnx_dir)
    registered = _ensure_exported(name, s.onnx_dir, progress)
    card = from_onnx(fp32)
    cands, skipped = candidates(card, registered, s.precisions)
    if s.only is not None:
        cands = [c for c in cands if c.key in s.only]
    if total is not None:
        total(len(cands) + (optimize_sweep.points_at_most(card) if s.sweep else 0))
    inputs = {"graph_sha256": artifacts.sha256(fp32), "card": card.to_json(), "threads": s.threads,
              "latency_budget_ms": s.latency_budget_ms, "candidates": [c.key for c in cands],
              "precisions_allowed": list(s.precisions)}
    journal = Journal(artifacts.choice(name, "cpu", s.optimize_dir).with_suffix(".partial.json"), inputs, s.fresh)
    if journal.resumed:
        progress(f"{name}: resuming ({len(journal.data['candidates'])} candidates and "
                 f"{len(journal.data['sweep'])} configurations already measured)")
    if registered:
        timing = timing_cases(name, card)
    else:  # a graph from elsewhere: its first gate batch
        case = gates.gate_cases(card)[0]
        timing = [(case.label, case.feeds)]
    rows = _measure_candidates(name, card, cands, registered, timing, s, journal, deadline, progress, advance)
    score(rows)
    passed = sorted((r for r in rows if r.get("timings")), key=lambda r: r["score"])
    if not passed:
        raise OptimizeError(f"{name}: no candidate passed its gate and ran; see {journal.path}")
    best = Candidate(**passed[0]["candidate"])
    sweep = optimize_sweep.Sweep(name, best, card, s.onnx_dir, s.aoti_dir, s.threads, s.latency_budget_ms,
                                 timing[0][1])
    if s.sweep:
        sweep_result = sweep.run(journal, deadline, progress, advance)
    else:
        sweep_result = sweep.skipped("the sweep was not asked for (--no-sweep)")
    chosen = {"runtime": best.runtime, "precision": best.precision, "static_shapes": best.static_shapes,
              "bf16": best.bf16, **sweep_result["chosen"]}
    versus = None
    if s.compare and registered:
        from unroll.benchmarks.optimize_served import served_vs_compile

        versus = served_vs_compile(name, card, timing, chosen, s.onnx_dir, s.aoti_dir, s.threads, progress)
    record = {
        "model": name, "target": "cpu", "written_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "machine": machine_info(s.threads), "graph_sha256": inputs["graph_sha256"],
        "choice": chosen, "precisions_allowed": list(s.precisions), "quality": quality(passed[0]),
        "reference": "FP32 PyTorch model" if registered else "FP32 ONNX graph on ONNX Runtime (no PyTorch module)",
        "gate_data": journal.data.get("gate_data", ""), "candidates": rows, "skipped": skipped,
        "sweep": sweep_result, "served_vs_compile": versus, "elapsed_s": round(time.monotonic() - start, 1),
        "time_budget_min": s.time_budget_min,
        "truncated": time.monotonic() > deadline,
    }
    path = artifacts.choice(name, "cpu", s.optimize_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=_jsonable) + "\n")
    path.with_suffix(".md").write_text(optimize_report.markdown(record))
    journal.path.unlink(missing_ok=True)
    return record


def quality(row: dict) -> dict:
    """What the chosen candidate gives up against the FP32 reference on the gate data: its precision, and for a
    denoiser the worst image's PSNR loss (and which image, at which σ), for a classifier the accuracy loss."""
    metrics = row.get("gate", {}).get("metrics", {})
    cand = Candidate(**row["candidate"])
    out: dict = {"precision": "bf16" if cand.bf16 else cand.precision}
    for key in ("psnr_loss_db_worst", "worst_image", "psnr_loss_db", "accuracy_loss", "top1_agreement"):
        if key in metrics:
            out[key] = metrics[key]
    return out


def _ensure_exported(name: str, onnx_dir: Path, progress: Progress) -> bool:
    """Export ``name`` when its graph is missing or stale; whether it is a registered model (has a PyTorch module)."""
    from unroll.pipeline import export_stage

    registered = export_stage.is_registered(name)
    step = export_stage.plan_model(name, onnx_dir)
    if step is not None:
        progress(str(step))
        step.action()
    if not artifacts.graph(name, onnx_dir=onnx_dir).exists():
        raise OptimizeError(f"{name}: no graph at {artifacts.graph(name, onnx_dir=onnx_dir)} and no registered model "
                            "of that name (`unroll models` lists them)")
    return registered


def _measure_candidates(name: str, card: ModelCard, cands: list[Candidate], registered: bool, timing: list,
                        s: Settings, journal: Journal, deadline: float, progress: Progress,
                        advance: Callable[[int], None] | None) -> list[dict]:
    """Gate every candidate (each saved as it is judged), then time the ones that passed together."""
    done: dict = journal.data["candidates"]
    cases = refs = None
    for cand in cands:
        if cand.key in done and done[cand.key].get("status") != "not measured: time budget spent":
            advance and advance(1)
            continue
        if time.monotonic() > deadline:
            done[cand.key] = {"candidate": asdict(cand), "key": cand.key, "status": "not measured: time budget spent"}
            continue
        if cases is None:  # (loaded only when something is left to measure)
            cases = gates.gate_cases(card)
            reference = torch_reference(name) if registered else gates.onnxruntime_run(
                artifacts.graph(name, onnx_dir=s.onnx_dir), card.output, s.threads)
            refs = gates.reference_outputs(cases, reference)
            journal.data["gate_data"] = gates.gate_source(card, cases)
        done[cand.key] = _check(name, card, cand, s, cases, refs, progress)
        journal.save()
        advance and advance(1)
    rows = [done[c.key] for c in cands]
    untimed = [r for r in rows if r.get("status") == "passed gate"]
    if untimed:
        _time_together(name, untimed, timing, s, progress)
        journal.save()
    return rows


def _check(name: str, card: ModelCard, cand: Candidate, s: Settings, cases: list, refs: list,
           progress: Progress) -> dict:
    """Build ``cand`` and judge it on the gate data (status ``passed gate``, ``refused`` or a failure)."""
    row: dict = {"candidate": asdict(cand), "key": cand.key}
    progress(f"{name}: {cand.key}: building")
    try:
        session = _open(name, cand, s, progress)
    except Exception as e:  # a quantized graph that fails its own gate, a compile error: a result, not a crash
        row.update(status="failed to build", reason=_reason(e))
        return row
    progress(f"{name}: {cand.key}: checking against the FP32 reference")
    try:
        row["gate"] = gate_check(card, cand, session, cases, refs)
    except Exception as e:
        row.update(status="failed to run", reason=_reason(e))
        return row
    if not row["gate"]["passed"]:
        row.update(status="refused", reason="; ".join(row["gate"]["failures"]))
        return row
    row["status"] = "passed gate"
    return row


def _open(name: str, cand: Candidate, s: Settings, progress: Progress) -> runtimes.Session:
    path = artifact(name, cand, s.onnx_dir, s.aoti_dir, progress)
    return runtimes.open_session(path, cand.runtime, s.threads, static_shapes=cand.static_shapes, bf16=cand.bf16)


def _time_together(name: str, rows: list[dict], timing: list, s: Settings, progress: Progress) -> None:
    """Time every row's candidate on every case in :data:`ROUNDS` interleaved rounds, so that a slow spell of this
    machine falls on all candidates alike instead of on whichever ran then; sets ``timings`` and ``status``."""
    sessions = {r["key"]: _open(name, Candidate(**r["candidate"]), s, progress) for r in rows}
    walls: dict = {(k, label): [] for k in sessions for label, _ in timing}
    cpu: dict = dict.fromkeys(walls, 0.0)
    for i in range(ROUNDS):
        for key, session in sessions.items():
            progress(f"{name}: timing {key} (round {i + 1} of {ROUNDS})")
            for label, feeds in timing:
                got, cpu_s = _timed_calls(session, feeds, TIME_PER_CASE_S / ROUNDS)
                walls[key, label] += got
                cpu[key, label] += cpu_s
    for r in rows:
        r["timings"] = {}
        for label, _ in timing:
            summary = latency_summary(walls[r["key"], label])
            r["timings"][label] = {"p50_ms": summary["p50"], "p99_ms": summary["p99"],
                                   "calls": len(walls[r["key"], label]),
                                   "cpu_ms": cpu[r["key"], label] * 1e3 / len(walls[r["key"], label])}
        r["status"] = "passed"


def _timed_calls(session: runtimes.Session, feeds: dict[str, np.ndarray], budget_s: float
                 ) -> tuple[list[float], float]:
    """Wall ms of each call after warm-up, for ``budget_s`` (at least :data:`MIN_CALLS` calls), and the CPU
    seconds (this process, every thread) they took."""
    start = time.perf_counter()
    for i in itertools.count():
        session(feeds)
        if i + 1 >= WARMUP_CALLS and time.perf_counter() - start >= WARMUP_S:
            break
    walls = []
    cpu0, start = time.process_time(), time.perf_counter()
    while len(walls) < MIN_CALLS or time.perf_counter() - start < budget_s:
        t = time.perf_counter()
        session(feeds)
        walls.append((time.perf_counter() - t) * 1e3)
    return walls, time.process_time() - cpu0


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]

