"""Shared test set-up: deterministic, 2 threads (the CI machine's cores)."""

import json
import os
import resource
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

# `unroll optimize`'s choices change what `unroll repo` writes: the tests (and the servers they start) read an empty
# folder instead of this checkout's build/optimize (set before anything imports unroll.artifacts)
os.environ["UNROLL_OPTIMIZE_DIR"] = tempfile.mkdtemp(prefix="unroll-test-optimize-")
# make test runs several test processes on few cores, each starting servers and subprocesses: OpenMP threads that
# spin while they wait would burn the cores the others need (inherited by every process a test starts)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from served import shared_triton

from unroll.serving.triton import TritonHandle


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files that may take longest first (their largest ``timeout`` mark, then whether they have a ``slow``
    test; order otherwise kept): under ``make test``'s workers (one file per worker at a time) the long files start
    early instead of ending the run alone."""
    def weight(item: pytest.Item) -> tuple[float, bool]:
        mark = item.get_closest_marker("timeout")
        return (float(mark.args[0]) if mark is not None and mark.args else 0.0), bool(item.get_closest_marker("slow"))

    per_file: dict[Path, tuple[float, bool]] = {}
    for item in items:
        per_file[item.path] = max(per_file.get(item.path, (0.0, False)), weight(item))
    items.sort(key=lambda item: (-per_file[item.path][0], not per_file[item.path][1]))


#: UNROLL_TEST_CPU=PREFIX: each test process writes PREFIX.<worker>.json, the CPU seconds (user + system, its own and
#: its reaped children's: the servers a file's fixtures started and stopped) spent per test file, setup and teardown
#: included, to find where the suite's time goes (a session fixture's server counts in the process's last file)
_CPU_REPORT = os.environ.get("UNROLL_TEST_CPU")
_cpu_by_file: dict[str, float] = defaultdict(float)


def _cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    before = _cpu_s() if _CPU_REPORT else 0.0
    yield
    if _CPU_REPORT:
        _cpu_by_file[item.path.name] += _cpu_s() - before


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _CPU_REPORT:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        Path(f"{_CPU_REPORT}.{worker}.json").write_text(json.dumps({"total_s": _cpu_s(), "files": _cpu_by_file}))


@pytest.fixture(autouse=True, scope="session")
def _threads() -> None:
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def demo_onnx_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The served demo graphs (sdnet-mnist with its λ-rule companion, csc-denoiser), exported once per session
    and shared by every test module that needs an export of them."""
    from unroll.export.onnx_export import export_model

    out = tmp_path_factory.mktemp("demo_onnx")
    export_model("sdnet-mnist", out, naive=False)
    export_model("csc-denoiser", out, naive=False)
    return out


@pytest.fixture(scope="session")
def demo_triton(demo_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonHandle]:
    """The session's one tritonserver on the demo models (:func:`served.shared_triton`), started by the first test
    that asks for it; for tests that only send it requests."""
    with shared_triton(demo_onnx_dir, tmp_path_factory.mktemp("demo_triton")) as handle:
        yield handle
