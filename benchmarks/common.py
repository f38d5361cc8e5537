"""Shared helpers: machine info, warm-up + median timing, result writing, and which models to benchmark."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from unroll import artifacts
from unroll.card import from_onnx
from unroll.errors import BenchError, NoModel
from unroll.machine import cpu_model
from unroll.registry import REGISTRY, get_spec, list_models
from unroll.serving.cpu_runtime import ort_session  # noqa: F401  (the benchmarks' in-process baseline, re-exported)

RESULTS = Path(__file__).resolve().parent / "results"


def unroll_command() -> str:
    """The installed ``unroll`` command beside this interpreter: benchmarks that drive the service (the soak's
    ``unroll serve`` and ``unroll deploy``) run it as its users do, never the application's modules."""
    found = shutil.which("unroll", path=str(Path(sys.executable).parent))
    if found is None:
        raise BenchError(f"the unroll command is not installed beside {sys.executable} (pip install -e .)")
    return found


def machine_info(threads: int) -> dict:
    """CPU model, cores, threads used, Python/platform and package versions, UTC date."""
    cpu = cpu_model()
    versions = {}
    for pkg in ("torch", "onnxruntime", "onnxruntime-gpu", "openvino", "tensorrt", "onnx", "onnxslim", "numpy",
                "tritonclient", "nvidia-pytriton", "bm3d", "scikit-image", "fastapi", "uvicorn", "httpx"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS") if k in os.environ}
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"cpu": cpu, "logical_cores": os.cpu_count(), "threads_used": threads, "python": platform.python_version(),
            "platform": platform.platform(), "versions": versions, "env": env,
            "load_avg_at_start": load,  # 1/5/15-min load: well above 0 means other work shared the cores
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def time_call(fn: Callable[[], object], warmup: int = 3, min_repeats: int = 5, max_repeats: int = 50,
              budget_s: float = 3.0) -> dict:
    """Median (and p10/p90) wall time in ms after warm-up; repeats until the budget or max_repeats."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_repeats and (len(times) < min_repeats or time.perf_counter() - start < budget_s):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return {"median_ms": statistics.median(times), "p10_ms": times[int(0.1 * (len(times) - 1))],
            "p90_ms": times[int(0.9 * (len(times) - 1))], "repeats": len(times)}


def _strict(obj: object) -> object:
    """NaN/inf → None, so the JSON is strict (jq, browsers) rather than Python's NaN extension."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_strict(v) for v in obj]
    return obj


def write_results(stem: str, payload: dict, markdown: str, out_dir: Path = RESULTS) -> tuple[Path, Path]:
    """``out_dir/STEM.json`` (the payload; NaN written as null) and ``out_dir/STEM.md``; returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    j, m = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    j.write_text(json.dumps(_strict(payload), indent=2, allow_nan=False) + "\n")
    m.write_text(markdown)
    return j, m


def latency_summary(latencies_ms: Sequence[float]) -> dict[str, float]:
    """Mean and p50/p90/p95/p99/max of latencies in ms (empty → NaNs)."""
    import numpy as np

    if len(latencies_ms) == 0:
        return {k: float("nan") for k in ("mean", "p50", "p90", "p95", "p99", "max")}
    a = np.asarray(latencies_ms, dtype=np.float64)
    p50, p90, p95, p99 = np.percentile(a, [50, 90, 95, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p95": float(p95), "p99": float(p99),
            "max": float(a.max())}


@contextmanager
def progress_bars(enabled: bool = True) -> Iterator[Progress]:
    """rich progress bars on stderr (``enabled=False``: the same API, nothing drawn)."""
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[info]}"), console=Console(stderr=True), disable=not enabled) as bar:
        yield bar


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of Prometheus metric ``name`` in exposition ``text`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def load_note(machine: dict) -> str:
    """One line for a Markdown header: the load average when the run started (noise indicator)."""
    load = machine.get("load_avg_at_start")
    if not load:
        return ""
    return (f"Load average at start {load[0]:g} / {load[1]:g} / {load[2]:g} (1/5/15 min) on "
            f"{machine.get('logical_cores')} cores; measured {machine.get('date_utc')} UTC.")


# ----------------------------------------------------------------------------------------------- what to benchmark
# Chosen from the registry and the model cards, never by name: "the trained demo models" are the registered
# models with committed weights, split by ``card.task``; the quantizable ones are those whose cards name
# training data (calibration) and gate data.


def trained_models(task: str | None = None) -> list[str]:
    """Registered models with committed weights, in registry order (of one ``task`` when given)."""
    list_models()
    return [n for n, s in REGISTRY.items() if s.has_weights and (task is None or s.task == task)]


def demo_model(task: str) -> str:
    """The first trained model of ``task``: what the task-specific benchmarks (quality, serve, scaling) measure."""
    names = trained_models(task)
    if not names:
        raise NoModel(f"no registered {task} model has committed weights (unroll/weights/NAME.pt); "
                      f"trained models: {', '.join(trained_models()) or 'none'}")
    return names[0]


def quantizable(name: str) -> bool:
    """Whether ``unroll quantize`` can gate ``name``: its card names training data (calibration) and gate data."""
    d = get_spec(name).card.data
    return d.train is not None and getattr(d, d.gate) is not None


def exported_card(name: str, onnx_dir: Path):
    """The card inside ``onnx_dir/NAME.onnx`` (as served: λ's default resolved to the trained value)."""
    return from_onnx(artifacts.graph(name, onnx_dir=onnx_dir))


def gaussian_noise(x, sigma: float, seed: int):
    """``x + σ·N(0, 1)`` (float32, not clipped), seeded: the classifiers' robustness noise."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return (x + sigma * rng.standard_normal(x.shape)).astype(np.float32)


def classify_noise_seed(sigma: float) -> int:
    """One seed per noise level, the same as the training recipe's robustness evaluation."""
    return 2000 + int(sigma * 100)


def png_bytes(a) -> bytes:
    """A float image in [0, 1] (``[H, W]`` or ``[H, W, 3]``) as PNG bytes: what the gateway benchmarks send."""
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.rint(np.clip(a, 0, 1) * 255).astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def docs_pages(root: Path) -> list[Path]:
    """The README and the docs site's hand-written pages under ``root`` (not the folders ``docs/`` links in)."""
    docs = root / "docs"
    pages = [p for p in sorted(docs.rglob("*.md"))
             if not any((docs / q).is_symlink() for q in p.relative_to(docs).parents if str(q) != ".")]
    return [root / "README.md", *pages]


def write_docs_blocks(root: Path, begin: str, end: str, text: str) -> bool:
    """Replace what lies between ``begin`` and ``end`` with ``text`` on every page of the README and ``docs/`` that
    holds them (a block generated from a results file, so no page quotes a number by hand); ``False`` when none does."""
    wrote = False
    for page in docs_pages(root):
        if not page.exists():
            continue
        current = page.read_text(encoding="utf-8")
        start, stop = current.find(begin), current.find(end)
        if start < 0 or stop < start:
            continue
        page.write_text(current[:start + len(begin)] + "\n" + text + "\n" + current[stop:], encoding="utf-8")
        wrote = True
    return wrote
