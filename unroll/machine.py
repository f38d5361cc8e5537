"""What this machine has, found by running or importing it: the NVIDIA driver, PyTorch and CUDA, ONNX Runtime and
whether a session really runs on its CUDA/TensorRT providers, and ``nvidia-smi``.

``unroll doctor`` runs these probes in child interpreters; ``unroll bench models --device cuda`` runs them in its own
process (it needs CUDA there anyway). Each probe returns a :class:`Component` and never raises when run through
:func:`guarded`. The probes import torch, onnx and onnxruntime inside the function on purpose: an import that
fails is what a probe reports (``missing``), so it must not fail when this module is imported.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Literal

Status = Literal["ok", "missing", "unusable", "broken", "unknown"]
#: Default limit for one binary run on its own (``podman info``, the slowest, takes about a second when idle).
BINARY_TIMEOUT_S = 5.0
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


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says, else ``unknown``."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def first_line(text: str | bytes | None, limit: int = 200) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return (lines[0] if lines else "")[:limit]


def error_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {first_line(str(e)) or '(no message)'}"


def kernel_module_version(text: str) -> str | None:
    """The driver version in ``/proc/driver/nvidia/version`` (proprietary and open kernel modules)."""
    m = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    return m.group(1) if m else None


def probe_driver() -> Component:
    """The NVIDIA kernel driver (``/proc/driver/nvidia/version``) and the CUDA driver API (``libcuda.so.1``)."""
    facts: dict = {}
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        facts["kernel_module"] = kernel_module_version(text) or first_line(text)
    except OSError:
        facts["kernel_module"] = None
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        facts["libcuda"] = None
        why = first_line(str(e))
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
                                                         f"({error_line(e)})"}
    d = facts["devices"][0]
    return Component("cuda", "ok", f"CUDA {torch.version.cuda} runtime, {facts['device_count']} device(s); a kernel "
                                   f"ran on {d['name']} ({d['memory_gib']} GiB, compute {d['compute_capability']})",
                     facts)


def ort_distributions() -> dict[str, str]:
    """The ONNX Runtime wheels installed (they share the import name ``onnxruntime``) and their versions."""
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
    return first_line(log, 300) or None


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
        reason = ort_log_reason(facts["log"]) or error_line(err)
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


def guarded(name: str, probe: Callable[[], Component]) -> Component:
    """``probe()``, with any exception (an import that fails, a driver error) turned into a broken component."""
    t0 = time.perf_counter()
    try:
        c = probe()
    except ImportError as e:
        c = Component(name, "missing", f"not installed ({error_line(e)})")
    except BaseException as e:  # a probe must never take the doctor down
        c = Component(name, "broken", f"the check failed: {error_line(e)}")
    c.facts["check_s"] = round(time.perf_counter() - t0, 2)
    return c


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


def kill_group(p: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        os.killpg(p.pid, signal.SIGKILL)


def run_binary(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> Ran:
    """Run ``cmd`` in its own process group; on timeout the whole group is killed (no child outlives us)."""
    try:
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=env, start_new_session=True)
    except OSError as e:
        return Ran(None, error=error_line(e))
    try:
        out, err = p.communicate(timeout=max(timeout, 0.1))
    except subprocess.TimeoutExpired:
        kill_group(p)
        out, err = p.communicate()
        return Ran(None, out.decode(errors="replace"), err.decode(errors="replace"),
                   error=f"did not finish within {timeout:.0f} s")
    return Ran(p.returncode, out.decode(errors="replace"), err.decode(errors="replace"))


def _timed_out(r: Ran) -> bool:
    return r.rc is None and (r.error or "").startswith("did not")


def failed_component(name: str, cmd: str, r: Ran, facts: dict, prefix: str = "") -> Component:
    """A command that failed: ``broken``, or ``unknown`` when it only ran out of time (slow is not broken)."""
    return Component(name, "unknown" if _timed_out(r) else "broken", prefix + _failed(cmd, r), facts)


def _failed(cmd: str, r: Ran) -> str:
    if r.error is not None:
        return f"`{cmd}` {r.error}" if r.error.startswith("did not") else f"`{cmd}` could not run: {r.error}"
    why = first_line(r.err) or first_line(r.out) or "no output"
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
        return failed_component("nvidia-smi", "nvidia-smi --query-gpu", r, facts)
    for line in r.out.splitlines():
        vals = [v.strip() for v in line.split(",")]
        if len(vals) == len(fields):
            facts["gpus"].append(dict(zip(fields, vals, strict=True)))
    if not facts["gpus"]:
        return Component("nvidia-smi", "missing", "nvidia-smi runs but lists no GPU", facts)
    g = facts["gpus"][0]
    return Component("nvidia-smi", "ok", f"{len(facts['gpus'])} GPU(s): {g['name']}, driver {g['driver_version']}, "
                                         f"{g['memory.total']} MiB", facts)
