"""Shared test set-up: deterministic, 2 threads (the CI machine's cores)."""

import os
import tempfile
from pathlib import Path

import pytest

# `unroll optimize`'s choices change what `unroll repo` writes: the tests (and the servers they start) read an empty
# folder instead of this checkout's build/optimize (set before anything imports unroll.artifacts)
os.environ["UNROLL_OPTIMIZE_DIR"] = tempfile.mkdtemp(prefix="unroll-test-optimize-")
import torch


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
