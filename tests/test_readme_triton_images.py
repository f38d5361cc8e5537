"""The README's "## Triton direct with an image" commands, run verbatim against a real tritonserver.

A clone-like directory holds the samples `make serve` writes (``build/samples``, by ``unroll.app.serve.write_samples``)
and the perf_analyzer virtualenv (a link to this checkout's, set up by ``scripts/perf_analyzer_setup.sh``); Triton
serves the demo models' CPU configs on free ports. curl is pointed at it by its own config file (``connect-to``
127.0.0.1:8000 → the test's port, as ``tests/readme_run.py`` does for the gateway), perf_analyzer by the
``TRITON_HTTP`` variable its README line reads. Not one character of a command is rewritten. Each command must exit
0; then what it wrote is checked: the classifier's top label is the sample's, the denoised file is a PNG of the
sample's size, perf_analyzer reports a throughput. Without perf_analyzer its lines are skipped with the reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image
from readme_blocks import section

from unroll.card import from_onnx
from unroll.serving import triton
from unroll.serving.repository import write_repository
from unroll.serving.triton import free_ports

SECTION = "Triton direct with an image"
MODELS = ["sdnet-mnist", "sdnet-mnist-autolam", "csc-denoiser"]

pytestmark = [pytest.mark.triton, pytest.mark.slow, pytest.mark.timeout(600)]


@dataclass
class Clone:
    cwd: Path
    env: dict[str, str]
    grpc: int

    def run(self, command: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", command], cwd=self.cwd, env=self.env, capture_output=True, timeout=180)


@pytest.fixture(scope="module")
def clone(demo_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Clone]:
    from unroll.app.serve import write_samples
    from unroll.benchmarks import perf_analyzer as pa

    root = tmp_path_factory.mktemp("clone")
    repo = root / "model_repository"
    write_repository("cpu", MODELS, repo, onnx_dir=demo_onnx_dir)
    write_samples(root / "build" / "samples", [from_onnx(demo_onnx_dir / f"{m}.onnx") for m in MODELS])
    found = pa.find()
    if found is not None and found == pa.DEFAULT_WRAPPER:
        (root / "build" / "perf_analyzer-venv").symlink_to(found.parent.parent)
    http, grpc, metrics = free_ports(3)
    curl = root / ".curl"
    curl.mkdir()
    (curl / ".curlrc").write_text(f'connect-to = "127.0.0.1:8000:127.0.0.1:{http}"\n'
                                  "fail-with-body\nsilent\nshow-error\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UNROLL_", "CURL_", "TRITON_"))}
    env.update(PATH=os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]),
               CURL_HOME=str(curl), TRITON_HTTP=f"127.0.0.1:{http}")
    handle = triton.start(repo, http, grpc, metrics, log_file=root / "triton.log", timeout_s=120,
                          extra_args=["--exit-timeout-secs=2"])
    try:
        yield Clone(root, env, grpc)
    finally:
        handle.stop()


def _commands() -> list[str]:
    return [c.text for b in section(SECTION) for c in b.commands]


def test_section_has_the_curl_and_perf_analyzer_examples() -> None:
    cmds = _commands()
    assert sum("curl " in c for c in cmds) == 2 and any("perf_analyzer" in c for c in cmds), cmds
    for c in cmds:
        for url in re.findall(r"https?://[^\s'\"]+", c):
            assert url.startswith("http://127.0.0.1:8000/v2/models/"), url


def _run_curls(clone: Clone, commands: list[str]) -> int:
    """Run ``commands`` in the clone (each must exit 0); check the classifier's top label and the denoised file."""
    ran = 0
    for cmd in commands:
        if "perf_analyzer-run" in cmd and not (clone.cwd / "build" / "perf_analyzer-venv").exists():
            continue  # reported by the test below
        r = clone.run(cmd)
        out, err = r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")
        assert r.returncode == 0, f"{cmd}\nexit {r.returncode}\n{err[-2000:]}\n{out[-2000:]}"
        if "/v2/models/sdnet-mnist/infer" in cmd:
            body = json.loads(out)
            labels = body["outputs"][0]["data"]
            label = (clone.cwd / "build" / "samples" / "sdnet-mnist.label.txt").read_text().strip()
            assert len(labels) == 3 and labels[0].split(":")[2] == label, body
        if "perf_analyzer-run" in cmd:
            assert "throughput" in out.lower(), out[-2000:]
        ran += 1
    with Image.open(clone.cwd / "denoised.png") as got, \
            Image.open(clone.cwd / "build" / "samples" / "csc-denoiser.png") as sent:
        assert got.format == "PNG" and got.size == sent.size and got.mode == sent.mode
    return ran


def test_section_commands_run_verbatim(clone: Clone) -> None:
    assert _run_curls(clone, _commands()) >= 5


def test_the_same_requests_sent_to_the_gateways_v2_front_get_the_same_answers(clone: Clone) -> None:
    """The section's promise for `unroll serve`, whose Triton needs a key: the gateway's ``/v2`` front takes these
    very requests (curl pointed at the gateway instead of Triton; not one character rewritten) and answers them."""
    from unroll.serving.gateway.process import gateway_process
    from unroll.serving.gateway.settings import Settings

    (clone.cwd / "denoised.png").unlink(missing_ok=True)
    with gateway_process(Settings(triton_url=f"127.0.0.1:{clone.grpc}"), clone.cwd / "gateway.log") as base:
        port = base.rsplit(":", 1)[1]
        curl = clone.cwd / ".curl-gateway"
        curl.mkdir(exist_ok=True)
        (curl / ".curlrc").write_text(f'connect-to = "127.0.0.1:8000:127.0.0.1:{port}"\n'
                                      "fail-with-body\nsilent\nshow-error\n")
        gateway = Clone(clone.cwd, {**clone.env, "CURL_HOME": str(curl)}, clone.grpc)
        assert _run_curls(gateway, [c for c in _commands() if "perf_analyzer" not in c]) >= 4


def test_perf_analyzer_line_needs_the_tool(clone: Clone) -> None:
    if not (clone.cwd / "build" / "perf_analyzer-venv").exists():
        pytest.skip("perf_analyzer is not set up here (bash scripts/perf_analyzer_setup.sh): its README line "
                    "was not run")
    assert shutil.which("python3", path=clone.env["PATH"])
