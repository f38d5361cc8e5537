"""``unroll doctor``: what this machine can do, and which ``unroll`` commands will work here (and why not).

Every fact comes from running the thing or importing it, never from a guess:

* **binaries** (run from this process with timeouts, in parallel): ``nvidia-smi --query-gpu=…``, the
  ``tritonserver`` bundled with nvidia-pytriton (started on an empty model repository with every endpoint
  off, until it prints its ``server_version``, then stopped), ``podman --version`` + ``podman info``,
  ``buildah --version``, ``perf_analyzer --version`` (the one ``unroll bench serve`` runs: ``$UNROLL_PERF_ANALYZER``
  or ``scripts/perf_analyzer_setup.sh``'s wrapper, not one on PATH);
* **Python packages** (imported in child interpreters, so a native library that crashes or hangs on import
  is reported as broken instead of taking ``unroll doctor`` down with it): the NVIDIA driver
  (``/proc/driver/nvidia/version``, ``cuDriverGetVersion`` from ``libcuda.so.1``), PyTorch and CUDA (devices
  with name, memory and compute capability, and a kernel actually run on the first one), TensorRT
  (:func:`unroll.export.trt_build.tensorrt_available`, the check ``unroll build`` itself makes), ONNX Runtime
  (version, ``get_available_providers()``) and, for its CUDA and TensorRT execution providers, whether a
  session really runs on them: ONNX Runtime lists a provider whenever the package was built with it and
  silently falls back to the CPU when the provider's libraries do not load, so a listed provider proves
  nothing until ``session.get_providers()`` says it was taken and the session gave the right answer.

Each component ends up ``ok``, ``missing`` (not installed / not present), ``unusable`` (present, but what it
needs is not, e.g. TensorRT without a GPU), ``broken`` (present and failing: bad exit status, crash, wrong
answer) or ``unknown`` (its check did not finish within ``--timeout``). The verdict per command
(:data:`COMMANDS`) follows from the components it needs. ``unroll doctor`` always exits 0, except with
``--require CMD`` naming a command that cannot work here (exit 1) or one it does not know (exit 2).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import typer

Status = Literal["ok", "missing", "unusable", "broken", "unknown"]
#: Seconds every check together may take by default (binaries and child interpreters run in parallel).
DEFAULT_TIMEOUT_S = 8.0
#: Default limit for one binary run on its own (``podman info``, the slowest, takes about a second when idle).
BINARY_TIMEOUT_S = 5.0
#: Lines of the child interpreters' own output start with this, so libraries' prints cannot be mistaken for them.
MARKER = "@@unroll-doctor@@ "
CUDA_EP, TRT_EP = "CUDAExecutionProvider", "TensorrtExecutionProvider"


@dataclass
class Component:
    """One thing this machine has or lacks: its status, one line saying so (or why not), and the facts found."""

    name: str
    status: Status
    summary: str
    facts: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _first_line(text: str | bytes | None, limit: int = 200) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return (lines[0] if lines else "")[:limit]


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {_first_line(str(e)) or '(no message)'}"


# ============================================================================================ probes (Python)
# Each returns a Component and never raises (``_guarded``). They run in child interpreters for ``unroll doctor``
# and in-process for ``unroll bench models --device cuda``, which needs CUDA in its own process anyway.


def kernel_module_version(text: str) -> str | None:
    """The driver version in ``/proc/driver/nvidia/version`` (proprietary and open kernel modules)."""
    m = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    return m.group(1) if m else None


def probe_driver() -> Component:
    """The NVIDIA kernel driver (``/proc/driver/nvidia/version``) and the CUDA driver API (``libcuda.so.1``)."""
    facts: dict = {}
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        facts["kernel_module"] = kernel_module_version(text) or _first_line(text)
    except OSError:
        facts["kernel_module"] = None
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        facts["libcuda"] = None
        why = _first_line(str(e))
    else:
        version = ctypes.c_int(0)
        rc = libcuda.cuDriverGetVersion(ctypes.byref(version))
        if rc != 0:
            return Component("driver", "broken", f"libcuda.so.1 loads but cuDriverGetVersion failed (CUresult {rc})",
                             facts)
        facts["libcuda"] = "libcuda.so.1"
        facts["cuda_driver_api"] = f"{version.value // 1000}.{version.value % 1000 // 10}"
    if facts["kernel_module"] is None and facts.get("libcuda") is None:
        return Component("driver", "missing", f"no NVIDIA driver: /proc/driver/nvidia/version is absent and "
                                              f"libcuda.so.1 does not load ({why})", facts)
    parts = [f"kernel module {facts['kernel_module']}" if facts["kernel_module"] else None,
             f"CUDA driver API {facts['cuda_driver_api']}" if facts.get("cuda_driver_api") else None]
    return Component("driver", "ok", ", ".join(p for p in parts if p), facts)


def probe_torch() -> Component:
    """PyTorch's version and the CUDA version it was built for (``None``: a CPU-only build)."""
    import torch

    facts = {"version": torch.__version__, "cuda_build": torch.version.cuda}
    kind = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
    return Component("torch", "ok", f"torch {torch.__version__} ({kind})", facts)


