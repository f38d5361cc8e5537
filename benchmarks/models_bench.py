"""The engines, one model at a time: PyTorch eager vs torch.compile vs ONNX Runtime FP32 / FP16 / INT8.

Every registered model at a few batch or image sizes, on real inputs from its card's data, with one thread count,
warm-up, median of repeats and ratios to PyTorch eager from the same run; plus the denoiser's latency vs pixel count,
the classifier's throughput vs batch size, and ONNX Runtime's speed per precision beside the quantization reports'
accuracy. ``--device cuda`` (:func:`run_cuda`) runs the GPU rows that :func:`cuda_plan` and a real probe allow, and
writes nothing when nothing could be measured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
from unroll.benchmarks.common import (
    NoModel,
    demo_model,
    exported_card,
    load_note,
    machine_info,
    ort_session,
    progress_bars,
    quantizable,
    time_call,
    trained_models,
    write_results,
)
from unroll.pipeline import quantize_stage

from unroll import artifacts, pipeline, tasks
from unroll.errors import BenchError

ENGINES = ("pytorch eager", "torch.compile", "onnxruntime fp32", "openvino fp32", "onnxruntime fp16",
           "onnxruntime int8")
#: The FP32 graph on OpenVINO (serving/cpu_runtime.py), the other CPU runtime a card can pick.
OPENVINO = "openvino fp32"
QUANTIZED = ("fp16", "int8")
#: Image inputs: batch 1 and a "full batch" — the largest power of two in [8, 64] with at most
#: FULL_BATCH_ELEMENTS input values; token/feature blocks: batch 1 and 8.
FULL_BATCH_ELEMENTS = 2**17
DEFAULT_BLOCK_BATCHES = (1, 8)
DENOISE_SIZES = (256, 512)
SCALING_SIDES = (128, 256, 512, 768, 1024)
THROUGHPUT_BATCHES = (1, 4, 16, 64, 256)
DENOISE_SIGMA = 25.0
QUICK = {"batches": (1, 4), "denoise_sizes": (64,), "scaling_sides": (64, 96, 128), "throughput_batches": (1, 8),
         "budget_s": 0.2}


# ----------------------------------------------------------------------------------------------- inputs


def lam_default(name: str, onnx_dir: Path) -> float | None:
    """The λ a served request gets by default: the exported card's (the first solver layer's trained λ)."""
    path = artifacts.graph(name, onnx_dir=onnx_dir)
    if not path.exists():
        return None
    card = exported_card(name, onnx_dir)
    return card.lam.default if card.lam is not None else None


def noisy_image(name: str, side: int, sigma255: float = DENOISE_SIGMA) -> dict[str, torch.Tensor]:
    """A denoiser's graph inputs: its card's first test image resized to ``side``², seeded σ noise."""
    from skimage.transform import resize

    from unroll import data
    from unroll.registry import get_spec

    card = get_spec(name).card
    image_name, img = next(iter(data.dataset(card.data.test or card.data.train).load().items()))
    img = resize(img, (side, side), anti_aliasing=True).astype(np.float32)
    noisy = torch.from_numpy(data.add_noise(img, sigma255, data.noise_seed(image_name, sigma255)))
    channels = card.input.shape[0]
    return {card.input.name: noisy[None, None].expand(1, channels, -1, -1).contiguous(),
            card.sigma.input: torch.tensor([sigma255 / card.sigma.scale])}


def case_inputs(name: str, case: int, lam: float | None = None) -> dict[str, torch.Tensor]:
    """Graph-named inputs from the card: ``case`` is the batch size, or the image side for a denoiser.

    Classifiers get samples of their card's test data at their input size (and ``lam`` when given),
    blocks the export's real example inputs, cycled to the batch size.
    """
    from unroll.export import inputs as ex

    from unroll.registry import get_spec

    spec = get_spec(name)
    card = spec.card
    task = tasks.get(spec.task)
    if task.data == "noisy":
        return noisy_image(name, case)
    if task.logits:
        feeds = {card.input.name: ex.image_batch(spec, case)}
        if card.lam is not None and lam is not None:
            feeds[card.lam.input] = torch.full((case,), lam)
        return feeds
    real = max((c for c in ex.cases(spec, lam_input=False) if c.label.startswith("real")),
               key=lambda c: len(c.inputs[card.input.name]))
    x = real.inputs[card.input.name]
    return {card.input.name: x[[i % len(x) for i in range(case)]]}


def full_batch(name: str) -> int:
    """The "full batch" of an image model: larger for small inputs (see FULL_BATCH_ELEMENTS)."""
    from unroll.registry import get_spec

    elements = int(np.prod(get_spec(name).input_shape))
    b = 64
    while b > 8 and b * elements > FULL_BATCH_ELEMENTS:
        b //= 2
    return b


def cases_for(name: str, quick: bool = False) -> list[tuple[str, int]]:
    """(label, case) pairs: ``batch N`` or ``S×S``."""
    from unroll.registry import get_spec

    spec = get_spec(name)
    if tasks.get(spec.task).data == "noisy":
        return [(f"{s}×{s}", s) for s in (QUICK["denoise_sizes"] if quick else DENOISE_SIZES)]
    if quick:
        batches = QUICK["batches"]
    elif spec.card.input.colour is not None:
        batches = (1, full_batch(name))
    else:
        batches = DEFAULT_BLOCK_BATCHES
    return [(f"batch {b}", b) for b in batches]


def torch_call(model: torch.nn.Module, name: str, feeds: dict[str, torch.Tensor]) -> Callable[[], object]:
    """The PyTorch call on the graph's inputs, in the card's order (λ ``None``: the model's own)."""
    from unroll.registry import get_spec

    card = get_spec(name).card
    x = feeds[card.input.name]
    if tasks.get(card.task).logits:
        return partial(model, x, feeds.get(card.lam.input) if card.lam is not None else None)
    if card.sigma is not None:
        return partial(model, x, feeds[card.sigma.input])
    return partial(model, x)


# ----------------------------------------------------------------------------------------------- graphs


def ensure_export(name: str, onnx_dir: Path) -> Path:
    """``onnx_dir/NAME.onnx``, exported (fused, verified) first when the pipeline finds it missing or stale."""
    pipeline.run(pipeline.plan([name], onnx_dir=onnx_dir), progress=None)
    return artifacts.graph(name, onnx_dir=onnx_dir)


def quantized_graphs(name: str, onnx_dir: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """FP16/INT8 graphs usable for ``name`` and, for the others, why not (missing or stale: the quantize stage's
    rule, :mod:`unroll.pipeline.quantize_stage`)."""
    ok, why = {}, {}
    for p in QUANTIZED:
        reason = quantize_stage.stale_reason(name, p, onnx_dir)
        if reason is None:
            ok[p] = artifacts.graph(name, p, onnx_dir)
        else:
            why[p] = reason
    return ok, why


def quantizable_models() -> list[str]:
    """The trained models whose cards let ``unroll quantize`` calibrate and gate them."""
    return [n for n in trained_models() if quantizable(n)]


def ensure_quantized(onnx_dir: Path, models: list[str] | None = None,
                     log: Callable[[str], None] = print) -> dict[str, str]:
    """Run ``unroll quantize`` (card gates) for each missing or stale FP16/INT8 graph; returns failures.

    ``models`` defaults to the trained, quantizable ones (:func:`quantizable_models`).
    """
    from unroll.export.quantize import GateFailed

    failed = {}
    for name in quantizable_models() if models is None else models:
        ensure_export(name, onnx_dir)
        _, why = quantized_graphs(name, onnx_dir)
        for p in why:
            log(f"quantizing {name} to {p} ({why[p]})")
            try:
                pipeline.run(pipeline.plan_graph(name, onnx_dir=onnx_dir, precision=p), progress=None)
            except (GateFailed, ValueError, FileNotFoundError) as e:
                failed[f"{name}.{p}"] = str(e)
                log(f"  {name} {p}: {e}")
    return failed


def quant_report(name: str, precision: str, onnx_dir: Path) -> dict | None:
    return artifacts.read_json(artifacts.graph_report(name, precision, onnx_dir))


# ----------------------------------------------------------------------------------------------- the benchmark


def _timed(fn: Callable[[], object], budget_s: float) -> dict:
    """Median of at least 3 repeats after warm-up (1 call for quick budgets, else 2)."""
    return time_call(fn, warmup=1 if budget_s < QUICK["budget_s"] + 1e-9 else 2, min_repeats=3, max_repeats=200,
                     budget_s=budget_s)


def bench_model(name: str, onnx_dir: Path, threads: int, budget_s: float, with_compile: bool, quick: bool,
                status: Callable[[str], None]) -> list[dict]:
    """Rows for one registered model: every case × every engine available."""
    import unroll
    from unroll.registry import get_spec

    spec = get_spec(name)
    model = unroll.load(name, pretrained=spec.has_weights)
    notes: dict[str, str] = {}
    sessions = {}
    try:
        sessions["fp32"] = ort_session(ensure_export(name, onnx_dir), threads)
    except Exception as e:  # an export that fails is a result to report, not a reason to stop
        notes["onnxruntime fp32"] = f"export failed: {type(e).__name__}: {e}"[:200]
    q, why = quantized_graphs(name, onnx_dir)
    sessions.update({p: ort_session(path, threads) for p, path in q.items()})
    openvino = None
    if "fp32" in sessions:
        from unroll.serving.cpu_runtime import open_session, unavailable_reason

        skip = unavailable_reason("openvino")
        if skip:
            notes[OPENVINO] = f"skipped: {skip}"
        else:
            try:
                openvino = open_session(ensure_export(name, onnx_dir), "openvino", threads)
            except Exception as e:  # a graph OpenVINO cannot compile is a result too
                notes[OPENVINO] = f"OpenVINO failed: {type(e).__name__}: {e}"[:200]
    lam = lam_default(name, onnx_dir)
    if quantizable(name):  # only these have gate data, so only these can be quantized
        notes.update({f"onnxruntime {p}": w for p, w in why.items()})
    rows = []
    for label, case in cases_for(name, quick):
        feeds = case_inputs(name, case, lam)
        row: dict = {"model": name, "task": spec.task, "case": label, "weights": spec.has_weights, "timings": {},
                     "notes": dict(notes)}
        with torch.inference_mode():
            status(f"{name} {label}: pytorch eager")
            row["timings"]["pytorch eager"] = _timed(torch_call(model, name, feeds), budget_s)
            if with_compile:
                status(f"{name} {label}: torch.compile (compiling)")
                try:
                    compiled = torch.compile(model, dynamic=False)
                    fn = torch_call(compiled, name, feeds)
                    fn()
                    row["timings"]["torch.compile"] = _timed(fn, budget_s)
                except Exception as e:
                    row["notes"]["torch.compile"] = f"{type(e).__name__}: {e}"[:200]
        for p, sess in sessions.items():
            status(f"{name} {label}: onnxruntime {p}")
            names = {i.name for i in sess.get_inputs()}
            np_feeds = {k: v.numpy() for k, v in feeds.items() if k in names}
            row["timings"][f"onnxruntime {p}"] = _timed(partial(sess.run, None, np_feeds), budget_s)
            if p == "fp32" and openvino is not None:
                status(f"{name} {label}: {OPENVINO}")
                ref = sess.run(None, np_feeds)[0]
                row["openvino_max_abs_diff"] = float(np.abs(next(iter(openvino(np_feeds).values())) - ref).max())
                row["timings"][OPENVINO] = _timed(partial(openvino, np_feeds), budget_s)
        eager = row["timings"]["pytorch eager"]["median_ms"]
        row["speedup_vs_eager"] = {k: eager / v["median_ms"] for k, v in row["timings"].items()}
        rows.append(row)
    return rows


def _fit_power_law(pixels: list[int], ms: list[float]) -> dict:
    k, c = np.polyfit(np.log(pixels), np.log(ms), 1)
    return {"exponent": float(k), "log_coef": float(c)}


def scaling(onnx_dir: Path, threads: int, budget_s: float, quick: bool, status: Callable[[str], None]) -> dict:
    """The trained denoiser's latency vs pixels (ONNX Runtime FP32) and the trained classifier's throughput vs
    batch (eager, ORT FP32/INT8). A part whose model the registry lacks is left out, with the reason in ``notes``."""
    out: dict = {}
    notes = {}
    for task, part in ((tasks.DENOISING, _denoiser_scaling), (tasks.CLASSIFICATION, _classifier_scaling)):
        try:
            name = demo_model(task)
        except NoModel as e:
            notes[task] = str(e)
            continue
        out.update(part(name, onnx_dir, threads, budget_s, quick, status))
    return {**out, **({"notes": notes} if notes else {})}


def _denoiser_scaling(name: str, onnx_dir: Path, threads: int, budget_s: float, quick: bool,
                      status: Callable[[str], None]) -> dict:
    sess = ort_session(ensure_export(name, onnx_dir), threads)
    points = []
    for side in (QUICK["scaling_sides"] if quick else SCALING_SIDES):
        status(f"scaling: {name} {side}×{side}")
        feeds = {k: v.numpy() for k, v in noisy_image(name, side).items()}
        t = _timed(partial(sess.run, None, feeds), budget_s)
        points.append({"side": side, "pixels": side * side, **t})
    return {"denoiser": {"onnxruntime fp32": {
        "model": name, "points": points,
        "fit": _fit_power_law([p["pixels"] for p in points], [p["median_ms"] for p in points])}}}


def _classifier_scaling(name: str, onnx_dir: Path, threads: int, budget_s: float, quick: bool,
                        status: Callable[[str], None]) -> dict:
    import unroll

    model = unroll.load(name)
    graphs = {"fp32": ensure_export(name, onnx_dir), **quantized_graphs(name, onnx_dir)[0]}
    lam = lam_default(name, onnx_dir)
    engines: dict[str, Callable[[dict[str, torch.Tensor]], Callable[[], object]]] = {
        "pytorch eager": lambda f: torch_call(model, name, f)}
    for p in ("fp32", "int8"):
        if p in graphs:
            s = ort_session(graphs[p], threads)
            engines[f"onnxruntime {p}"] = lambda f, s=s: partial(s.run, None, {k: v.numpy() for k, v in f.items()})
    out: dict = {"model": name, "engines": {}}
    for engine, make in engines.items():
        pts = []
        for b in (QUICK["throughput_batches"] if quick else THROUGHPUT_BATCHES):
            status(f"scaling: {name} {engine} batch {b}")
            with torch.inference_mode():
                t = _timed(make(case_inputs(name, b, lam)), budget_s)
            pts.append({"batch": b, **t, "images_per_s": b / (t["median_ms"] / 1e3)})
        out["engines"][engine] = pts
    return {"classifier": out}


def _quality(model: str, precision: str, onnx_dir: Path) -> dict | None:
    """Accuracy (classifiers) or PSNR per σ (denoisers) for one precision, from the quantization reports."""
    reports = {p: quant_report(model, p, onnx_dir) for p in QUANTIZED}
    rep = (reports["int8"] or reports["fp16"]) if precision == "fp32" else reports[precision]
    m = (rep or {}).get("metrics") or {}
    fp32 = precision == "fp32"
    if "accuracy" in m:
        return {"accuracy": m["accuracy_fp32"] if fp32 else m["accuracy"],
                "top1_agreement": 1.0 if fp32 else m.get("top1_agreement"), "n": m.get("n")}
    if "per_sigma" in m:
        ps = m["per_sigma"]
        return {"psnr_db": {s: v["psnr_fp32"] if fp32 else v["psnr"] for s, v in ps.items()},
                "psnr_loss_db": {s: 0.0 if fp32 else v["psnr_loss_db"] for s, v in ps.items()}}
    return None


def precision_table(rows: list[dict], onnx_dir: Path) -> list[dict]:
    """ONNX Runtime FP32 vs FP16 vs INT8 speed for the quantizable models, beside their accuracy-gate figures."""
    out = []
    for r in rows:
        if not quantizable(r["model"]) or "onnxruntime fp32" not in r["timings"]:
            continue
        base = r["timings"]["onnxruntime fp32"]["median_ms"]
        for p in ("fp32", *QUANTIZED):
            t = r["timings"].get(f"onnxruntime {p}")
            out.append({"model": r["model"], "case": r["case"], "precision": p,
                        "median_ms": t["median_ms"] if t else None,
                        "speedup_vs_fp32": base / t["median_ms"] if t else None,
                        "note": r["notes"].get(f"onnxruntime {p}"), "quality": _quality(r["model"], p, onnx_dir)})
    return out


def run(models: list[str] | None = None, threads: int = 2, budget_s: float = 1.0, with_compile: bool = False,
        quick: bool = False, onnx_dir: Path = artifacts.ONNX_DIR, progress: bool = True,
        out_dir: Path | None = None, with_scaling: bool = True) -> dict:
    """Benchmark every registered model (or ``models``); write ``models.json|md`` + ``models_scaling.png``."""
    from unroll.registry import list_models

    torch.set_num_threads(threads)
    onnx_dir = Path(onnx_dir)
    onnx_dir.mkdir(parents=True, exist_ok=True)
    names = models or list_models()
    if quick:
        budget_s = min(budget_s, QUICK["budget_s"])
    rows: list[dict] = []
    with progress_bars(progress) as bars:
        task = bars.add_task("models", total=len(names) + (1 if with_scaling else 0), info="")

        def status(msg: str) -> None:
            bars.update(task, info=msg)

        for name in names:
            rows += bench_model(name, onnx_dir, threads, budget_s, with_compile, quick, status)
            bars.advance(task)
        scal = scaling(onnx_dir, threads, budget_s, quick, status) if with_scaling else {}
        bars.advance(task)
    payload = {"benchmark": "models", "machine": machine_info(threads),
               "config": {"threads": threads, "budget_s": budget_s, "torch_compile": with_compile, "quick": quick,
                          "timing": f"{1 if quick else 2} warm-up call(s), then repeats until the budget (≥ 3): median",
                          "onnx_dir": str(onnx_dir)},
               "rows": rows, "precision": precision_table(rows, onnx_dir), "scaling": scal}
    if out_dir is not None:
        write(payload, Path(out_dir))
    return payload


def write(payload: dict, out_dir: Path) -> list[Path]:
    from unroll.benchmarks import plots

    paths = list(write_results("models", payload, markdown(payload), out_dir))
    if payload.get("scaling"):
        paths += plots.models_plots(payload, out_dir)
    return paths


# ----------------------------------------------------------------------------------------------- Markdown


def _cell(t: dict | None, ratio: float | None, note: str | None = None) -> str:
    if t is None:
        return note if note and note.startswith("skipped") else "-"
    return f"{t['median_ms']:.2f} ({ratio:.2f}×)"


def markdown(payload: dict) -> str:
    m, cfg = payload["machine"], payload["config"]
    engines = [e for e in ENGINES if any(e in r["timings"] or (e == OPENVINO and OPENVINO in r["notes"])
                                         for r in payload["rows"])]
    lines = [f"# Engines per model ({m['cpu']}, {cfg['threads']} threads, torch {m['versions'].get('torch')}, "
             f"onnxruntime {m['versions'].get('onnxruntime')}"
             + (f", openvino {m['versions']['openvino']}" if m["versions"].get("openvino") else "") + ")", "",
             f"Median latency in ms per call ({cfg['timing']}); in parentheses the speed-up vs PyTorch eager in "
             "the same run. Models without committed weights run a seeded random initialisation (same cost). "
             + ("" if cfg["torch_compile"] else "torch.compile skipped (pass --compile; slow to compile). ")
             + load_note(m), "",
             "| model | case | " + " | ".join(engines) + " |", "|---|---|" + "---|" * len(engines)]
    for r in payload["rows"]:
        cells = [_cell(r["timings"].get(e), r["speedup_vs_eager"].get(e), r["notes"].get(e)) for e in engines]
        lines.append(f"| {r['model']} | {r['case']} | " + " | ".join(cells) + " |")
    notes = sorted({f"{r['model']} {k}: {v}" for r in payload["rows"] for k, v in r["notes"].items()
                    if not v.startswith("skipped")})
    if notes:
        lines += ["", "Not measured: " + "; ".join(notes) + "."]
    if payload["precision"]:
        lines += ["", "## ONNX Runtime CPU: FP32 vs FP16 vs INT8, speed and accuracy", "",
                  "Accuracy figures are the quantization gates' (`build/onnx/NAME.<precision>.report.json`), on "
                  "the data each model's card names for its gate: classifiers' accuracy, denoisers' mean PSNR.", "",
                  "| model | case | precision | median ms | speed vs FP32 | accuracy / PSNR σ=15, 25, 50 (dB) "
                  "| change vs FP32 |", "|---|---|---|---|---|---|---|"]
        for e in payload["precision"]:
            q = e.get("quality") or {}
            if "accuracy" in q:
                qual = "-" if q["accuracy"] is None else f"{100 * q['accuracy']:.1f} %"
                diff = "-" if q.get("top1_agreement") is None else f"top-1 agreement {100 * q['top1_agreement']:.1f} %"
            elif "psnr_db" in q:
                qual = ", ".join(f"{v:.2f}" for v in q["psnr_db"].values())
                diff = ", ".join(f"{-v:+.3f}" for v in q["psnr_loss_db"].values()) + " dB"
            else:
                qual = diff = "-"
            ms = "-" if e["median_ms"] is None else f"{e['median_ms']:.2f}"
            sp = "-" if e["speedup_vs_fp32"] is None else f"{e['speedup_vs_fp32']:.2f}×"
            if e["median_ms"] is None and e.get("note"):
                ms = e["note"]
            lines.append(f"| {e['model']} | {e['case']} | {e['precision'].upper()} | {ms} | {sp} | {qual} | {diff} |")
    sc = payload.get("scaling") or {}
    for engine, d in sc.get("denoiser", {}).items():
        lines += ["", f"## Scaling: {d.get('model', 'denoiser')} latency vs image size ({engine})", "",
                  f"Fitted power law: latency ∝ pixels^**{d['fit']['exponent']:.2f}** (1.0 = linear in pixels).", "",
                  "| size | pixels | median ms | µs / pixel |", "|---|---|---|---|"]
        for p in d["points"]:
            lines.append(f"| {p['side']}×{p['side']} | {p['pixels']:,} | {p['median_ms']:.1f} | "
                         f"{1e3 * p['median_ms'] / p['pixels']:.3f} |")
    cl = sc.get("classifier", {}).get("engines", {})
    if cl:
        batches = [p["batch"] for p in next(iter(cl.values()))]
        lines += ["", f"## Scaling: {sc['classifier']['model']} throughput vs batch size (images/s)", "",
                  "| engine | " + " | ".join(f"batch {b}" for b in batches) + " |", "|---|" + "---|" * len(batches)]
        for engine, pts in cl.items():
            lines.append(f"| {engine} | " + " | ".join(f"{p['images_per_s']:.0f}" for p in pts) + " |")
    if sc:
        lines += ["", "Plot: `models_scaling.png`."]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------- CUDA
# ``unroll bench models --device cuda``: PyTorch eager and torch.compile on the GPU vs ONNX Runtime's CUDA provider,
# FP32/FP16 at batch 1 and 64, plus the FP16/INT8 accuracy gates evaluated with the candidate on the GPU. Which
# rows run is decided up front (:func:`cuda_plan`, from a real probe of this machine: :func:`cuda_environment`),
# and every row that does not run says why. ``device="cpu"`` runs the very same code on the CPU: a dry run of
# the plumbing for the tests on machines without a GPU, never written as GPU results by the command line.

CUDA_PRECISIONS = ("fp32", "fp16")
CUDA_BATCHES = (1, 64)
#: Denoisers take a batch of this side² crops of their card's test image (their "batch" axis is real images).
CUDA_DENOISE_SIDE = 256
CUDA_QUICK = {"batches": (1, 4), "denoise_side": 64, "budget_s": 0.2}
#: ONNX Runtime's IOBinding element types for the graph input types it reports.
_ORT_TORCH_DTYPES = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16, "tensor(int64)": torch.int64,
                     "tensor(int32)": torch.int32, "tensor(bool)": torch.bool}
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.int32: np.int32,
                 torch.bool: np.bool_}


