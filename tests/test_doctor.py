"""``unroll doctor`` run as a user runs it (a subprocess), its facts checked against ground truth computed here.

The ground truth is computed independently of :mod:`unroll.app.doctor` (ONNX Runtime's and PyTorch's own answers,
``shutil.which``, ``podman --version`` run here, ``importlib.util.find_spec``), so a doctor that reports what
it assumes rather than what it found fails. The checks get a generous ``--timeout`` so that a busy machine
yields facts rather than "unknown". A broken ``podman`` / ``nvidia-smi`` cannot be caused for real on a
machine where they work (or are absent), so those two are stand-in scripts first on PATH.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from unroll import machine
from unroll.app import doctor_probes, doctor_verdicts
from unroll.export.trt_build import tensorrt_available

TIMEOUT_S = "120"


def _doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("unroll")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "unroll.app.cli"]
    return subprocess.run([*cmd, "doctor", "--timeout", TIMEOUT_S, *args], capture_output=True, text=True,
                          timeout=300, env=env)


def _flat(text: str) -> str:
    """Rich wraps long lines at spaces; compare sentences with the whitespace collapsed."""
    return " ".join(text.split())


@pytest.fixture(scope="module")
def report() -> dict:
    r = _doctor("--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _provider_taken(provider: str) -> bool:
    """Ground truth for an ONNX Runtime provider: a session on a one-node graph really takes it."""
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Relu", ["a"], ["b"])], "t",
                          [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    sess = ort.InferenceSession(m.SerializeToString(), providers=[provider, "CPUExecutionProvider"])
    return sess.get_providers()[0] == provider and bool(
        np.array_equal(sess.run(None, {"a": np.array([-1, 2], np.float32)})[0], [0, 2]))


def test_components_match_ground_truth(report: dict) -> None:
    c = report["components"]
    assert list(c) == list(doctor_verdicts.ORDER)
    assert all(v["status"] != "unknown" for v in c.values()), {k: v["summary"] for k, v in c.items()}

    o = c["onnxruntime"]
    assert o["status"] == "ok" and o["facts"]["version"] == ort.__version__
    assert o["facts"]["providers"] == ort.get_available_providers()
    for name, provider in (("ort-cuda", machine.CUDA_EP), ("ort-tensorrt", machine.TRT_EP)):
        if provider not in ort.get_available_providers():
            assert c[name]["status"] == "missing" and "pip install onnxruntime-gpu" in c[name]["summary"]
        else:
            assert (c[name]["status"] == "ok") == _provider_taken(provider), c[name]

    assert c["torch"]["facts"] == {**c["torch"]["facts"], "version": torch.__version__,
                                   "cuda_build": torch.version.cuda}
    cuda = c["cuda"]
    assert cuda["facts"]["available"] == torch.cuda.is_available()
    assert (cuda["status"] == "ok") == torch.cuda.is_available()
    if torch.cuda.is_available():
        assert [d["name"] for d in cuda["facts"]["devices"]] == [
            torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        assert c["gpu"]["status"] == "ok" and c["gpu"]["facts"]["name"] == torch.cuda.get_device_name(0)
    elif torch.version.cuda is None:
        assert "CPU-only build" in cuda["summary"]
    if not torch.cuda.is_available() and shutil.which("nvidia-smi") is None:
        assert c["gpu"]["status"] == "missing" and c["nvidia-smi"]["status"] == "missing"

    ok, why = tensorrt_available()
    assert (c["tensorrt"]["status"] == "ok") == ok and c["tensorrt"]["summary"] == why

    for tool in ("podman", "buildah", "nvidia-smi"):
        if shutil.which(tool) is None:
            assert c[tool]["status"] == "missing" and "not on PATH" in c[tool]["summary"]
    if _bench_perf_analyzer() is None:
        assert c["perf_analyzer"]["status"] == "missing", c["perf_analyzer"]
        assert "scripts/perf_analyzer_setup.sh" in c["perf_analyzer"]["summary"]
    else:
        assert c["perf_analyzer"]["facts"]["path"] == str(_bench_perf_analyzer())
    for tool in ("podman", "buildah"):
        if shutil.which(tool) is not None:
            out = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=30).stdout
            assert c[tool]["facts"]["version"] and c[tool]["facts"]["version"] in out, (c[tool], out)
    if shutil.which("podman") is not None:
        info = subprocess.run(["podman", "info"], capture_output=True, text=True, timeout=60)
        assert (c["podman"]["status"] == "ok") == (info.returncode == 0), c["podman"]

    from unroll.serving.triton import BUNDLED_TRITON_VERSION

    assert c["triton"]["status"] == "ok" and c["triton"]["facts"]["version"] == BUNDLED_TRITON_VERSION

    import importlib.util

    for group, pkgs in doctor_probes.PACKAGE_GROUPS.items():
        for label, (module, _) in pkgs.items():
            assert c[group]["facts"][label]["ok"] == (importlib.util.find_spec(module) is not None), (group, label)


def _bench_perf_analyzer() -> Path | None:
    """Ground truth for the perf_analyzer ``unroll bench serve`` runs: ``$UNROLL_PERF_ANALYZER``, else the wrapper
    ``scripts/perf_analyzer_setup.sh`` writes (PATH is never consulted by the bench)."""
    env = os.environ.get("UNROLL_PERF_ANALYZER")
    p = Path(env) if env else Path(__file__).resolve().parents[1] / "build/perf_analyzer-venv/bin/perf_analyzer-run"
    return p if p.is_file() and os.access(p, os.X_OK) else None


def test_bench_serve_verdict_says_what_happens_without_perf_analyzer(report: dict) -> None:
    """Not ✓ with a silent ✗ perf_analyzer beside it: without one, bench serve runs minus its Triton-direct rows
    (the note says so); with one that fails, bench serve stops at its first perf_analyzer level (✗)."""
    pa = report["components"]["perf_analyzer"]
    bench = next(v for v in report["commands"] if v["command"] == "bench serve")
    serve = next(v for v in report["commands"] if v["command"] == "serve")
    if pa["status"] == "ok":
        assert bench["ok"] == serve["ok"] and not bench["note"], bench
    elif pa["status"] == "missing":
        assert bench["ok"] == serve["ok"], bench
        if bench["ok"]:
            assert "without its Triton-direct rows" in bench["note"] and pa["summary"] in bench["note"], bench
    else:
        assert not bench["ok"] and "perf_analyzer" in bench["reason"], bench
    # every state, judged from components built here (the same rule without depending on this machine)
    ok = {n: machine.Component(n, "ok", "", {label: {"ok": True} for label in doctor_probes.PACKAGE_GROUPS.get(n, {})})
          for n in doctor_verdicts.ORDER}
    for status, works in (("missing", True), ("broken", False), ("unknown", False)):
        comps = {**ok, "perf_analyzer": machine.Component("perf_analyzer", status, f"perf_analyzer {status}")}
        v = next(v for v in doctor_verdicts._verdicts(comps) if v.command == "bench serve")
        assert v.ok == works and ("Triton-direct" in (v.note if works else v.reason)), (status, v)


def test_commands_follow_from_what_was_found(report: dict) -> None:
    cmds = {v["command"]: v for v in report["commands"]}
    assert list(cmds) == list(doctor_verdicts.COMMANDS)
    assert all(v["reason"] for v in cmds.values() if not v["ok"])  # every ✗ says why
    assert cmds["export"]["ok"] and cmds["bench models"]["ok"]  # PyTorch + ONNX Runtime on CPU: always here
    ok, why = tensorrt_available()
    assert cmds["build"]["ok"] == ok and (ok or cmds["build"]["reason"] == why)
    assert cmds["bench models --device cuda"]["ok"] == torch.cuda.is_available()
    assert cmds["triton"]["ok"] and cmds["serve"]["ok"]  # the bundled tritonserver runs on any x86-64 Linux
    assert cmds["serve --target gpu"]["ok"] == (report["components"]["gpu"]["status"] == "ok")
    podman = report["components"]["podman"]["status"] == "ok" and report["components"]["buildah"]["status"] == "ok"
    assert cmds["container images"]["ok"] == podman
    resolve = doctor_verdicts.resolve_command
    for alias, cmd in doctor_verdicts.ALIASES.items():
        assert resolve(alias) == cmd and resolve(f"unroll  {alias}") == cmd
    assert doctor_verdicts.resolve_command("nonsense") is None


def test_require_a_command_that_cannot_work_exits_1_with_the_reason() -> None:
    ok, why = tensorrt_available()
    r = _doctor("--require", "build")
    assert r.returncode == (0 if ok else 1), r.stderr
    assert "Which unroll commands work here" in r.stdout and "unroll build" in r.stdout
    if not ok:
        assert f"unroll build cannot work here: {_flat(why)}" in _flat(r.stderr)


def test_unknown_require_is_a_usage_error() -> None:
    r = _doctor("--require", "no-such-command")
    assert r.returncode == 2 and "not a command doctor judges" in _flat(r.stderr)


def test_broken_tools_are_reported_not_fatal(tmp_path: Path) -> None:
    """A podman that exits 1 and an nvidia-smi that cannot reach the driver: reported broken, exit 0 with
    --require export (which needs neither), and the container command says why it cannot work."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "podman").write_text("#!/bin/sh\necho 'Error: cannot connect to the podman socket' >&2\nexit 1\n")
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho \"NVIDIA-SMI has failed because it couldn't communicate with "
                                     "the NVIDIA driver.\"\nexit 9\n")
    for f in fake.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ.get('PATH', '')}"}
    r = _doctor("--require", "export", "--json", env=env)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    c, cmds = rep["components"], {v["command"]: v for v in rep["commands"]}
    assert c["podman"]["status"] == "broken" and c["podman"]["facts"]["path"] == str(fake / "podman")
    assert "exited 1: Error: cannot connect to the podman socket" in c["podman"]["summary"]
    assert not cmds["container images"]["ok"] and "podman" in cmds["container images"]["reason"]
    assert c["nvidia-smi"]["status"] == "broken" and "exited 9" in c["nvidia-smi"]["summary"]
    if not torch.cuda.is_available():  # with a real GPU, PyTorch still sees it
        assert c["gpu"]["status"] == "broken" and "couldn't communicate" in c["gpu"]["summary"]
    assert cmds["export"]["ok"]


