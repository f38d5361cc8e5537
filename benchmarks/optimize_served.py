"""The served model against ``torch.compile``, in one run: Triton direct p50 with the chosen configuration vs the
same model compiled in process, on each benchmark case.

Triton runs the repository ``unroll repo`` would write from the choice; requests are the case's tensors over gRPC,
one at a time, sent by ``perf_analyzer`` (Triton's own C++ client, the project's reference for Triton-direct numbers;
without it, by ``tritonclient`` in this process, and the result says which). Triton is stopped before PyTorch is
timed, so neither competes with the other for the cores.
``torch.compile`` gets the same thread count and ``dynamic=False`` (one compilation per case, not timed).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from unroll.benchmarks import perf_analyzer
from unroll.benchmarks.common import time_call
from unroll.benchmarks.serve_load import Workload, triton_grpc_client
from unroll.benchmarks.serve_triton import triton_server
from unroll.card import ModelCard
from unroll.serving.repository import write_repository

TIME_PER_CASE_S = 3.0


def _triton_p50(name: str, card: ModelCard, timing: list, repo_kwargs: dict, onnx_dir: Path, aoti_dir: Path,
                progress: Callable[[str], None]) -> dict[str, dict]:
    out = {}
    with tempfile.TemporaryDirectory(prefix="unroll-served-") as tmp:
        repo = Path(tmp) / "repo"
        write_repository("cpu", [name], repo, onnx_dir=onnx_dir, aoti_dir=aoti_dir, **repo_kwargs)
        progress(f"{name}: Triton direct with the chosen configuration")
        with triton_server(repo, Path(tmp) / "triton.log") as (_, grpc):
            for label, feeds in timing:
                if perf_analyzer.find() is not None:
                    row = perf_analyzer.measure(name, grpc, [feeds], 1, batching=repo_kwargs["max_batch_size"] > 0)
                    out[label] = {"median_ms": row["latency_ms"]["p50"], "p90_ms": row["latency_ms"]["p90"],
                                  "client": "perf_analyzer"}
                    continue
                w = Workload(label, name, label, [feeds], [], "", card.output)
                call, close = triton_grpc_client(grpc, w)()
                try:
                    out[label] = time_call(lambda call=call: call(0), warmup=5, max_repeats=500,
                                           budget_s=TIME_PER_CASE_S) | {"client": "tritonclient (Python)"}
                finally:
                    close()
    return out


def _compiled_p50(name: str, timing: list, threads: int, progress: Callable[[str], None]) -> dict[str, dict]:
    import torch

    import unroll
    from unroll.benchmarks.models_inputs import torch_call

    torch.set_num_threads(threads)
    model = unroll.load(name).eval()
    compiled = torch.compile(model, dynamic=False)
    out = {}
    for label, feeds in timing:
        progress(f"{name}: torch.compile in process, {label} (compiling)")
        tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in feeds.items()}
        with torch.inference_mode():
            call = torch_call(compiled, name, tensors)
            out[label] = time_call(call, warmup=3, max_repeats=500, budget_s=TIME_PER_CASE_S)
    return out


def served_vs_compile(name: str, card: ModelCard, timing: list, repo_kwargs: dict, onnx_dir: Path, aoti_dir: Path,
                      threads: int, progress: Callable[[str], None]) -> dict:
    """Rows per case: Triton direct p50 (served), ``torch.compile`` p50 and their ratio (≥ 1: served is faster)."""
    served = _triton_p50(name, card, timing, repo_kwargs, onnx_dir, aoti_dir, progress)
    compiled = _compiled_p50(name, timing, threads, progress)
    rows = []
    for label, _ in timing:
        s, c = served[label]["median_ms"], compiled[label]["median_ms"]
        rows.append({"case": label, "served_p50_ms": s, "compile_p50_ms": c, "compile_over_served": c / s,
                     "client": served[label]["client"],
                     "served_p90_ms": served[label]["p90_ms"], "compile_p90_ms": compiled[label]["p90_ms"]})
    return {"threads": threads, "repository": repo_kwargs, "rows": rows,
            "method": "Triton direct (gRPC tensors, one request at a time, p50 as the client measures it) vs "
                      "torch.compile(dynamic=False) in process; Triton stopped before PyTorch runs"}