class NoCuda(BenchError):
    """CUDA cannot be used here (the message says why): nothing is measured and nothing is written."""


class NothingMeasured(BenchError):
    """Every planned row was skipped or failed: the committed results are left as they are."""


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
    from unroll import machine as probes

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
    from unroll.registry import get_spec

    if tasks.get(get_spec(name).task).data == "noisy":
        one = noisy_image(name, CUDA_QUICK["denoise_side"] if quick else CUDA_DENOISE_SIDE)
        return {k: v.expand(batch, *v.shape[1:]).contiguous() for k, v in one.items()}
    return case_inputs(name, batch, lam)


def cuda_case(name: str, batch: int, quick: bool = False) -> str:
    from unroll.registry import get_spec

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
        raise RuntimeError(f"ONNX Runtime did not take {env.ort_provider} for {path.name} "
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
    import unroll
    from unroll.registry import get_spec

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
    graph in ONNX Runtime on the CPU), on the card's gate data and tolerances (:mod:`unroll.export.gates`)."""
    from unroll.export import gates as gate

    from unroll.card import from_onnx

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
    from unroll.registry import list_models

    env = env or cuda_environment()
    if env.reason:
        raise NoCuda(env.reason)
    torch.set_num_threads(threads)
    onnx_dir = Path(onnx_dir)
    onnx_dir.mkdir(parents=True, exist_ok=True)
    names = models or list_models()
    if quick:
        budget_s = min(budget_s, CUDA_QUICK["budget_s"])
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


