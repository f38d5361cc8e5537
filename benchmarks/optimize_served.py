"""The served model against ``torch.compile``, in one run: Triton direct p50 with the chosen configuration vs the
same model compiled in process, on each benchmark case.

Triton runs the repository ``unroll repo`` would write from the choice; requests are the case's tensors over gRPC,
one at a time (a case whose batch exceeds the served max batch is skipped, with the reason), sent by
``perf_analyzer`` for batch 1 (Triton's own C++ client, the project's reference for Triton-direct numbers; else by
the project's load engine, :mod:`.loadgen`, over gRPC in this process, and the row says which). The two sides
alternate in :data:`ROUNDS` rounds, so a slow spell of the machine falls on both; Triton idles (no CPU) while
PyTorch runs, and PyTorch idles while Triton serves. ``torch.compile`` gets the same thread count and
``dynamic=False`` (compiled once per case, not timed).
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from unroll.benchmarks import loadgen, perf_analyzer
from unroll.benchmarks.common import time_call
from unroll.benchmarks.serve_triton import triton_server
from unroll.card import ModelCard
from unroll.errors import BenchError
from unroll.serving.repository import write_repository

ROUNDS = 3
TIME_PER_ROUND_S = 1.0


def _compiled_calls(name: str, timing: list, threads: int, progress: Callable[[str], None]) -> dict[str, Callable]:
    """``torch.compile``'d calls per case, each compiled (by a first call) before any timing."""
    import torch

    import unroll
    from unroll.benchmarks.models_inputs import torch_call

    torch.set_num_threads(threads)
    compiled = torch.compile(unroll.load(name).eval(), dynamic=False)
    calls = {}
    for label, feeds in timing:
        progress(f"{name}: torch.compile, {label} (compiling)")
        tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in feeds.items()}
        call = torch_call(compiled, name, tensors)

        def run(call: Callable = call) -> object:
            with torch.inference_mode():
                return call()

        run()
        calls[label] = run
    return calls


def _served_p50(name: str, card: ModelCard, grpc: str, label: str, feeds: dict, batching: bool) -> tuple[float, str]:
    batch = next(iter(feeds.values())).shape[0]
    if batch == 1 and perf_analyzer.find() is not None:
        row = perf_analyzer.measure(name, grpc, [feeds], 1, window_ms=1000, max_trials=4, batching=batching)
        return row["latency_ms"]["p50"], "perf_analyzer"
    res = loadgen.run(f"grpc://{grpc}", [loadgen.Tensors(name, feeds, (card.output,))], loadgen.Load(concurrency=1),
                      TIME_PER_ROUND_S, warmup_s=0.2)
    if res.errors or not res.ok:
        raise BenchError(f"{name} {label} through Triton: {'; '.join(res.error_samples) or 'no answer'}")
    return res.percentile(50), "the load engine (gRPC, Python)"


def served_vs_compile(name: str, card: ModelCard, timing: list, repo_kwargs: dict, onnx_dir: Path, aoti_dir: Path,
                      threads: int, progress: Callable[[str], None]) -> dict:
    """Rows per case: Triton direct p50 (served), ``torch.compile`` p50 and their ratio (≥ 1: served is faster);
    each the median of its rounds' p50s."""
    max_batch = repo_kwargs["max_batch_size"]
    skipped = {lb: f"batch {next(iter(f.values())).shape[0]} exceeds the served max batch {max_batch}"
               for lb, f in timing if next(iter(f.values())).shape[0] > max(1, max_batch)}
    cases = [(lb, f) for lb, f in timing if lb not in skipped]
    calls = _compiled_calls(name, cases, threads, progress)
    served: dict[str, list[float]] = {lb: [] for lb, _ in cases}
    compiled: dict[str, list[float]] = {lb: [] for lb, _ in cases}
    clients = {}
    with tempfile.TemporaryDirectory(prefix="unroll-served-") as tmp:
        repo = Path(tmp) / "repo"
        write_repository("cpu", [name], repo, onnx_dir=onnx_dir, aoti_dir=aoti_dir, **repo_kwargs)
        with triton_server(repo, Path(tmp) / "triton.log") as (_, grpc):
            for i in range(ROUNDS):
                for label, feeds in cases:
                    progress(f"{name}: served vs torch.compile, {label} (round {i + 1} of {ROUNDS})")
                    p50, clients[label] = _served_p50(name, card, grpc, label, feeds, max_batch > 0)
                    served[label].append(p50)
                    compiled[label].append(time_call(calls[label], warmup=3, max_repeats=500,
                                                     budget_s=TIME_PER_ROUND_S)["median_ms"])
    rows = []
    for label, _ in timing:
        if label in skipped:
            rows.append({"case": label, "skipped": skipped[label]})
            continue
        s, c = statistics.median(served[label]), statistics.median(compiled[label])
        rows.append({"case": label, "served_p50_ms": s, "compile_p50_ms": c, "compile_over_served": c / s,
                     "client": clients[label], "served_rounds_ms": served[label], "compile_rounds_ms": compiled[label]})
    return {"threads": threads, "repository": repo_kwargs, "rows": rows, "rounds": ROUNDS,
            "method": f"Triton direct (gRPC tensors, one request at a time, p50 as the client measures it) vs "
                      f"torch.compile(dynamic=False) in process, alternating in {ROUNDS} rounds (median of the "
                      "rounds' p50s)"}
