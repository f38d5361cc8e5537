"""The doctor's probes that run in child interpreters (``python -m unroll.app.doctor_probes --probe NAMES``), so a
native library that crashes or hangs on import is reported as broken instead of taking ``unroll doctor`` down.

Each child prints one marked JSON line per probe (:data:`MARKER`); :func:`run_children` runs the children in
parallel under one deadline and gives the probes after a crash a fresh child.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from importlib import metadata

from unroll.machine import (
    CUDA_EP,
    TRT_EP,
    Component,
    error_line,
    guarded,
    probe_cuda,
    probe_driver,
    probe_onnxruntime,
    probe_ort_provider,
    probe_torch,
    run_binary,
)

#: Lines of the child interpreters' own output start with this, so libraries' prints cannot be mistaken for them.
MARKER = "@@unroll-doctor@@ "


def probe_tensorrt() -> Component:
    """TensorRT as ``unroll build`` sees it (:func:`unroll.export.trt_build.tensorrt_available`)."""
    from unroll.export.trt_build import tensorrt_available  # here: a failing import is what this probe reports

    ok, why = tensorrt_available()
    facts: dict = {"available": ok, "reason": None if ok else why, "version": None}
    try:
        import tensorrt

        facts["version"] = str(tensorrt.__version__)
    except ImportError:
        return Component("tensorrt", "missing", why, facts)
    except Exception:  # installed but its libraries do not load: tensorrt_available said so
        return Component("tensorrt", "broken", why, facts)
    return Component("tensorrt", "ok" if ok else "unusable", why, facts)


#: What the commands import, checked by importing it, in three groups (each its own child interpreter, so they
#: import in parallel): label → (module, distribution for the version).
PACKAGE_GROUPS: dict[str, dict[str, tuple[str, str | None]]] = {
    "export-tools": {"onnx": ("onnx", "onnx"), "onnxslim": ("onnxslim", "onnxslim"),
                     "onnxscript": ("onnxscript", "onnxscript"), "onnx-ir": ("onnx_ir", "onnx-ir"),
                     "onnxruntime.quantization": ("onnxruntime.quantization", None),
                     "onnxruntime float16": ("onnxruntime.transformers.float16", None)},
    "serve-tools": {"tritonclient": ("tritonclient.grpc.model_config_pb2", "tritonclient"),
                    "fastapi": ("fastapi", "fastapi"), "uvicorn": ("uvicorn", "uvicorn"),
                    "httpx": ("httpx", "httpx")},
    "bench-tools": {"scikit-image": ("skimage.restoration", "scikit-image"), "bm3d": ("bm3d", "bm3d")},
}


def probe_packages(group: str) -> Component:
    """Import each package of ``PACKAGE_GROUPS[group]`` (a missing or broken one is named with its error)."""
    facts: dict = {}
    for label, (module, dist) in PACKAGE_GROUPS[group].items():
        try:
            importlib.import_module(module)
            version = None
            if dist:
                with contextlib.suppress(metadata.PackageNotFoundError):
                    version = metadata.version(dist)
            facts[label] = {"ok": True, "version": version}
        except Exception as e:
            facts[label] = {"ok": False, "error": error_line(e)}
    bad = [k for k, v in facts.items() if not v["ok"]]
    if bad:
        return Component(group, "broken", f"{len(bad)} of {len(facts)} do not import: "
                                          + "; ".join(f"{k} ({facts[k]['error']})" for k in bad), facts)
    return Component(group, "ok", ", ".join(f"{k} {v['version']}" if v["version"] else k for k, v in facts.items()),
                     facts)


PROBES: dict[str, Callable[[], Component]] = {
    "driver": probe_driver,
    "torch": probe_torch,
    "cuda": probe_cuda,
    "tensorrt": probe_tensorrt,
    "onnxruntime": probe_onnxruntime,
    "ort-cuda": lambda: probe_ort_provider(CUDA_EP),
    "ort-tensorrt": lambda: probe_ort_provider(TRT_EP),
    **{g: (lambda g=g: probe_packages(g)) for g in PACKAGE_GROUPS},
}


#: Child interpreters, run in parallel; each runs its probes in order (torch is imported once per child).
CHILDREN = (("driver", "torch", "cuda", "tensorrt"), ("onnxruntime", "ort-cuda", "ort-tensorrt", "export-tools"),
            ("serve-tools",), ("bench-tools",))


def probe_main(names: list[str]) -> None:
    """Child side: one marked JSON line per probe, flushed at once (a crash later keeps the earlier ones)."""
    for name in names:
        c = guarded(name, PROBES[name])
        sys.stdout.write(MARKER + json.dumps(asdict(c), default=str) + "\n")
        sys.stdout.flush()


def probe_argv(names: list[str]) -> list[str]:
    """The child interpreter that runs ``names`` (:func:`probe_main`)."""
    return [sys.executable, "-m", "unroll.app.doctor_probes", "--probe", ",".join(names)]


def run_children(timeout: float, children: tuple[tuple[str, ...], ...] = CHILDREN,
                  argv: Callable[[list[str]], list[str]] = probe_argv) -> dict[str, Component]:
    """Run ``children`` (lists of probe names) in parallel interpreters until all reported or the time is up.

    A child that crashes (a native library's segfault) loses the probe it was in: that one is reported broken
    with the signal, and the probes after it get a fresh child.
    """
    deadline = time.monotonic() + timeout
    results: dict[str, Component] = {}

    def one(names: tuple[str, ...]) -> None:
        todo = list(names)
        while todo:
            left = deadline - time.monotonic()
            if left <= 0.1:
                for n in todo:
                    results[n] = Component(n, "unknown", f"not checked: the time ({timeout:.0f} s) was up")
                return
            r = run_binary(argv(todo), left)
            for line in r.out.splitlines():
                if line.startswith(MARKER):
                    with contextlib.suppress(ValueError, TypeError):
                        d = json.loads(line[len(MARKER):])
                        results[d["name"]] = Component(**d)
            done = [n for n in todo if n in results]
            todo = [n for n in todo if n not in results]
            if not todo:
                return
            first = todo.pop(0)
            if r.error and r.error.startswith("did not"):
                results[first] = Component(first, "unknown", f"its check did not finish within {timeout:.0f} s "
                                                             "(a busy machine, or a hang: re-run with --timeout 60)")
                for n in todo:
                    results[n] = Component(n, "unknown", f"not checked: the check of {first} used up the time")
                return
            if r.rc is not None and r.rc < 0:
                why = f"crashed Python ({signal.Signals(-r.rc).name})"
            else:
                last = next((ln.strip() for ln in reversed(r.err.splitlines()) if ln.strip()), "")
                why = f"ended its interpreter (exit {r.rc}): {last[:200] or r.error or 'no output'}"
            results[first] = Component(first, "broken", f"checking it {why}", {"reported_before_the_crash": done})

    with ThreadPoolExecutor(len(children)) as pool:
        list(pool.map(one, children))
    return results


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--probe":
        probe_main([n for n in sys.argv[2].split(",") if n in PROBES])