def _cuda_cell(r: dict | None) -> str:
    if r is None:
        return "-"
    ratio = r.get("speedup_vs_eager_fp32")
    return f"{r['median_ms']:.3f}" + (f" ({ratio:.2f}×)" if ratio else "")


def markdown_cuda(payload: dict) -> str:
    m, cfg = payload["machine"], payload["config"]
    dry = payload.get("device") != "cuda"
    versions = m.get("versions") or {}
    torch_v, ort_v = m.get("torch") or versions.get("torch"), m.get("onnxruntime") or versions.get("onnxruntime")
    where = (f"a CPU dry run of its code on {m.get('cpu')}: not GPU results" if dry else
             f"{m.get('gpu')}, {m.get('gpu_memory_gib')} GiB, compute capability {m.get('compute_capability')}; "
             f"driver {m.get('driver')}, CUDA {m.get('cuda_runtime')}, cuDNN {m.get('cudnn')}")
    runtimes = list(dict.fromkeys(r["runtime"] for r in payload["rows"]))
    cols = [(rt, p) for rt in runtimes for p in CUDA_PRECISIONS if any(
        r["runtime"] == rt and r["precision"] == p for r in payload["rows"])]
    lines = [f"# Engines per model on CUDA ({where}; torch {torch_v}, onnxruntime {ort_v})", "",
             f"Median latency in ms per call ({cfg['timing']}); inputs and outputs stay on the device (ONNX "
             "Runtime through IOBinding). In parentheses the speed-up vs PyTorch eager FP32 at the same batch. "
             "FP16: PyTorch under `torch.autocast(float16)`; ONNX Runtime runs the FP16 graph `unroll quantize` "
             f"wrote ({cfg['ort_provider']}). Models without committed weights run a seeded random "
             f"initialisation (same cost). Measured {m.get('date_utc')} UTC.", "",
             "| model | case | " + " | ".join(f"{rt} {p}" for rt, p in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    cases = list(dict.fromkeys((r["model"], r["case"]) for r in payload["rows"]))
    for model, case in cases:
        here = {(r["runtime"], r["precision"]): r for r in payload["rows"] if r["model"] == model
                and r["case"] == case}
        lines.append(f"| {model} | {case} | " + " | ".join(_cuda_cell(here.get(c)) for c in cols) + " |")
    if payload["gates"]:
        lines += ["", "## Accuracy gates with the candidate on the device", "",
                  "The card's gate data and tolerances (`unroll.export.gates`); reference: the FP32 graph in ONNX "
                  "Runtime on the CPU. Last column: the same metric from `unroll quantize`'s CPU gate.", "",
                  "| model | precision | metric | measured | tolerance | passed | CPU gate |",
                  "|---|---|---|---|---|---|---|"]
        from unroll.export.gates import METRICS

        for g in payload["gates"]:
            for metric, tol in g["tolerances"].items():
                v, cpu = g["metrics"].get(metric), g["cpu_gate"].get(metric)
                fmt = METRICS[metric].format
                lines.append(f"| {g['model']} | {g['precision'].upper()} | {metric} | "
                             f"{'-' if v is None else fmt(v)} | {fmt(tol)} | {'yes' if g['passed'] else 'no'} | "
                             f"{'-' if cpu is None else fmt(cpu)} |")
    if payload["skipped"]:
        lines += ["", "## Not measured", ""]
        by: dict[str, list[str]] = {}
        for s in payload["skipped"]:
            what = f"{s['model']} {s['runtime']} {s['precision']}" + (f" b{s['batch']}" if s["batch"] else "")
            by.setdefault(s["reason"], []).append(what)
        for why, items in by.items():
            lines.append(f"- {why}: {', '.join(items)}")
    return "\n".join(lines) + "\n"
