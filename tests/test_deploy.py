"""``unroll deploy``: new versions into the tritonserver of a running ``unroll serve``, behind its real gateway.

Everything runs the way an operator runs it: one ``unroll serve`` (its supervisor watching Triton and every
Python-backend stub, the gateway, spare ports), and ``unroll deploy`` finding that Triton from what ``unroll serve``
left in ``build/``. Under continuous load through the gateway: a full swap loses no request and moves every request
to the new version; a canary splits traffic (both versions answer, counted per version in ``/metrics``, listed in
``/v1/models``) and ``--promote`` or ``--rollback`` ends it; a version with damaged weights fails its gate against
the live version and is rolled back before any request reaches it; a graph with another model's card is refused up
front; a deployment killed half-way is finished by the next one. Triton's planned unloads and reloads never make
the supervisor replace the server (the same tritonserver throughout). Nothing is mocked.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from readme_blocks import section
from served import png

from unroll import artifacts
from unroll.benchmarks.soak import ServeProcess, start_serve, stop_serve
from unroll.data import dataset
from unroll.errors import DeployError
from unroll.pipeline.rollout import LOCK_FILE, TritonControl, deploy
from unroll.serving.running import read_state

pytestmark = pytest.mark.triton
MODEL = "sdnet-mnist"
ROOT = Path(__file__).resolve().parents[1]


README_SECTION = "Updating a served model"


@dataclass
class Served:
    base: str
    repo: Path
    triton: TritonControl
    graph: Path
    root: Path
    serve: ServeProcess
    #: The tritonserver the run started with: a planned unload must never replace it.
    triton_pid: int

    def assert_same_triton(self) -> None:
        """The supervisor replaced nothing: the first tritonserver still runs, and no stub loss was logged."""
        log = "".join(self.serve.output)
        assert self.serve.triton_pid() == self.triton_pid, log[-3000:]
        assert "lost its Python-backend stub" not in log and "restarting tritonserver" not in log, log[-3000:]


@pytest.fixture(scope="module")
def served(demo_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("deploy")  # laid out as a clone after `make serve`: build/onnx, model_repository
    onnx_dir = root / artifacts.ONNX_DIR
    shutil.copytree(demo_onnx_dir, onnx_dir)
    s = start_serve(root, [MODEL], log=lambda m: None, onnx_dir=onnx_dir, settings={"UNROLL_CATALOG_REFRESH_S": "0.5"})
    try:
        state = read_state(root / artifacts.SERVE_STATE)
        assert state is not None and state.pid == s.proc.pid, "unroll serve left no state for unroll deploy"
        key = (root / artifacts.TRITON_KEY).read_text().strip()
        pid = s.triton_pid()
        assert pid is not None
        yield Served(s.base, s.repo, TritonControl(state.triton_http, key), onnx_dir / f"{MODEL}.onnx", root, s, pid)
    finally:
        stop_serve(s)
    assert not (root / artifacts.SERVE_STATE).exists(), "unroll serve left its state file behind"


def cli(served: Served, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    """``unroll deploy MODEL ARGS`` from the served folder, as an operator types it (no Triton address: it is found);
    ``check``: it must succeed (else the failure shows its output and the end of ``unroll serve``'s)."""
    r = subprocess.run([sys.executable, "-m", "unroll.app.cli", "deploy", MODEL, *args], capture_output=True,
                       text=True, cwd=served.root, timeout=timeout)
    assert not check or r.returncode == 0, f"{r.stderr}{r.stdout}\n--- unroll serve:\n" + \
        "".join(served.serve.output)[-4000:]
    return r


class Load:
    """Two clients classifying digits through the gateway until stopped; every status kept."""

    def __init__(self, base: str) -> None:
        x, _ = dataset("mnist-test").load()
        self.bodies = [png(np.rint(np.asarray(x[i, 0]) * 255).astype(np.uint8)) for i in range(8)]
        self.base, self.statuses, self.errors = base, Counter(), []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(2)]

    def _run(self, i: int) -> None:
        with httpx.Client(base_url=self.base, timeout=60) as c:
            n = i
            while not self._stop.is_set():
                try:
                    r = c.post(f"/v1/classify?model={MODEL}", content=self.bodies[n % len(self.bodies)],
                               headers={"Content-Type": "image/png"})
                    self.statuses[r.status_code] += 1
                    if r.status_code != 200:
                        self.errors.append(r.text)
                except httpx.HTTPError as e:  # a lost request: the gateway dropped the connection
                    self.statuses["lost"] += 1
                    self.errors.append(repr(e))
                n += 2

    def wait_for(self, answered: int, timeout_s: float = 120) -> None:
        """Until ``answered`` requests have come back (sleeping: the servers need the cores)."""
        deadline = time.monotonic() + timeout_s
        while sum(self.statuses.values()) < answered and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(self.statuses.values()) >= answered, self.statuses

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


