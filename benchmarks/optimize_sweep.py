"""``unroll optimize``'s Triton configuration sweep: instances × threads, spinning, max batch and queue delay.

One real tritonserver in explicit model-control mode serves the chosen candidate; each configuration is loaded
through Triton's repository API with the config as an override (no restart), then ``perf_analyzer`` drives it at
:data:`CONCURRENCY` levels over gRPC with the card's benchmark request. A configuration's objective is its best
throughput at a level whose p99 stays within the latency budget (default: :data:`DEFAULT_BUDGET_FACTOR` × the
hand-set configuration's lone-request p50). The search is a
coordinate ascent from today's hand-set configuration (:func:`hand_set`), one dimension at a time, keeping a change
only when it gains more than :data:`MIN_GAIN`, so the hand-set one is measured in the same run as the winner.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from unroll.benchmarks import perf_analyzer
from unroll.benchmarks.processes import cpu_by_pid
from unroll.benchmarks.serve_triton import get_json, stats_delta, triton_server, triton_stats
from unroll.card import ModelCard
from unroll.serving.repository import (
    DEFAULT_QUEUE_DELAY_US,
    INTRA_OP_SPINNING,
    default_max_batch_size,
    write_repository,
)

CONCURRENCY = (1, 4, 16)
#: The processes whose CPU counts as the server's (Triton and its Python-backend stubs).
SERVER_KINDS = ("tritonserver", "backends")
#: Without a latency budget, a level counts only while its p99 is within this many times the hand-set configuration's
#: p50 for a lone request: more throughput bought with a much slower lone request is not what a server wants.
DEFAULT_BUDGET_FACTOR = 5.0
#: A change must raise the objective by this fraction to replace the current best (below it is noise here).
MIN_GAIN = 0.05
QUEUE_DELAYS_US = (0, 500, 2000)
WINDOW_MS = 1000
MAX_TRIALS = 4


def hand_set(card: ModelCard, threads: int) -> dict:
    """The configuration ``unroll repo`` writes without a choice (its defaults)."""
    return {"threads": threads, "instances": 1, "max_batch_size": default_max_batch_size("cpu", card),
            "queue_delay_us": DEFAULT_QUEUE_DELAY_US, "spinning": INTRA_OP_SPINNING}


def dimensions(runtime: str, base: dict, cores: int) -> list[tuple[str, list[dict]]]:
    """The values each dimension is tried at (as partial configs), in search order."""
    dims = [("instances × threads", [{"instances": 1, "threads": cores},
                                     {"instances": 2, "threads": max(1, cores // 2)}])]
    if runtime == "onnxruntime":  # (the other runtimes have no spinning setting)
        dims.append(("spinning", [{"spinning": True}, {"spinning": False}]))
    big = base["max_batch_size"]
    dims.append(("max batch", [{"max_batch_size": b} for b in dict.fromkeys((big, max(1, big // 4)))]))
    dims.append(("queue delay", [{"queue_delay_us": d} for d in QUEUE_DELAYS_US]))
    return dims


def points_at_most(card: ModelCard, runtime: str = "onnxruntime") -> int:
    """How many configurations the sweep measures at most (the hand-set one and every alternative value)."""
    base = hand_set(card, 1)
    return 1 + sum(len(values) - 1 for _, values in dimensions(runtime, base, max(1, os.cpu_count() or 1)))


def key(config: dict) -> str:
    return json.dumps(config, sort_keys=True)


def objective(levels: list[dict], budget_ms: float | None) -> float:
    """Best throughput among the levels whose p99 is within ``budget_ms`` (0 when none is)."""
    ok = [lv["throughput_rps"] for lv in levels if budget_ms is None or lv["p99_ms"] <= budget_ms]
    return max(ok, default=0.0)


class Sweep:
    """The sweep for one model served as ``cand`` (a :class:`unroll.benchmarks.optimize.Candidate`)."""

    def __init__(self, name: str, cand, card: ModelCard, onnx_dir: Path, aoti_dir: Path, threads: int,
                 budget_ms: float | None, request: dict) -> None:
        self.name, self.cand, self.card, self.request = name, cand, card, request
        self.onnx_dir, self.aoti_dir, self.budget_ms = Path(onnx_dir), Path(aoti_dir), budget_ms
        self.base = hand_set(card, threads)
        self.cores = max(1, os.cpu_count() or 1)

    def skipped(self, why: str) -> dict:
        return {"status": "skipped", "reason": why, "hand_set": self.base, "chosen": self.base, "points": []}

    def run(self, journal, deadline: float, progress: Callable[[str], None],
            advance: Callable[[int], None] | None = None) -> dict:
        if perf_analyzer.find() is None:
            return self.skipped(perf_analyzer.missing_reason())
        feeds = [self.request]
        if next(iter(self.request.values())).shape[0] != 1:
            return self.skipped("no batch-1 benchmark request for this model")
        done: dict = journal.data["sweep"]
        with tempfile.TemporaryDirectory(prefix="unroll-optimize-") as tmp:
            repo = Path(tmp) / "repo"
            write_repository("cpu", [self.name], repo, precision=self.cand.precision, onnx_dir=self.onnx_dir,
                             runtime=self.cand.runtime, static_shapes=self.cand.static_shapes, aoti_dir=self.aoti_dir,
                             bf16=self.cand.bf16, **self.base)
            progress(f"{self.name}: starting Triton for the configuration sweep")
            with triton_server(repo, Path(tmp) / "triton.log", load=[self.name]) as (http, grpc):
                base_json = get_json(f"http://{http}/v2/models/{self.name}/config", timeout=30)
                measure = _Measure(self, http, grpc, base_json, feeds, done, journal, progress, advance)
                best = dict(self.base)
                budget, source = self._budget(measure(best))
                truncated = False
                for dim, values in dimensions(self.cand.runtime, self.base, self.cores):
                    for part in values:
                        config = best | part
                        if config == best:
                            continue
                        if time.monotonic() > deadline:
                            truncated = True
                            break
                        got = measure(config)
                        if objective(got["levels"], budget) > objective(done[key(best)]["levels"], budget) * (
                                1 + MIN_GAIN):
                            progress(f"{self.name}: {dim} → {part} is better")
                            best = config
        points = [done[k] | {"objective": objective(done[k]["levels"], budget)} for k in done]
        base_obj, best_obj = objective(done[key(self.base)]["levels"], budget), objective(done[key(best)]["levels"],
                                                                                         budget)
        return {"status": "measured", "hand_set": self.base, "chosen": best, "points": points,
                "latency_budget_ms": budget, "latency_budget_source": source, "concurrency": list(CONCURRENCY),
                "objective": "best throughput (req/s) at a level whose p99 is within the latency budget",
                "hand_set_objective": base_obj, "chosen_objective": best_obj,
                "gain": best_obj / base_obj if base_obj else None, "truncated": truncated,
                "request": f"{next(iter(feeds[0]))} {list(next(iter(feeds[0].values())).shape)} tensors over gRPC"}


    def _budget(self, base_point: dict) -> tuple[float | None, str]:
        """The latency budget and where it comes from: the caller's, else :data:`DEFAULT_BUDGET_FACTOR` × the
        hand-set configuration's lone-request p50."""
        if self.budget_ms is not None:
            return self.budget_ms, "--latency-budget-ms"
        lone = next((lv["p50_ms"] for lv in base_point["levels"] if lv["concurrency"] == 1), None)
        if lone is None:
            return None, "none (the hand-set configuration was not measured at concurrency 1)"
        return DEFAULT_BUDGET_FACTOR * lone, (f"default: {DEFAULT_BUDGET_FACTOR:g} × the hand-set configuration's "
                                              f"p50 at concurrency 1 ({lone:.2f} ms)")


