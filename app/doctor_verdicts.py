"""The doctor's whole check and its verdicts: every component (binaries and child interpreters side by side), the
GPU as PyTorch or nvidia-smi sees it, and for each ``unroll`` command whether it can work here and why not.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from unroll.app.doctor_probes import PACKAGE_GROUPS, run_children
from unroll.app.doctor_tools import check_perf_analyzer, check_tool, check_triton
from unroll.machine import Component, check_nvidia_smi, guarded

#: Seconds every check together may take by default (binaries and child interpreters run in parallel).
DEFAULT_TIMEOUT_S = 8.0


def _gpu(c: dict[str, Component]) -> Component:
    """The NVIDIA GPU, from PyTorch's view first, else nvidia-smi's."""
    cuda, smi, driver = c["cuda"], c["nvidia-smi"], c["driver"]
    smi_gpus = smi.facts.get("gpus") or []
    facts: dict = {"driver": (smi_gpus[0]["driver_version"] if smi_gpus else None)
                   or driver.facts.get("kernel_module"), "cuda_driver_api": driver.facts.get("cuda_driver_api")}
    if cuda.ok:
        d = cuda.facts["devices"][0]
        facts.update(name=d["name"], memory_gib=d["memory_gib"], compute_capability=d["compute_capability"],
                     count=len(cuda.facts["devices"]), source="torch.cuda")
    elif smi_gpus:
        g = smi_gpus[0]
        facts.update(name=g["name"], memory_gib=round(float(g["memory.total"]) / 1024, 1)
                     if g["memory.total"].replace(".", "").isdigit() else None,
                     compute_capability=g.get("compute_cap"), count=len(smi_gpus), source="nvidia-smi")
    else:
        if smi.status == "broken":
            return Component("gpu", "broken", smi.summary, facts)
        if driver.ok and cuda.status in ("broken", "unknown"):
            return Component("gpu", cuda.status, f"an NVIDIA driver is loaded ({driver.summary}), but the CUDA check: "
                                                 f"{cuda.summary}", facts)
        why = [smi.summary, "no NVIDIA driver is loaded" if driver.status == "missing" else driver.summary,
               "torch sees no CUDA device" if cuda.status == "missing" else f"CUDA check: {cuda.summary}"]
        return Component("gpu", "missing", "no NVIDIA GPU: " + "; ".join(why), facts)
    cc = f", compute capability {facts['compute_capability']}" if facts.get("compute_capability") else ""
    mem = f", {facts['memory_gib']} GiB" if facts.get("memory_gib") else ""
    drv = f", driver {facts['driver']}" if facts.get("driver") else ""
    return Component("gpu", "ok", f"{facts['count']}× {facts['name']}{mem}{cc}{drv}", facts)


def _providers_need_gpu(c: dict[str, Component]) -> None:
    """A provider that is listed but not taken on a machine without a GPU is unusable here, not broken."""
    for name in ("ort-cuda", "ort-tensorrt"):
        p = c.get(name)
        if p is not None and p.status == "broken" and p.facts.get("fell_back") and not c["gpu"].ok:
            c[name] = Component(name, "unusable", f"{p.facts['provider']} is listed but there is no NVIDIA GPU here "
                                                  "(ONNX Runtime fell back to the CPU)", p.facts)


def check_all(timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Component]:
    """Every component, binaries and child interpreters in parallel, within about ``timeout`` seconds."""
    binaries: dict[str, Callable[[], Component]] = {  # each may take the whole time: they run side by side
        "nvidia-smi": lambda: check_nvidia_smi(timeout),
        "triton": lambda: check_triton(timeout),
        "podman": lambda: check_tool("podman", works_args=("info",), timeout=timeout),
        "buildah": lambda: check_tool("buildah", timeout=timeout),
        "perf_analyzer": lambda: check_perf_analyzer(timeout),
    }
    with ThreadPoolExecutor(len(binaries) + 1) as pool:
        children = pool.submit(run_children, timeout)
        futures = {n: pool.submit(guarded, n, f) for n, f in binaries.items()}
        found = {**children.result(), **{n: f.result() for n, f in futures.items()}}
    found["gpu"] = _gpu(found)
    _providers_need_gpu(found)
    return {n: found[n] for n in ORDER}


ORDER = ("gpu", "nvidia-smi", "driver", "torch", "cuda", "tensorrt", "onnxruntime", "ort-cuda", "ort-tensorrt",
         *PACKAGE_GROUPS, "triton", "podman", "buildah", "perf_analyzer")


TITLES = {"gpu": "NVIDIA GPU", "nvidia-smi": "nvidia-smi", "driver": "NVIDIA driver", "torch": "PyTorch",
          "cuda": "CUDA (PyTorch)", "tensorrt": "TensorRT", "onnxruntime": "ONNX Runtime",
          "ort-cuda": "ORT CUDA provider", "ort-tensorrt": "ORT TensorRT provider",
          "export-tools": "Export tool chain", "serve-tools": "Serving packages", "bench-tools": "Benchmark packages",
          "triton": "Triton (bundled)", "podman": "podman", "buildah": "buildah", "perf_analyzer": "perf_analyzer"}


@dataclass(frozen=True)
class Verdict:
    command: str
    ok: bool
    reason: str | None = None  # why not, one sentence
    note: str | None = None  # what to know even when it works


def _need(c: dict[str, Component], *names: str) -> str | None:
    """The first of ``names`` that is not ok, as a reason (its own summary says why)."""
    for n in names:
        if not c[n].ok:
            return f"{TITLES[n]}: {c[n].summary}" if c[n].status != "unknown" else f"{TITLES[n]} {c[n].summary}"
    return None


def _need_packages(c: dict[str, Component], *labels: str) -> str | None:
    """Why one of the packages ``labels`` (from :data:`PACKAGE_GROUPS`) cannot be used, or ``None``."""
    for label in labels:
        group = next(g for g, pkgs in PACKAGE_GROUPS.items() if label in pkgs)
        comp = c[group]
        if comp.status == "unknown":
            return f"{TITLES[group]} {comp.summary}"
        fact = comp.facts.get(label)
        if fact is None:
            return f"{TITLES[group]}: {comp.summary}"
        if not fact["ok"]:
            return f"{label} does not import ({fact['error']})"
    return None


def _first(*reasons: str | None) -> str | None:
    return next((r for r in reasons if r), None)


EXPORT_PKGS = ("onnx", "onnxslim")


SERVE_PKGS = ("fastapi", "uvicorn", "httpx", "tritonclient")


def _verdicts(c: dict[str, Component]) -> list[Verdict]:
    export = _first(_need(c, "torch", "onnxruntime"), _need_packages(c, *EXPORT_PKGS))
    repo = _first(_need_packages(c, "onnx", "tritonclient"))
    serve = _first(_need(c, "triton", "onnxruntime"), _need_packages(c, *SERVE_PKGS, *EXPORT_PKGS))
    gpu_triton = None if c["gpu"].ok else (
        "no NVIDIA GPU here: GPU repositories run on a GPU machine (the bundled tritonserver with the torch "
        "runtime, or NGC's container behind --triton-url)")
    ort_cuda = c["ort-cuda"]
    cuda_note = None
    if c["cuda"].ok:
        notes = []
        if not ort_cuda.ok:
            notes.append(f"its ONNX Runtime rows are skipped ({ort_cuda.summary})")
        tc = c["cuda"].facts.get("torch_compile") or {}
        if tc and not tc.get("ok"):
            notes.append(f"its torch.compile rows are skipped ({tc.get('reason')})")
        cuda_note = "; ".join(notes) or None
    pa_broken, pa_note = _bench_serve_perf_analyzer(c)
    rows = [
        ("export", export, None),
        ("quantize", _first(_need(c, "onnxruntime"),
                            _need_packages(c, "onnx", "onnxruntime.quantization", "onnxruntime float16")),
         "a registered model not yet exported is exported first (needs what export needs)"),
        ("fuse", _first(_need(c, "onnxruntime"), _need_packages(c, "onnx", "onnxscript", "onnx-ir")), None),
        ("build", None if c["tensorrt"].ok else c["tensorrt"].summary if c["tensorrt"].status != "unknown"
         else _need(c, "tensorrt"), None),
        ("repo", repo, None),
        ("repo --target gpu", repo, "writes the configs here: for NGC's tritonserver on a GPU machine, or with "
         "--runtime torch for the bundled one there"),
        ("triton", _need(c, "triton"), None),
        ("serve", serve, None),
        ("serve --target gpu", _first(gpu_triton, _need(c, "cuda"), serve),
         "the bundled tritonserver runs each model's PyTorch module on the GPU (the torch runtime; a model without "
         "one stays on the CPU); NGC's tritonserver with `unroll repo --target gpu` is the other way (--triton-url)"),
        ("optimize", serve, "without perf_analyzer it keeps the hand-set Triton configuration (the report says so)"
         if not c["perf_analyzer"].ok else None),
        ("optimize --target gpu", _first(_need(c, "cuda"), export), cuda_note),
        ("bench models", export, None),
        ("bench models --device cuda", _first(_need(c, "cuda"), export), cuda_note),
        ("bench quality", _first(export, _need_packages(c, "scikit-image", "bm3d")), None),
        ("bench serve", _first(serve, pa_broken), pa_note),
        ("bench soak", serve, None),
        ("container images", _need(c, "podman", "buildah"),
         "scripts/container_setup.sh; its gpu target also needs NGC's Triton image from nvcr.io"),
    ]
    return [Verdict(cmd, why is None, why, note if why is None else None) for cmd, why, note in rows]


def _bench_serve_perf_analyzer(c: dict[str, Component]) -> tuple[str | None, str | None]:
    """``(why bench serve cannot work, what it leaves out)`` as far as perf_analyzer decides it.

    ``benchmarks/serve_bench.py`` looks for perf_analyzer once: when none is found it carries on without it;
    when one is found, every Triton-direct level runs it and a failure (``PerfAnalyzerError``) stops the bench.
    """
    pa = c["perf_analyzer"]
    if pa.ok:
        return None, None
    if pa.status == "missing":
        return None, (f"works without its Triton-direct rows ({pa.summary}): no perf_analyzer table and no "
                      "Python-backend floor, the two Triton-direct targets read 'not measured', and the batching "
                      "and queue-delay comparisons use the Python gRPC client")
    return (f"perf_analyzer is found but {pa.status} ({pa.summary}): the bench runs it for every Triton-direct "
            "level and stops at the first failure; fix it, or remove it to run without the Triton-direct rows"), None


#: The commands ``unroll doctor`` judges, in its table's order (``--require`` takes these, or an alias).
COMMANDS = tuple(v.command for v in _verdicts({n: Component(n, "ok", "") for n in ORDER}))


ALIASES = {"repo --target cpu": "repo", "serve --target cpu": "serve", "optimize --target cpu": "optimize",
           "bench models --device cpu": "bench models",
           "container": "container images", "image": "container images"}


def resolve_command(text: str) -> str | None:
    """The :data:`COMMANDS` entry ``text`` names (``unroll `` prefix, spacing and :data:`ALIASES` allowed)."""
    words = text.split()
    key = " ".join(words[1:] if words[:1] == ["unroll"] else words)
    key = ALIASES.get(key, key)
    return key if key in COMMANDS else None


def diagnose(timeout: float = DEFAULT_TIMEOUT_S) -> dict:
    """The whole report as plain data (what ``--json`` prints)."""
    t0 = time.perf_counter()
    comps = check_all(timeout)
    verdicts = _verdicts(comps)
    return {"doctor": 1, "elapsed_s": round(time.perf_counter() - t0, 2), "timeout_s": timeout,
            "python": sys.version.split()[0], "executable": sys.executable,
            "components": {n: {"title": TITLES[n], **{k: v for k, v in asdict(c).items() if k != "name"}}
                           for n, c in comps.items()},
            "commands": [asdict(v) for v in verdicts]}
