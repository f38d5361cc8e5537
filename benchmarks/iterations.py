"""``unroll bench iters``: the iteration dial — per served iteration count K, accuracy (clean and corrupted) beside
latency and CPU per request through the real gateway and tritonserver, so a user can pick the point.

Every trained digit classifier whose card lists served counts (``iters``) is measured. Accuracy: PyTorch with the
solver layers unrolled to K (each K's served graph is verified against exactly that at export) on the MNIST test
digits, clean and under every corruption of :mod:`unroll.corruptions` at severities 1–3 (the mean). Latency: the
project's load engine (:mod:`.loadgen`) at concurrency 1 posting one test digit as a PNG to ``/v1/classify?iters=K``
for ``duration_s`` after :data:`WARMUP_S` of warm-up, with the CPU each process kind spent per request (the engine's
own among them). Writes ``iterations.{json,md,png}``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

import unroll
from unroll import artifacts, data, pipeline
from unroll.benchmarks import loadgen
from unroll.benchmarks.common import (
    RESULTS,
    latency_summary,
    machine_info,
    png_bytes,
    write_docs_blocks,
    write_results,
)
from unroll.benchmarks.plots import iterations_plot
from unroll.benchmarks.processes import cpu_by_pid, cpu_ms_per_request
from unroll.benchmarks.robustness import TEST_SEED, digit_classifiers
from unroll.benchmarks.serve_triton import triton_server
from unroll.corruptions import CORRUPTIONS, SEVERITIES, corrupt
from unroll.errors import BenchError
from unroll.evaluation import accuracy
from unroll.export.onnx_export import resolve_card
from unroll.registry import get_spec
from unroll.serving.gateway.process import gateway_process
from unroll.serving.gateway.settings import Settings
from unroll.solvers.iterations import set_iterations

#: Unmeasured seconds of load before each count's measured window (the first calls fill caches).
WARMUP_S = 2.0


def dial_models() -> list[str]:
    """Trained digit classifiers whose card serves several iteration counts."""
    return [n for n in digit_classifiers() if get_spec(n).card.iters is not None]


def counts_of(name: str) -> tuple[int, tuple[int, ...]]:
    """A model's trained count and every served count (its card, the default filled in as export does)."""
    card = resolve_card(get_spec(name).card, unroll.load(name), lam_input=True)
    assert card.iters is not None and card.iters.default is not None
    return card.iters.default, card.iters.counts


def accuracy_per_count(name: str, corruptions: Sequence[str], n_test: int | None,
                       tick: Callable[[], None] = lambda: None) -> dict[int, dict]:
    """Per served K: clean accuracy and the mean over ``corruptions`` × severities on the test digits."""
    _, counts = counts_of(name)
    x, y = data.dataset(get_spec(name).card.data.test).load()
    x, y = np.asarray(x[:n_test], np.float32), np.asarray(y[:n_test])
    corrupted = [torch.from_numpy(corrupt(x, c, s, TEST_SEED)) for c in corruptions for s in SEVERITIES]
    out = {}
    for k in counts:
        model = set_iterations(unroll.load(name), k)
        per_set = [accuracy(model, xc, y) for xc in corrupted]
        out[k] = {"clean": accuracy(model, torch.from_numpy(x), y), "mean_corrupted": float(np.mean(per_set))}
        tick()
    return out


def one_count(base: str, path: str, body: bytes, duration_s: float) -> dict:
    """One count's level: the load engine at concurrency 1 posting ``body`` to ``path``; latency, throughput, failed
    requests, CPU ms per request by process kind and the engine's own."""
    snap: dict = {}
    res = loadgen.run(base, [loadgen.Payload(path, body, {"Content-Type": "image/png"})], loadgen.Load(concurrency=1),
                      duration_s, WARMUP_S, on_measure_start=lambda: snap.update(cpu_by_pid()))
    return {"requests": res.ok, "failed": res.sent - res.ok, "errors": dict(res.errors),
            "error_samples": list(res.error_samples), "throughput_rps": res.throughput,
            "latency_ms": latency_summary(res.latencies_ms),
            "cpu_ms_per_request": cpu_ms_per_request(snap, cpu_by_pid(), res.ok),
            "client_cpu_ms_per_request": res.cpu_ms_per_request}


