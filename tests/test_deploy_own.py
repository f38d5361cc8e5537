"""The README's "bring your own model" commands, as a user runs them: a plain-PyTorch module from examples/,
exported with `unroll export --model`, fused with `unroll fuse`, served by `unroll serve --models NAME` (a model that
is not registered anywhere: its card travels in the graph), classified over HTTP like ONNX Runtime does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from served_digits import assert_served_like_onnx

from unroll.benchmarks.soak import start_serve, stop_serve
from unroll.card import from_onnx

ROOT = Path(__file__).resolve().parents[1]
NAME = "ista-digits"


def unroll_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "unroll.app.cli", *args], cwd=cwd, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


@pytest.mark.triton
@pytest.mark.slow
def test_own_module_from_examples_is_exported_fused_and_served(tmp_path: Path) -> None:
    onnx_dir = tmp_path / "onnx"
    unroll_cli("export", "--model", f"{ROOT}/examples/ista_digits.py:ista_digits", "--name", NAME, "--input-shape",
               "1,28,28", "--task", "classification", "--labels", f"{ROOT}/examples/digits.txt", "--lam-input", "lam",
               "--lam-default", "0.1", "--data-train", "mnist-train", "--data-test", "mnist-test", "--resize",
               "pad-square", "--out", str(onnx_dir), cwd=tmp_path)
    graph = onnx_dir / f"{NAME}.onnx"
    before = len(onnx.load(graph).graph.node)
    unroll_cli("fuse", str(graph), "-o", str(graph), cwd=tmp_path)  # in place: the card stays in the graph
    fused = onnx.load(graph)
    assert len(fused.graph.node) < before and not {n.op_type for n in fused.graph.node} & {"Sign", "Abs"}
    card = from_onnx(fused)
    assert card.name == NAME and card.labels[7] == "seven"

    serve = start_serve(tmp_path, [NAME], log=lambda m: None)  # serves tmp_path/onnx: where the export went
    try:
        assert f"model={NAME}" in "".join(serve.output)  # the banner's curl names the user's model
        assert_served_like_onnx(serve.base, NAME, graph, card, count=5, top_k=2)
    finally:
        stop_serve(serve)