def probe_cuda() -> Component:
    """CUDA through PyTorch: devices (name, memory, compute capability) and a kernel that really runs."""
    import torch

    facts: dict = {"torch": torch.__version__, "runtime": torch.version.cuda, "available": False, "devices": []}
    if torch.version.cuda is None:
        return Component("cuda", "missing", f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is "
                                            "None): a CUDA build of PyTorch is needed to use a GPU", facts)
    facts["available"] = bool(torch.cuda.is_available())
    facts["device_count"] = torch.cuda.device_count()
    if not facts["available"]:
        return Component("cuda", "missing", f"torch {torch.__version__} (built for CUDA {torch.version.cuda}) sees no "
                                            "CUDA device (torch.cuda.is_available() is False)", facts)
    for i in range(facts["device_count"]):
        p = torch.cuda.get_device_properties(i)
        facts["devices"].append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                                 "compute_capability": f"{p.major}.{p.minor}",
                                 "multiprocessors": p.multi_processor_count})
    facts["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    x = torch.arange(8, device="cuda", dtype=torch.float32)
    got = float((x * 2).sum().item())
    if got != 56.0:
        return Component("cuda", "broken", f"a kernel on {facts['devices'][0]['name']} returned {got} instead of 56",
                         facts)
    try:  # torch.compile's GPU code generator (inductor) is OpenAI Triton; without it compile fails on CUDA
        import triton

        facts["torch_compile"] = {"ok": True, "triton": getattr(triton, "__version__", "?")}
    except Exception as e:
        facts["torch_compile"] = {"ok": False, "reason": f"torch.compile needs the triton package on CUDA "
                                                         f"({_error(e)})"}
    d = facts["devices"][0]
    return Component("cuda", "ok", f"CUDA {torch.version.cuda} runtime, {facts['device_count']} device(s); a kernel "
                                   f"ran on {d['name']} ({d['memory_gib']} GiB, compute {d['compute_capability']})",
                     facts)


def probe_tensorrt() -> Component:
    """TensorRT as ``unroll build`` sees it (:func:`unroll.export.trt_build.tensorrt_available`)."""
    from unroll.export.trt_build import tensorrt_available

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


def ort_distributions() -> dict[str, str]:
    """The ONNX Runtime wheels installed (they share the import name ``onnxruntime``) and their versions."""
    from importlib import metadata

    found = {}
    for dist in ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[dist] = metadata.version(dist)
    return found


def probe_onnxruntime() -> Component:
    """ONNX Runtime: version, the wheel it came from, the providers it lists (listed is not usable: see below)."""
    import onnxruntime as ort

    facts = {"version": ort.__version__, "device": ort.get_device(), "providers": ort.get_available_providers(),
             "distributions": ort_distributions()}
    summary = f"onnxruntime {ort.__version__}; providers: {', '.join(facts['providers'])}"
    if len(facts["distributions"]) > 1:
        summary += (f" (several wheels share the import name: {', '.join(facts['distributions'])}; the last "
                    "installed wins)")
    return Component("onnxruntime", "ok", summary, facts)


PROVIDER_HINTS = {
    CUDA_EP: "pip install onnxruntime-gpu",
    TRT_EP: "pip install onnxruntime-gpu, with TensorRT's libraries on the library path",
}


def tiny_model_bytes() -> bytes:
    """A one-node ONNX graph (``y = x + x`` on ``float[4]``) to open a session on a provider with."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "unroll_doctor",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # every ONNX Runtime since 1.10 reads it
    onnx.checker.check_model(model)
    return model.SerializeToString()


@contextlib.contextmanager
def captured_stderr() -> Iterator[list[str]]:
    """Redirect file descriptor 2 (where ONNX Runtime's C++ logger writes) into a list of one string."""
    sys.stderr.flush()
    saved = os.dup(2)
    box: list[str] = []
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield box
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            box.append(tmp.read().decode(errors="replace"))


def ort_log_reason(log: str) -> str | None:
    """The first error or warning of ONNX Runtime's log, without its timestamp/source prefix."""
    for line in log.splitlines():
        if "[E:" in line or "[W:" in line:
            msg = line.split("] ", 1)[-1].strip()
            if "FAIL : " in msg:
                msg = msg.split("FAIL : ", 1)[1]
            return msg[:300]
    return _first_line(log, 300) or None


def probe_ort_provider(provider: str) -> Component:
    """Whether ONNX Runtime really runs a session on ``provider``: taken (``get_providers()[0]``) and right."""
    import numpy as np
    import onnxruntime as ort

    name = f"ort-{provider.removesuffix('ExecutionProvider').lower()}"
    facts: dict = {"provider": provider, "listed": provider in ort.get_available_providers(), "session": None}
    if not facts["listed"]:
        hint = PROVIDER_HINTS.get(provider, "a build of onnxruntime with it")
        return Component(name, "missing", f"onnxruntime {ort.__version__} has no {provider} ({hint})", facts)
    so = ort.SessionOptions()
    so.log_severity_level = 2  # warnings and errors: the reason a provider was not taken
    with captured_stderr() as log:
        try:
            providers = list(dict.fromkeys([provider, "CPUExecutionProvider"]))
            sess = ort.InferenceSession(tiny_model_bytes(), so, providers=providers)
            err = None
        except Exception as e:
            sess, err = None, e
    facts["log"] = (log[0] if log else "")[-2000:]
    if sess is None:
        reason = ort_log_reason(facts["log"]) or _error(err)
        return Component(name, "broken", f"{provider} is listed but a session on it failed: {reason}", facts)
    facts["session"] = sess.get_providers()
    if facts["session"][0] != provider:
        facts["fell_back"] = True
        reason = ort_log_reason(facts["log"]) or "ONNX Runtime fell back to the CPU without saying why"
        return Component(name, "broken", f"{provider} is listed but ONNX Runtime fell back to the CPU: {reason}",
                         facts)
    x = np.arange(4, dtype=np.float32)
    y = sess.run(None, {"x": x})[0]
    if not np.array_equal(y, x + x):
        return Component(name, "broken", f"a session on {provider} computed x + x wrong: {y.tolist()}", facts)
    return Component(name, "ok", f"a session ran on {provider} and computed the right answer", facts)


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
    import importlib
    from importlib import metadata

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
            facts[label] = {"ok": False, "error": _error(e)}
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


def guarded(name: str, probe: Callable[[], Component]) -> Component:
    """``probe()``, with any exception (an import that fails, a driver error) turned into a broken component."""
    t0 = time.perf_counter()
    try:
        c = probe()
    except ImportError as e:
        c = Component(name, "missing", f"not installed ({_error(e)})")
    except BaseException as e:  # a probe must never take the doctor down
        c = Component(name, "broken", f"the check failed: {_error(e)}")
    c.facts["check_s"] = round(time.perf_counter() - t0, 2)
    return c


def _probe_main(names: list[str]) -> None:
    """Child side: one marked JSON line per probe, flushed at once (a crash later keeps the earlier ones)."""
    for name in names:
        c = guarded(name, PROBES[name])
        sys.stdout.write(MARKER + json.dumps(asdict(c), default=str) + "\n")
        sys.stdout.flush()


# ============================================================================================ binaries


@dataclass
class Ran:
    """A finished (or killed) subprocess: exit status (``None``: did not finish), output, or why it did not run."""

    rc: int | None
    out: str = ""
    err: str = ""
    error: str | None = None  # could not be started (not executable, bad format) or timed out

    @property
    def text(self) -> str:
        return f"{self.out}\n{self.err}"


def _kill_group(p: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        os.killpg(p.pid, signal.SIGKILL)


def run_binary(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> Ran:
    """Run ``cmd`` in its own process group; on timeout the whole group is killed (no child outlives us)."""
    try:
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=env, start_new_session=True)
    except OSError as e:
        return Ran(None, error=_error(e))
    try:
        out, err = p.communicate(timeout=max(timeout, 0.1))
    except subprocess.TimeoutExpired:
        _kill_group(p)
        out, err = p.communicate()
        return Ran(None, out.decode(errors="replace"), err.decode(errors="replace"),
                   error=f"did not finish within {timeout:.0f} s")
    return Ran(p.returncode, out.decode(errors="replace"), err.decode(errors="replace"))


def _timed_out(r: Ran) -> bool:
    return r.rc is None and (r.error or "").startswith("did not")


def _failed_component(name: str, cmd: str, r: Ran, facts: dict, prefix: str = "") -> Component:
    """A command that failed: ``broken``, or ``unknown`` when it only ran out of time (slow is not broken)."""
    return Component(name, "unknown" if _timed_out(r) else "broken", prefix + _failed(cmd, r), facts)


def _failed(cmd: str, r: Ran) -> str:
    if r.error is not None:
        return f"`{cmd}` {r.error}" if r.error.startswith("did not") else f"`{cmd}` could not run: {r.error}"
    why = _first_line(r.err) or _first_line(r.out) or "no output"
    return f"`{cmd}` exited {r.rc}: {why}"


NVIDIA_SMI_FIELDS = ("name", "driver_version", "memory.total", "compute_cap")


def check_nvidia_smi(timeout: float = BINARY_TIMEOUT_S) -> Component:
    """``nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap`` (older drivers: without compute_cap)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return Component("nvidia-smi", "missing", "nvidia-smi is not on PATH")
    fields = list(NVIDIA_SMI_FIELDS)
    r = run_binary([exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"], timeout)
    if r.rc not in (0, None) and "compute_cap" in r.text:  # a driver older than the compute_cap field
        fields.remove("compute_cap")
        r = run_binary([exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"], timeout)
    facts: dict = {"path": exe, "gpus": []}
    if r.rc != 0:
        return _failed_component("nvidia-smi", "nvidia-smi --query-gpu", r, facts)
    for line in r.out.splitlines():
        vals = [v.strip() for v in line.split(",")]
        if len(vals) == len(fields):
            facts["gpus"].append(dict(zip(fields, vals, strict=True)))
    if not facts["gpus"]:
        return Component("nvidia-smi", "missing", "nvidia-smi runs but lists no GPU", facts)
    g = facts["gpus"][0]
    return Component("nvidia-smi", "ok", f"{len(facts['gpus'])} GPU(s): {g['name']}, driver {g['driver_version']}, "
                                         f"{g['memory.total']} MiB", facts)


def _version(text: str) -> str | None:
    m = re.search(r"[Vv]ersion:?\s+v?(\d[\w.\-+]*)", text)
    return m.group(1) if m else None


def check_tool(name: str, version_args: tuple[str, ...] = ("--version",), works_args: tuple[str, ...] | None = None,
               timeout: float = BINARY_TIMEOUT_S, exe: str | None = None) -> Component:
    """A tool on PATH (or at ``exe``): its version, and (``works_args``) a command that shows it really works
    (``podman info``)."""
    exe = exe or shutil.which(name)
    if exe is None:
        return Component(name, "missing", f"{name} is not on PATH")
    facts: dict = {"path": exe}
    r = run_binary([exe, *version_args], timeout)
    facts["version"] = _version(r.text)
    if r.rc != 0:
        if name == "perf_analyzer" and r.rc is not None and "Usage" in r.text:  # built before it had --version
            return Component(name, "ok", "perf_analyzer runs (it predates --version)", facts)
        return _failed_component(name, f"{name} {' '.join(version_args)}", r, facts)
    if works_args:
        w = run_binary([exe, *works_args], timeout)
        if w.rc != 0:
            return _failed_component(name, f"{name} {' '.join(works_args)}", w, facts,
                                     f"{name} {facts['version'] or ''} is installed but ")
        facts["works"] = f"{name} {' '.join(works_args)}"
    return Component(name, "ok", f"{name} {facts['version'] or '(version not reported)'}"
                     + (f"; `{facts['works']}` works" if works_args else ""), facts)


def check_perf_analyzer(timeout: float = BINARY_TIMEOUT_S) -> Component:
    """The ``perf_analyzer`` that ``unroll bench serve`` would run (:func:`unroll.benchmarks.perf_analyzer.find`),
    not one on PATH: the bench never looks there, so a verdict from PATH would not say what the bench does."""
    from unroll.benchmarks import perf_analyzer as pa

    exe = pa.find()
    if exe is None:
        return Component("perf_analyzer", "missing", pa.missing_reason())
    return check_tool("perf_analyzer", timeout=timeout, exe=str(exe))


def check_triton(timeout: float = BINARY_TIMEOUT_S) -> Component:
    """The bundled ``tritonserver``: started on an empty repository with every endpoint off until it prints its
    ``server_version``, then stopped. Read-only (unlike ``unroll triton``, it installs no backend stub)."""
    from unroll.serving import triton as tr

    facts: dict = {"pinned": tr.BUNDLED_TRITON_VERSION}
    try:
        dist = tr._distribution()
    except tr.TritonStartError as e:
        return Component("triton", "missing", str(e), facts)
    root = Path(dist.get_root_module_path()) / "tritonserver"
    binary = root / "bin" / "tritonserver"
    facts["binary"] = str(binary)
    if not binary.exists():
        return Component("triton", "broken", f"no tritonserver binary at {binary} (reinstall nvidia-pytriton)", facts)
    py = f"{sys.version_info[0]}.{sys.version_info[1]}"
    stub = Path(dist.get_stub_path(py))
    facts["python_stub"] = str(stub) if stub.exists() else None
    libs = Path(dist.get_libs_path())
    pylib = tr._python_libdir()
    env = tr.server_env(tr.ServerLayout(binary, root / "backends", (libs, pylib) if pylib else (libs,)))
    lines: list[str] = []
    found = threading.Event()
    with tempfile.TemporaryDirectory(prefix="unroll-doctor-") as repo:
        try:
            p = subprocess.Popen([str(binary), f"--model-repository={repo}", "--allow-http=false",
                                  "--allow-grpc=false", "--allow-metrics=false", "--exit-timeout-secs=1",
                                  f"--backend-directory={root / 'backends'}"],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True)
        except OSError as e:
            return Component("triton", "broken", f"tritonserver could not start: {_error(e)}", facts)

        def read() -> None:
            assert p.stdout is not None
            for raw in p.stdout:
                line = raw.decode(errors="replace").rstrip()
                lines.append(line)
                m = re.match(r"\|\s*server_version\s*\|\s*(\S+)", line)
                if m:
                    facts["version"] = m.group(1)
                    found.set()
            found.set()  # EOF: it exited

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            found.wait(timeout)
            exited = p.poll()  # not None: it ended on its own (a start-up failure)
        finally:
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(3)
            except subprocess.TimeoutExpired:
                _kill_group(p)
                p.wait(3)
            reader.join(2)
    version = facts.get("version")
    if version is None:
        tail = next((ln for ln in reversed(lines) if ln.strip()), "")[:200]
        if exited is not None:
            return Component("triton", "broken", f"tritonserver exited {exited} at start: {tail or 'no output'}", facts)
        return Component("triton", "unknown" if lines else "broken",
                         f"tritonserver did not report its version within {timeout:.0f} s"
                         + (f": {tail}" if tail else " (no output)"), facts)
    if facts["python_stub"] is None:
        return Component("triton", "broken", f"tritonserver {version} runs, but nvidia-pytriton has no Python-backend "
                                             f"stub for Python {py} (the served models cannot load)", facts)
    note = "" if version == tr.BUNDLED_TRITON_VERSION else f" (the pinned wheel ships {tr.BUNDLED_TRITON_VERSION})"
    return Component("triton", "ok", f"tritonserver {version} runs (nvidia-pytriton){note}", facts)


# ============================================================================================ the whole check


def probe_argv(names: list[str]) -> list[str]:
    """The child interpreter that runs ``names`` (:func:`_probe_main`)."""
    return [sys.executable, "-m", "unroll.app.doctor", "--probe", ",".join(names)]


def _run_children(timeout: float, children: tuple[tuple[str, ...], ...] = CHILDREN,
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
        children = pool.submit(_run_children, timeout)
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


# ============================================================================================ commands


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
        "no NVIDIA GPU here: GPU repositories run in NGC's tritonserver container on a GPU machine "
        "(point --triton-url at it)")
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
        ("repo --target gpu", repo, "writes the configs here; they run in NGC's tritonserver on a GPU machine"),
        ("triton", _need(c, "triton"), None),
        ("serve", serve, None),
        ("serve --target gpu", _first(gpu_triton, _need_packages(c, *SERVE_PKGS)),
         "needs NGC's tritonserver with the GPU repository (--triton-url); the bundled one serves cpu only"),
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
ALIASES = {"repo --target cpu": "repo", "serve --target cpu": "serve", "bench models --device cpu": "bench models",
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


# ============================================================================================ output

MARKS = {"ok": "[green]✓[/]", "missing": "[dim]✗[/]", "unusable": "[yellow]✗[/]", "broken": "[bold red]✗[/]",
         "unknown": "[yellow]?[/]"}


def render(report: dict, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    comps = Table("", "component", "status", "what was found", title="What this machine has", title_justify="left")
    for c in report["components"].values():
        comps.add_row(MARKS[c["status"]], c["title"], c["status"], escape(c["summary"]))
    console.print(comps)
    cmds = Table("", "command", "why not / note", title="Which unroll commands work here", title_justify="left")
    for v in report["commands"]:
        text = v["reason"] if not v["ok"] else (v["note"] or "")
        cmds.add_row("[green]✓[/]" if v["ok"] else "[bold red]✗[/]", f"unroll {v['command']}"
                     if v["command"] != "container images" else v["command"], escape(text or ""))
    console.print(cmds)
    console.print(f"[dim]checked in {report['elapsed_s']:.1f} s (Python {report['python']}, {report['executable']})[/]")


def doctor_command(
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON (components, commands)")] = False,
    require: Annotated[list[str] | None, typer.Option(
        "--require", help="Exit 1 unless this command can work here (repeatable), e.g. --require build, "
                          "--require 'bench models --device cuda'")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds all checks together may take (they run in parallel)")]
    = DEFAULT_TIMEOUT_S,
) -> None:
    """Report what this machine can do (GPU, driver, CUDA, TensorRT, ONNX Runtime providers, Triton, podman) and
    which unroll commands will work here, each with the reason when not.

    Every check runs the thing or imports it (in child processes with timeouts, so a broken component is
    reported, never fatal). Exit 0, or 1 when a --require'd command cannot work here.
    """
    from rich.console import Console
    from rich.markup import escape

    err = Console(stderr=True)
    wanted = []
    for r in require or []:
        cmd = resolve_command(r)
        if cmd is None:
            err.print(f"[bold red]error:[/] --require {escape(repr(r))}: not a command doctor judges; one of: "
                      + escape(", ".join(COMMANDS)))
            raise typer.Exit(2)
        wanted.append(cmd)
    if json_out:
        report = diagnose(timeout)
        sys.stdout.write(json.dumps(report, indent=2, default=str) + "\n")
    else:
        console = Console()
        with err.status("checking this machine"):
            report = diagnose(timeout)
        render(report, console)
    verdicts = {v["command"]: v for v in report["commands"]}
    failed = [verdicts[w] for w in wanted if not verdicts[w]["ok"]]
    for v in failed:
        err.print(f"[bold red]error:[/] unroll {escape(v['command'])} cannot work here: {escape(v['reason'])}")
    if failed:
        raise typer.Exit(1)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--probe":
        _probe_main([n for n in sys.argv[2].split(",") if n in PROBES])
    else:
        typer.run(doctor_command)