class _Measure:
    """Load one configuration into the running Triton and measure it at every level (cached in the journal)."""

    def __init__(self, sweep: Sweep, http: str, grpc: str, base_json: dict, feeds: list, done: dict,
                 journal, progress, advance) -> None:
        self.s, self.http, self.grpc, self.base_json = sweep, http, grpc, base_json
        self.feeds, self.done, self.journal, self.progress, self.advance = feeds, done, journal, progress, advance

    def __call__(self, config: dict) -> dict:
        k = key(config)
        if k in self.done:
            return self.done[k]
        name = self.s.name
        self.progress(f"{name}: configuration {_describe(config)}")
        try:
            _load(self.http, name, _config_json(self.base_json, config))
            point = {"config": config, "levels": self._levels(config)}
        except (OSError, perf_analyzer.PerfAnalyzerError) as e:  # a configuration Triton refuses is a result too
            detail = e.read().decode(errors="replace")[:300] if isinstance(e, urllib.error.HTTPError) else str(e)
            point = {"config": config, "levels": [], "error": f"{type(e).__name__}: {detail}"}
        self.done[k] = point
        self.journal.save()
        if self.advance:
            self.advance(1)
        return point

    def _levels(self, config: dict) -> list[dict]:
        name = self.s.name
        levels = []
        for c in CONCURRENCY:
            before_cpu, before = cpu_by_pid(), triton_stats(self.http, name)
            row = perf_analyzer.measure(name, self.grpc, self.feeds, c, window_ms=WINDOW_MS, max_trials=MAX_TRIALS,
                                        batching=config["max_batch_size"] > 0)
            after_cpu, delta = cpu_by_pid(), stats_delta(before, triton_stats(self.http, name))
            requests = (delta or {}).get("requests") or 0
            cpu_s = sum(cpu - before_cpu.get(p, (kind, 0.0))[1] for p, (kind, cpu) in after_cpu.items()
                        if kind in SERVER_KINDS)
            levels.append({"concurrency": c, "throughput_rps": row["throughput_rps"],
                           "p50_ms": row["latency_ms"].get("p50", float("nan")),
                           "p99_ms": row["latency_ms"].get("p99", float("nan")),
                           "server_cpu_ms_per_request": cpu_s * 1e3 / requests if requests else None,
                           "avg_batch": (delta or {}).get("avg_batch"), "stable": row["stable"]})
        return levels