def versions(base: str, expect: dict[str, float | None]) -> dict[str, tuple[str, float | None]]:
    """The model's versions in ``/v1/models`` as ``{version: (state, traffic)}``, once the gateway lists ``expect``'s
    versions with those weights (it re-reads Triton every ``catalog_refresh_s``), else what it lists after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        body = httpx.get(base + "/v1/models", timeout=30).json()
        listed = {v["version"]: (v["state"], v["traffic"])
                  for v in next(m for m in body["models"] if m["name"] == MODEL)["versions"]}
        if {v: w for v, (_, w) in listed.items()} == expect or time.monotonic() > deadline:
            return listed
        time.sleep(0.2)


def calls_by_version(base: str) -> dict[str, float]:
    """Triton calls the gateway made to the model, by version (its round-trip histogram's counts)."""
    text = httpx.get(base + "/metrics", timeout=30).text
    pattern = rf'^unroll_gateway_triton_request_duration_seconds_count{{model="{MODEL}",outcome="ok",' \
              r'version="(\d*)"} (\S+)$'
    return {v: float(n) for v, n in re.findall(pattern, text, re.M)}


def damaged(graph: Path, out: Path) -> Path:
    """The same graph and card with its largest weight tensor shuffled: a model that answers, badly."""
    m = onnx.load(graph)
    big = max(m.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    w = numpy_helper.to_array(big).copy()
    np.random.default_rng(0).shuffle(w.reshape(-1))
    big.CopyFrom(numpy_helper.from_array(w, big.name))
    onnx.save(m, out)
    return out


def test_swap_under_load_loses_nothing(served: Served) -> None:
    before = calls_by_version(served.base)
    live = served.triton.ready_versions(MODEL)[-1]
    with Load(served.base) as load:
        r = cli(served, "--graph", str(served.graph), "--drain-s", "2", "--samples", "64", "--json")
        assert r.returncode == 0, r.stderr + r.stdout
        out = json.loads(r.stdout)
        load.wait_for(sum(load.statuses.values()) + 20)  # requests after the swap too
    assert load.statuses["lost"] == 0 and set(load.statuses) == {200}, (load.statuses, load.errors[:3])
    assert out["version"] == live + 1 and out["was"] == [live] and out["traffic"] == {str(live + 1): 100.0}
    assert out["gate"]["failures"] == [] and out["gate"]["samples"] >= 64
    assert [s["step"].split()[0] for s in out["steps"]] == ["stage", "load", "gate", "traffic:", "unloaded"]
    assert out["steps"][-1]["at_s"] - out["steps"][-2]["at_s"] >= 2  # --drain-s before the old version went
    assert out["gate"]["parity"]["top1_agreement"] == 1.0 and out["gate"]["vs_live"]["accuracy_loss"] <= 0
    assert versions(served.base, {str(live + 1): None}) == {str(live + 1): ("READY", None)}  # one version: no split
    assert served.triton.ready_versions(MODEL) == [live + 1]
    after = calls_by_version(served.base)
    assert after.get(str(live), 0) > before.get(str(live), 0) and after.get(str(live + 1), 0) > 0  # both answered
    assert (served.repo / MODEL / str(live)).is_dir()  # kept on disk: what a later deploy could bring back
    assert not (served.repo / MODEL / LOCK_FILE).exists()
    served.assert_same_triton()


def test_canary_splits_traffic_then_promote_and_rollback(served: Served) -> None:
    live = served.triton.ready_versions(MODEL)[-1]
    with Load(served.base) as load:
        out = deploy(MODEL, served.graph, served.repo, served.triton, canary=50, drain_s=1.5, samples=64,
                     say=lambda m: None)
        assert out.version == live + 1 and out.traffic == {live: 50.0, live + 1: 50.0}
        assert versions(served.base, {str(live): 50.0, str(live + 1): 50.0}) == \
            {str(live): ("READY", 50.0), str(live + 1): ("READY", 50.0)}
        before = calls_by_version(served.base)
        load.wait_for(sum(load.statuses.values()) + 60)
        after = calls_by_version(served.base)
        grew = {v: after.get(v, 0) - before.get(v, 0) for v in (str(live), str(live + 1))}
        assert all(n > 5 for n in grew.values()), grew  # both versions took a share of the requests
        r = cli(served, "--rollback", "--drain-s", "1.5")
        assert r.returncode == 0, r.stderr + r.stdout
        assert f"version {live}: 100%" in r.stdout
        assert served.triton.ready_versions(MODEL) == [live] and not (served.repo / MODEL / str(live + 1)).exists()
        # a second canary, promoted this time
        r = cli(served, "--graph", str(served.graph), "--canary", "30", "--samples", "64", "--drain-s", "1.5")
        assert r.returncode == 0 and f"version {live + 1}: 30%" in r.stdout, r.stderr + r.stdout
        r = cli(served, "--promote", "--drain-s", "1.5")
        assert r.returncode == 0 and f"version {live + 1}: 100%" in r.stdout, r.stderr + r.stdout
        load.wait_for(sum(load.statuses.values()) + 20)
    assert load.statuses["lost"] == 0 and set(load.statuses) == {200}, (load.statuses, load.errors[:3])
    assert served.triton.ready_versions(MODEL) == [live + 1]
    assert versions(served.base, {str(live + 1): None}) == {str(live + 1): ("READY", None)}
    served.assert_same_triton()


def test_a_deploy_killed_halfway_is_finished_by_the_next(served: Served) -> None:
    """``kill -9`` of a deployment once its new version is loaded with no traffic (its gate running): the service
    keeps answering from the live version, and the next ``unroll deploy`` brings the model back first, then
    deploys."""
    live = served.triton.ready_versions(MODEL)[-1]
    with Load(served.base) as load:
        proc = subprocess.Popen([sys.executable, "-m", "unroll.app.cli", "deploy", MODEL, "--graph",
                                 str(served.graph), "--samples", "256"], cwd=served.root, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        seen = []
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if "==> gate version" in line:
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait(60)
        assert proc.returncode == -signal.SIGKILL, "".join(seen)
        assert served.triton.ready_versions(MODEL) == [live, live + 1]  # left half-way: staged, no traffic
        r = cli(served, "--graph", str(served.graph), "--samples", "64", "--drain-s", "1.5")
        assert r.returncode == 0, r.stderr + r.stdout
        load.wait_for(sum(load.statuses.values()) + 20)
    assert load.statuses["lost"] == 0 and set(load.statuses) == {200}, (load.statuses, load.errors[:3])
    assert "an earlier deployment of" in r.stdout, r.stdout
    assert served.triton.ready_versions(MODEL) == [live + 1]  # the half-done version was removed, then re-staged
    assert sorted(int(p.name) for p in (served.repo / MODEL).iterdir() if p.name.isdigit())[-1] == live + 1
    assert not (served.repo / MODEL / LOCK_FILE).exists()
    assert versions(served.base, {str(live + 1): None}) == {str(live + 1): ("READY", None)}
    served.assert_same_triton()


def test_a_bad_version_fails_its_gate_and_is_rolled_back(served: Served, tmp_path: Path) -> None:
    live = served.triton.ready_versions(MODEL)
    on_disk = sorted(int(p.name) for p in (served.repo / MODEL).iterdir() if p.name.isdigit())
    bad = damaged(served.graph, tmp_path / "damaged.onnx")
    with Load(served.base) as load, pytest.raises(DeployError) as e:
        deploy(MODEL, bad, served.repo, served.triton, drain_s=1, samples=64, say=lambda m: None)
    assert "failed its gate" in str(e.value) and "vs live version" in str(e.value), e.value
    assert set(load.statuses) == {200}, load.errors[:3]  # no request reached the bad version
    assert served.triton.ready_versions(MODEL) == live
    assert sorted(int(p.name) for p in (served.repo / MODEL).iterdir() if p.name.isdigit()) == on_disk  # files gone
    assert versions(served.base, {str(v): None for v in live}) == {str(v): ("READY", None) for v in live}
    served.assert_same_triton()


def test_another_models_graph_is_refused_up_front(served: Served, demo_onnx_dir: Path) -> None:
    live = served.triton.ready_versions(MODEL)
    r = cli(served, "--graph", str(demo_onnx_dir / "csc-denoiser.onnx"), timeout=120, check=False)
    assert r.returncode != 0 and "card differs from the served model's in" in r.stderr, r.stderr
    assert "task" in r.stderr and "Traceback" not in r.stderr
    assert served.triton.ready_versions(MODEL) == live
    r = cli(served, "--promote", timeout=120, check=False)
    assert r.returncode != 0 and "no canary to promote" in r.stderr, r.stderr


def test_deploy_says_where_it_looked_when_no_triton_answers(tmp_path: Path, served: Served) -> None:
    """From a folder where no ``unroll serve`` runs: the default port, and the state file it did not find, named."""
    shutil.copytree(served.repo / MODEL, tmp_path / artifacts.REPOSITORY_DIR / MODEL,
                    ignore=shutil.ignore_patterns("[0-9]*"))
    (tmp_path / artifacts.REPOSITORY_DIR / MODEL / "1").mkdir()
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", 8000)) == 0:
            pytest.skip("something listens on 127.0.0.1:8000, the port this test needs to find silent")
    r = subprocess.run([sys.executable, "-m", "unroll.app.cli", "deploy", MODEL, "--promote"], capture_output=True,
                       text=True, cwd=tmp_path, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "UNROLL_TRITON_HTTP_URL"})
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "no unroll serve runs from here" in r.stderr and str(artifacts.SERVE_STATE) in r.stderr, r.stderr
    assert "127.0.0.1:8000" in r.stderr, r.stderr


def test_readme_commands_run_verbatim(served: Served) -> None:
    """The README's update commands, as written, from the served folder: ``unroll deploy`` finds the Triton of the
    ``unroll serve`` running there on its non-default ports by itself (export, canary, promote — under load)."""
    [block] = section(README_SECTION)
    commands = [c.text for c in block.commands]
    assert commands[0].startswith("unroll export") and any("--canary" in c for c in commands), commands
    env = {k: v for k, v in os.environ.items() if k != "UNROLL_TRITON_HTTP_URL"}
    env["PATH"] = f"{Path(sys.executable).parent}:" + os.environ["PATH"]
    live = served.triton.ready_versions(MODEL)[-1]
    with Load(served.base) as load:
        for cmd in commands:
            r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=served.root, env=env,
                               timeout=600)
            assert r.returncode == 0, f"{cmd}: {r.stderr}{r.stdout}\n--- unroll serve:\n" + \
                "".join(served.serve.output)[-4000:]
    assert load.statuses["lost"] == 0 and set(load.statuses) == {200}, (load.statuses, load.errors[:3])
    assert served.triton.ready_versions(MODEL) == [live + 1]
    served.assert_same_triton()