def test_a_probe_that_raises_or_hangs_is_reported() -> None:
    c = machine.guarded("x", lambda: 1 / 0)
    assert c.status == "broken" and "ZeroDivisionError" in c.summary
    r = machine.run_binary([sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5)
    assert r.rc is None and r.error and r.error.startswith("did not finish")
    r = machine.run_binary([str(Path(__file__))], timeout=5)  # not executable
    assert r.rc is None and "PermissionError" in (r.error or "")


def test_onnxruntime_log_reason() -> None:
    """The provider-failure line as ONNX Runtime logs it (microsoft/onnxruntime#17801) becomes its reason."""
    log = ("2023-10-05 21:29:53.926793500 [E:onnxruntime:Default, provider_bridge_ort.cc:1480 "
           "TryGetProviderInfo_CUDA] /onnxruntime_src/onnxruntime/core/session/provider_bridge_ort.cc:1193 "
           "onnxruntime::Provider& onnxruntime::ProviderLibrary::Get() [ONNXRuntimeError] : 1 : FAIL : Failed to "
           "load library libonnxruntime_providers_cuda.so with error: libcublasLt.so.11: cannot open shared "
           "object file: No such file or directory\n")
    assert machine.ort_log_reason(log) == ("Failed to load library libonnxruntime_providers_cuda.so with error: "
                                          "libcublasLt.so.11: cannot open shared object file: No such file or "
                                          "directory")
    assert re.match(r"^\S", machine.ort_log_reason("plain text\n") or "")


def test_provider_probe_runs_a_session_for_real() -> None:
    """The code path that decides "usable" for the CUDA/TensorRT providers, on the provider every build has."""
    c = machine.probe_ort_provider("CPUExecutionProvider")
    assert c.status == "ok" and c.facts["session"][0] == "CPUExecutionProvider"
    missing = machine.probe_ort_provider("NoSuchExecutionProvider")
    assert missing.status == "missing" and ort.__version__ in missing.summary


def test_a_child_that_crashes_loses_only_the_probe_it_was_in() -> None:
    """A real segfault (SIGSEGV sent to itself) in the second of three probes: the first keeps its result, the
    second is broken with the signal, the third runs in a fresh interpreter; a child that exits with a Python
    error is named with its last line."""
    marker = doctor_probes.MARKER
    script = ("import json, os, signal, sys\n"
              "for n in sys.argv[1].split(','):\n"
              "    if n == 'segv': os.kill(os.getpid(), signal.SIGSEGV)\n"
              "    if n == 'boom': raise SystemExit('boom: the import failed')\n"
              f"    print({marker!r} + json.dumps({{'name': n, 'status': 'ok', 'summary': n, 'facts': {{}}}}),"
              " flush=True)\n")
    got = doctor_probes.run_children(60, (("a", "segv", "c"), ("boom", "d")),
                                     lambda names: [sys.executable, "-c", script, ",".join(names)])
    assert {n: c.status for n, c in got.items()} == {"a": "ok", "segv": "broken", "c": "ok", "boom": "broken",
                                                     "d": "ok"}
    assert "crashed Python (SIGSEGV)" in got["segv"].summary and got["segv"].facts["reported_before_the_crash"] == ["a"]
    assert "exit 1" in got["boom"].summary and "boom: the import failed" in got["boom"].summary


def test_kernel_module_version_of_both_driver_flavours() -> None:
    """``/proc/driver/nvidia/version`` as the proprietary and the open kernel modules write it."""
    assert machine.kernel_module_version("NVRM version: NVIDIA UNIX x86_64 Kernel Module  520.61.05  Thu Sep 29 "
                                        "05:30:25 UTC 2022\nGCC version:  gcc version 9.4.0\n") == "520.61.05"
    assert machine.kernel_module_version("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.142  Release "
                                        "Build  (dvs-builder@U22-I3-AD05-51-5)  Tue Mar  3 19:14:46 UTC 2026\n"
                                        ) == "580.142"
    assert machine.kernel_module_version("something else") is None