def _describe(config: dict) -> str:
    return (f"{config['instances']}×{config['threads']} threads, max batch {config['max_batch_size']}, "
            f"delay {config['queue_delay_us']} µs, spinning {'on' if config['spinning'] else 'off'}")


def _config_json(base: dict, config: dict) -> dict:
    """Triton's JSON model config ``base`` with ``config``'s settings."""
    cfg = json.loads(json.dumps(base))
    cfg["max_batch_size"] = config["max_batch_size"]
    cfg["instance_group"] = [{"kind": "KIND_CPU", "count": config["instances"]}]
    if "dynamic_batching" in cfg:
        batching = cfg["dynamic_batching"]
        batching["max_queue_delay_microseconds"] = config["queue_delay_us"]
        if batching.get("preferred_batch_size"):  # (must not exceed max_batch_size; `unroll repo` writes the max)
            batching["preferred_batch_size"] = [config["max_batch_size"]]
    for warm in cfg.get("model_warmup", []):  # `unroll repo` warms up at batch 1 and at the max batch
        warm["batch_size"] = min(int(warm.get("batch_size", 1)), max(1, config["max_batch_size"]))
    params = cfg.setdefault("parameters", {})
    params["intra_op_num_threads"] = {"string_value": str(config["threads"])}
    params["intra_op_spinning"] = {"string_value": "1" if config["spinning"] else "0"}
    return cfg


def _load(http: str, name: str, config: dict) -> None:
    body = json.dumps({"parameters": {"config": json.dumps(config)}}).encode()
    req = urllib.request.Request(f"http://{http}/v2/repository/models/{name}/load", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