def latency_per_count(models: Sequence[str], duration_s: float, onnx_dir: Path,
                      tick: Callable[[], None] = lambda: None) -> dict[str, dict[int, dict]]:
    """Per model and served K: :func:`one_count` through the gateway. The repository is written by the pipeline, as
    ``unroll serve`` writes it."""
    body = png_bytes(np.asarray(data.dataset("mnist-test").load()[0][0, 0], np.float32))
    out: dict[str, dict[int, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="unroll-iters-") as tmp:
        repo = Path(tmp) / "repo"
        # every count with the same configuration (the defaults, FP32): not one `unroll optimize` chose for one graph
        options = pipeline.RepoOptions(optimized=False)
        pipeline.run(pipeline.plan(models, onnx_dir=onnx_dir, repo=repo, options=options), progress=None)
        with triton_server(repo, Path(tmp) / "triton.log") as (_, grpc), \
                gateway_process(Settings(triton_url=grpc.removeprefix("grpc://")), Path(tmp) / "gw.log") as base:
            for name in models:
                out[name] = {}
                for k in counts_of(name)[1]:
                    run = one_count(base, f"/v1/classify?model={name}&iters={k}", body, duration_s)
                    if run["failed"] or not run["requests"]:
                        sent = run["failed"] + run["requests"]
                        raise BenchError(f"{name} iters={k}: {run['failed']} of {sent} requests failed "
                                         f"({'; '.join(run['error_samples']) or 'none answered'}; gateway log: "
                                         f"{Path(tmp) / 'gw.log'})")
                    out[name][k] = run
                    tick()
    return out


def run(models: Sequence[str] | None = None, corruptions: Sequence[str] | None = None, n_test: int | None = None,
        duration_s: float = 3.0, onnx_dir: Path = artifacts.ONNX_DIR, out_dir: Path | None = RESULTS,
        tick: Callable[[], None] = lambda: None) -> dict:
    """Measure ``models`` (default :func:`dial_models`) on ``corruptions`` (default: all); ``n_test`` digits."""
    names = list(models or dial_models())
    chosen = list(corruptions or CORRUPTIONS)
    lat = latency_per_count(names, duration_s, onnx_dir, tick)
    payload = {"benchmark": "iterations", "machine": machine_info(torch.get_num_threads()),
               "corruptions": chosen, "severities": list(SEVERITIES), "duration_s": duration_s, "warmup_s": WARMUP_S,
               "concurrency": 1,
               "models": {}}
    for name in names:
        trained, _ = counts_of(name)
        acc = accuracy_per_count(name, chosen, n_test, tick)
        payload["models"][name] = {"trained": trained, "test_digits": n_test or "all", "counts": [
            {"iters": k, **acc[k], "latency_ms": lat[name][k]["latency_ms"],
             "throughput_rps": lat[name][k]["throughput_rps"], "requests": lat[name][k]["requests"],
             "cpu_ms_per_request": lat[name][k]["cpu_ms_per_request"],
             "client_cpu_ms_per_request": lat[name][k]["client_cpu_ms_per_request"]} for k in sorted(acc)]}
    if out_dir is not None:
        write_results("iterations", payload, markdown(payload), Path(out_dir))
        iterations_plot(payload, Path(out_dir))
        if Path(out_dir).resolve() == RESULTS.resolve():
            write_docs_blocks(RESULTS.parent.parent, README_BEGIN, README_END, readme_block(payload))
    return payload


def _pct(v: float) -> str:
    return f"{100 * v:.1f}"


def markdown(p: dict) -> str:
    """One table per model: K, clean and mean corrupted accuracy, gateway latency and CPU per request."""
    lines = [f"# The iteration dial (`iters=K`) ({p['machine']['cpu']})", "", "![accuracy vs latency per "
             "iteration count](iterations.png)", "",
             "Per served iteration count K of each model's weight-tied solver layers: top-1 accuracy (%) on the MNIST "
             "test digits, clean and the mean over " + f"{len(p['corruptions'])} corruptions × severities "
             f"{', '.join(map(str, p['severities']))}; latency of `POST /v1/classify?iters=K` through the gateway and "
             f"tritonserver (FP32 graphs, each with the default configuration; the load engine, closed loop at "
             f"concurrency {p['concurrency']}, {p['duration_s']:g} s per K after {p.get('warmup_s', WARMUP_S):g} s of "
             "warm-up, one digit PNG) and "
             "CPU ms per request by process (gateway, tritonserver, its backend processes). The trained count is "
             "marked *; every other count is the same weights unrolled further or less, never trained at that depth.",
             ""]
    for name, m in p["models"].items():
        lines += [f"## {name}", "", "| iters | clean | mean corrupted | p50 ms | p95 ms | req/s | CPU ms/req "
                  "(gateway + triton + backends) |", "|---|---|---|---|---|---|---|"]
        for r in m["counts"]:
            cpu = r["cpu_ms_per_request"] or {}
            split = " + ".join(f"{cpu.get(kind, 0.0):.2f}" for kind in ("gateway", "tritonserver", "backends"))
            mark = "*" if r["iters"] == m["trained"] else ""
            lines.append(f"| {r['iters']}{mark} | {_pct(r['clean'])} | {_pct(r['mean_corrupted'])} | "
                         f"{r['latency_ms']['p50']:.2f} | {r['latency_ms']['p95']:.2f} | {r['throughput_rps']:.0f} | "
                         f"{split} |")
        lines.append("")
    return "\n".join(lines)


#: The README's iteration-dial table sits between these markers; :func:`run` rewrites it from iterations.json.
README_BEGIN = "<!-- iterations: generated from benchmarks/results/iterations.json -->"
README_END = "<!-- /iterations -->"


def readme_block(p: dict) -> str:
    """The README's table: per model and K, accuracy beside latency and CPU per request, and which K did best
    (numbers from the results, never typed by hand)."""
    lines = ["| model | iters | clean % | mean corrupted % | gateway p50 ms | CPU ms/request |",
             "|---|---|---|---|---|---|"]
    notes = []
    for name, m in p["models"].items():
        for r in m["counts"]:
            cpu = sum((r["cpu_ms_per_request"] or {}).get(k, 0.0) for k in ("gateway", "tritonserver", "backends"))
            mark = " (trained)" if r["iters"] == m["trained"] else ""
            lines.append(f"| {name} | {r['iters']}{mark} | {_pct(r['clean'])} | {_pct(r['mean_corrupted'])} | "
                         f"{r['latency_ms']['p50']:.2f} | {cpu:.2f} |")
        best = max(m["counts"], key=lambda r: (r["mean_corrupted"], -r["iters"]))
        notes.append(f"{name}: the most robust count is {best['iters']} (trained: {m['trained']})")
    return "\n".join([*lines, "", "; ".join(notes) + ". From [`iterations.md`](benchmarks/results/iterations.md) "
                      "(`unroll bench iters`), where the machine and the per-process CPU split are."])
