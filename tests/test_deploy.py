"""``unroll deploy``: new versions into a running tritonserver (explicit model control) behind the real gateway.

Under continuous load through the gateway: a full swap loses no request and moves every request to the new version;
a canary splits traffic (both versions answer, counted per version in ``/metrics``, listed in ``/v1/models``) and
``--rollback`` ends it; a version with damaged weights fails its gate against the live version and is rolled back
before any request reaches it; a graph with another model's card is refused up front. Nothing is mocked.
"""

from __future__ import annotations

import json
import os
import re
import shutil
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

from unroll.data import dataset
from unroll.pipeline import graphs_of
from unroll.pipeline.rollout import DeployError, TritonControl, deploy
from unroll.serving.gateway.process import gateway_popen
from unroll.serving.gateway.settings import Settings
from unroll.serving.triton import free_ports, start

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


@pytest.fixture(scope="module")
def served(demo_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from unroll.serving.repository import write_repository

    root = tmp_path_factory.mktemp("deploy")  # laid out as a clone after `make serve`: build/onnx, model_repository
    onnx_dir, repo = root / "build" / "onnx", root / "model_repository"
    shutil.copytree(demo_onnx_dir, onnx_dir)
    graphs = graphs_of([MODEL], onnx_dir)  # the model, its λ rule and iteration siblings, as `unroll serve`
    write_repository("cpu", graphs, repo, onnx_dir=onnx_dir)
    http, grpc, metrics = free_ports(3)
    settings = Settings(triton_url=f"127.0.0.1:{grpc}", catalog_refresh_s=0.5)
    with start(repo, http, grpc, metrics, log_file=root / "triton.log", timeout_s=180, model_control="explicit",
               extra_args=["--exit-timeout-secs=2", *(f"--load-model={g}" for g in graphs)]), \
            gateway_popen(settings, root / "gateway.log") as (base, _):
        yield Served(base, repo, TritonControl(f"127.0.0.1:{http}"), onnx_dir / f"{MODEL}.onnx", root)


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
    with Load(served.base) as load:
        r = subprocess.run([sys.executable, "-m", "unroll.app.cli", "deploy", MODEL, "--graph", str(served.graph),
                            "--repo", str(served.repo), "--triton-url", served.triton.url, "--drain-s", "2",
                            "--samples", "64", "--json"], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert r.returncode == 0, r.stderr + r.stdout
        out = json.loads(r.stdout)
        load.wait_for(sum(load.statuses.values()) + 20)  # requests after the swap too
    assert load.statuses["lost"] == 0 and set(load.statuses) == {200}, (load.statuses, load.errors[:3])
    assert out["version"] == 2 and out["was"] == [1] and out["traffic"] == {"2": 100.0}
    assert out["gate"]["failures"] == [] and out["gate"]["samples"] >= 64
    assert [s["step"].split()[0] for s in out["steps"]] == ["stage", "load", "gate", "traffic:", "unloaded"]
    assert out["steps"][-1]["at_s"] - out["steps"][-2]["at_s"] >= 2  # --drain-s before the old version went
    assert out["gate"]["parity"]["top1_agreement"] == 1.0 and out["gate"]["vs_live"]["accuracy_loss"] <= 0
    assert versions(served.base, {"2": None}) == {"2": ("READY", None)}  # one version: no split
    assert served.triton.ready_versions(MODEL) == [2]
    after = calls_by_version(served.base)
    assert after.get("1", 0) > before.get("1", 0) and after.get("2", 0) > 0  # both answered while it ran
    assert (served.repo / MODEL / "1").is_dir()  # kept on disk: what a later deploy could bring back


def test_canary_splits_traffic_then_rolls_back(served: Served) -> None:
    live = served.triton.ready_versions(MODEL)[-1]
    out = deploy(MODEL, served.graph, served.repo, served.triton, canary=50, drain_s=1.5, samples=64,
                 say=lambda m: None)
    assert out.version == live + 1 and out.traffic == {live: 50.0, live + 1: 50.0}
    assert versions(served.base, {str(live): 50.0, str(live + 1): 50.0}) == \
        {str(live): ("READY", 50.0), str(live + 1): ("READY", 50.0)}
    before = calls_by_version(served.base)
    with Load(served.base) as load:
        load.wait_for(60)
    assert set(load.statuses) == {200}, load.errors[:3]
    after = calls_by_version(served.base)
    grew = {v: after.get(v, 0) - before.get(v, 0) for v in (str(live), str(live + 1))}
    assert all(n > 5 for n in grew.values()), grew  # both versions took a share of the requests
    r = subprocess.run([sys.executable, "-m", "unroll.app.cli", "deploy", MODEL, "--rollback", "--repo",
                        str(served.repo), "--triton-url", served.triton.url, "--drain-s", "1.5"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr + r.stdout
    assert f"version {live}: 100%" in r.stdout
    assert served.triton.ready_versions(MODEL) == [live] and not (served.repo / MODEL / str(live + 1)).exists()


def test_a_bad_version_fails_its_gate_and_is_rolled_back(served: Served, tmp_path: Path) -> None:
    live = served.triton.ready_versions(MODEL)
    bad = damaged(served.graph, tmp_path / "damaged.onnx")
    with Load(served.base) as load, pytest.raises(DeployError) as e:
        deploy(MODEL, bad, served.repo, served.triton, drain_s=1, samples=64, say=lambda m: None)
    assert "failed its gate" in str(e.value) and "vs live version" in str(e.value), e.value
    assert set(load.statuses) == {200}, load.errors[:3]  # no request reached the bad version
    assert served.triton.ready_versions(MODEL) == live
    assert sorted(int(p.name) for p in (served.repo / MODEL).iterdir() if p.name.isdigit()) == \
        sorted({1, *live})  # its files are gone
    assert versions(served.base, {str(v): None for v in live}) == {str(v): ("READY", None) for v in live}


def test_another_models_graph_is_refused_up_front(served: Served, demo_onnx_dir: Path) -> None:
    live = served.triton.ready_versions(MODEL)
    r = subprocess.run([sys.executable, "-m", "unroll.app.cli", "deploy", MODEL, "--graph",
                        str(demo_onnx_dir / "csc-denoiser.onnx"), "--repo", str(served.repo), "--triton-url",
                        served.triton.url], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode != 0 and "card differs from the served model's in" in r.stderr, r.stderr
    assert "task" in r.stderr and "Traceback" not in r.stderr
    assert served.triton.ready_versions(MODEL) == live
    r = subprocess.run([sys.executable, "-m", "unroll.app.cli", "deploy", MODEL, "--promote", "--repo",
                        str(served.repo), "--triton-url", served.triton.url], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode != 0 and "no canary to promote" in r.stderr, r.stderr


def test_readme_commands_run_verbatim(served: Served) -> None:
    """The README's update commands, as written, from the served folder (Triton's HTTP port through the variable
    ``unroll deploy`` reads, since tests never take the default ports): export, canary, promote — under load."""
    [block] = section(README_SECTION)
    commands = [c.text for c in block.commands]
    assert commands[0].startswith("unroll export") and any("--canary" in c for c in commands), commands
    env = {**os.environ, "UNROLL_TRITON_HTTP_URL": served.triton.url, "PATH": f"{Path(sys.executable).parent}:"
           + os.environ["PATH"]}
    live = served.triton.ready_versions(MODEL)[-1]
    with Load(served.base) as load:
        for cmd in commands:
            r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=served.root, env=env,
                               timeout=600)
            assert r.returncode == 0, f"{cmd}: {r.stderr}{r.stdout}"
    assert load.statuses["lost"] == 0 and set(load.statuses) == {200}, (load.statuses, load.errors[:3])
    assert served.triton.ready_versions(MODEL) == [live + 1]
