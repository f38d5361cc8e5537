"""Shared test set-up: deterministic, 2 threads (the CI machine's cores)."""

import os
import tempfile
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
