"""The project's load engine against ``perf_analyzer`` on the gateway's ``/v2`` front, at the same request rates.

Both clients send the classifier's test digits (the same tensors, binary, batch 1) to one gateway in front of one
tritonserver, open loop at the same rate and arrival distribution; per level, each one's p50 latency and
throughput (answers per second) and the engine's own CPU per request. The issue's bar: the engine agrees with
``perf_analyzer`` within :data:`TOLERANCE` on both, so the client is not what a profile measures.

Where the two differ by construction: ``perf_analyzer`` times each request from its actual send and reports the
average of its last stable measurement windows (:data:`WINDOW_MS` each); the engine times from the *scheduled*
send (the same below capacity, larger when the client falls behind) over one window as long as those windows
together. Each level runs ``perf_analyzer`` first, then the engine, on a server already warm.

``python -m unroll.benchmarks.profile_agreement`` writes ``profile_agreement.json`` and ``.md`` into
``benchmarks/results`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from unroll import artifacts, pipeline
from unroll.benchmarks import loadgen
from unroll.benchmarks import perf_analyzer as pa
from unroll.benchmarks.common import RESULTS, exported_card, machine_info, write_results
from unroll.benchmarks.serve_load import as_batch, classify_workload, served_models
from unroll.benchmarks.serve_triton import triton_server
from unroll.errors import BenchError
from unroll.serving.gateway.process import GatewayStartError, gateway_process
from unroll.serving.gateway.settings import Settings
from unroll.serving.repository import write_repository

TOLERANCE = 0.10
#: Below the classifier's capacity here, and high enough that a Poisson level's count of answers (its own random
#: draw, different for each client) varies by a few percent only, not by the bar itself.
RATES = (40.0, 80.0)
DISTRIBUTIONS = ("constant", "poisson")
WINDOW_MS = 4000
#: perf_analyzer reports its last three windows; the engine measures as long.
WINDOWS = 3
SAMPLES = 64


def _engine(base: str, payloads: Sequence[loadgen.Payload], rate: float, distribution: str,
            window_ms: int = WINDOW_MS) -> dict:
    r = loadgen.run(base, payloads, loadgen.Load(rate=rate, arrivals=distribution), WINDOWS * window_ms / 1e3,
                    warmup_s=2.0)
    if r.client_bound:
        raise BenchError(f"the engine could not send {rate:g} req/s {distribution}: {r.client_bound}")
    return {"p50_ms": r.percentile(50), "p99_ms": r.percentile(99), "throughput_rps": r.throughput,
            "sent": r.sent, "errors": dict(r.errors), "client_cpu_ms_per_request": r.cpu_ms_per_request,
            "late_p99_ms": r.late_p99_ms}


def _perf_analyzer(model: str, gateway: str, feeds: list[dict], rate: float, distribution: str,
                   window_ms: int = WINDOW_MS) -> dict:
    row = pa.measure(model, gateway.removeprefix("http://"), feeds, 1, window_ms=window_ms, rate=rate,
                     distribution=distribution, protocol="http")
    return {"p50_ms": row["latency_ms"]["p50"], "p99_ms": row["latency_ms"].get("p99"),
            "throughput_rps": row["throughput_rps"], "stable": row["stable"], "command": row["command"]}


def _ratio(engine: float, reference: float) -> float:
    return engine / reference - 1.0


def run(rates: Sequence[float] = RATES, distributions: Sequence[str] = DISTRIBUTIONS,
        onnx_dir: Path = artifacts.ONNX_DIR, log: Callable[[str], None] = print, window_ms: int = WINDOW_MS) -> dict:
    """Start tritonserver and a gateway on the classifier, measure each (distribution, rate) with both clients."""
    if pa.find() is None:
        raise BenchError(pa.missing_reason())
    served = served_models()
    model = served.classifier
    card = exported_card(model, onnx_dir) if (Path(onnx_dir) / f"{model}.onnx").exists() else None
    lam = card.lam.default if card is not None and card.lam is not None else None
    w = classify_workload(model, SAMPLES, lam)
    feeds = [{k: as_batch(v) for k, v in a.items()} for a in w.arrays]
    payloads = [loadgen.v2_infer(model, f) for f in feeds]
    levels = []
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="unroll-profile-agreement-")))
        pipeline.run(pipeline.plan([model], onnx_dir=onnx_dir))
        models = [m for m in (model, served.lam_rule) if m]
        write_repository("cpu", models, tmp / "repo", onnx_dir=onnx_dir)
        log("starting Triton and the gateway")
        _, grpc_url = stack.enter_context(triton_server(tmp / "repo", tmp / "triton.log"))
        try:
            gateway = stack.enter_context(gateway_process(Settings(triton_url=grpc_url, triton_protocol="grpc"),
                                                          tmp / "gateway.log"))
        except GatewayStartError as e:
            raise BenchError(str(e)) from None
        loadgen.run(gateway, payloads, loadgen.Load(concurrency=2), 2.0, warmup_s=0.5)  # warm both servers
        for distribution in distributions:
            for rate in rates:
                log(f"{rate:g} req/s {distribution}: perf_analyzer, then the engine")
                ref = _perf_analyzer(model, gateway, feeds, rate, distribution, window_ms)
                eng = _engine(gateway, payloads, rate, distribution, window_ms)
                levels.append({"rate_rps": rate, "distribution": distribution, "perf_analyzer": ref, "engine": eng,
                               "p50_diff": _ratio(eng["p50_ms"], ref["p50_ms"]),
                               "throughput_diff": _ratio(eng["throughput_rps"], ref["throughput_rps"])})
    worst = max(max(abs(lv["p50_diff"]), abs(lv["throughput_diff"])) for lv in levels)
    return {"benchmark": "profile_agreement", "machine": machine_info(threads=2), "model": model,
            "target": "the gateway's /v2 front (binary tensors, batch 1)", "inputs": w.label,
            "window_ms": window_ms, "windows": WINDOWS, "tolerance": TOLERANCE, "levels": levels,
            "worst_diff": worst, "agrees": worst <= TOLERANCE}


def markdown(payload: dict) -> str:
    """The results as a markdown table (every number from ``payload``)."""
    lines = [f"# The load engine against perf_analyzer ({payload['model']}, {payload['target']})", "",
             f"Inputs: {payload['inputs']}; {payload['windows']} windows of {payload['window_ms']} ms "
             "(perf_analyzer), one window as long (the engine). Difference = engine / perf_analyzer − 1.", "",
             "| arrivals | rate req/s | p50 ms perf_analyzer | p50 ms engine | p50 diff | answered/s perf_analyzer "
             "| answered/s engine | throughput diff | engine CPU ms/req |",
             "| --- | --: | --: | --: | --: | --: | --: | --: | --: |"]
    for lv in payload["levels"]:
        ref, eng = lv["perf_analyzer"], lv["engine"]
        lines.append(f"| {lv['distribution']} | {lv['rate_rps']:g} | {ref['p50_ms']:.2f} | {eng['p50_ms']:.2f} | "
                     f"{100 * lv['p50_diff']:+.1f}% | {ref['throughput_rps']:.1f} | {eng['throughput_rps']:.1f} | "
                     f"{100 * lv['throughput_diff']:+.1f}% | {eng['client_cpu_ms_per_request']:.2f} |")
    verdict = "within" if payload["agrees"] else "NOT within"
    lines += ["", f"Largest difference: {100 * payload['worst_diff']:.1f}% — {verdict} the "
              f"{100 * payload['tolerance']:g}% bar.", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder for profile_agreement.json and .md")
    ap.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES), help="request rates, req/s")
    args = ap.parse_args(argv)
    payload = run(tuple(float(r) for r in args.rates.split(",")))
    for path in write_results("profile_agreement", payload, markdown(payload), args.out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
