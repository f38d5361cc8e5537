"""The serving path under load: in-process ONNX Runtime vs Triton (HTTP, gRPC) vs the REST gateway.

The project's load engine (:mod:`.loadgen`, closed loop) sweeps concurrency levels on real inputs of the trained demo
models and records throughput, latency percentiles, errors by cause, the client's own CPU per request and Triton's
own per-stage split and batch sizes; every path is driven by that one engine; Triton direct is also
measured with ``perf_analyzer`` (:mod:`unroll.benchmarks.perf_analyzer`). Dynamic batching on vs off runs in
interleaved rounds (the median ratio), so load drifting on a shared machine hits both alike. The targets
(:func:`targets`) are ratios within one run; client, gateway and Triton share the machine's cores, so the numbers
say what this box serves.

This module runs the benchmark; the workloads and what each path sends are in :mod:`.serve_load`, the servers and
Triton's statistics in :mod:`.serve_triton`, the targets and Markdown in :mod:`.serve_report`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from unroll import artifacts
from unroll.benchmarks import perf_analyzer as pa
from unroll.benchmarks import plots
from unroll.benchmarks.common import (
    RESULTS,
    exported_card,
    latency_summary,
    machine_info,
    ort_session,
    progress_bars,
    write_docs_blocks,
    write_results,
)
from unroll.benchmarks.loadgen import LevelResult
from unroll.benchmarks.processes import cpu_by_pid, cpu_ms_per_request
from unroll.benchmarks.serve_load import (
    CLASSIFY_SAMPLES,
    DENOISE_PATHS,
    PATHS,
    PERF_ANALYZER_CONCURRENCY,
    Served,
    Workload,
    classify_workload,
    closed_level,
    denoise_workload,
    image_feeds,
    served_models,
    traffic,
)
from unroll.benchmarks.serve_report import README_BEGIN, README_END, direct_path, markdown, readme_block, targets
from unroll.benchmarks.serve_triton import (
    FLOOR_MODEL,
    Servers,
    check_grpc,
    stats_delta,
    triton_config,
    triton_server,
    triton_stats,
    wait_attached,
    write_delay_repository,
    write_repositories,
)
from unroll.errors import (
    BenchError,  # a server could not be started or reached (re-exported for callers)
    GatewayStartError,
)
from unroll.serving.gateway.process import gateway_process
from unroll.serving.gateway.settings import Settings
from unroll.serving.repository import DEFAULT_QUEUE_DELAY_US, INTRA_OP_SPINNING, write_repository

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32)
DEFAULT_DENOISE_CONCURRENCY = (1, 4)
DEFAULT_DENOISE_SIZES = (256, 512)
#: Batch sizes tried for ONNX Runtime's in-process batched ceiling (the best one is the ceiling).
CEILING_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
#: Queue delays (µs) compared with the default (serving/repository.py) at concurrency 1 and the batching level.
COMPARE_QUEUE_DELAYS_US = (500,)
#: The paths measured again on a Triton whose ONNX Runtime threads spin the other way (the classifier).
SPINNING_PATHS = ("gateway", "triton-http")
#: How the results name the client of every level but perf_analyzer's.
CLIENT = ("the load engine (benchmarks/loadgen.py): closed loop, one asyncio event loop for every request in flight, "
          "HTTP/1.1 keep-alive (h11) or one gRPC channel, in-process calls in a thread per request in flight")


def perf_analyzer_level(w: Workload, concurrency: int, servers: Servers, window_ms: int) -> dict:
    """One Triton-direct level measured by ``perf_analyzer`` (gRPC, real inputs), in :func:`measure`'s row format
    (``path`` ``perf-analyzer``; latency mean/max are not reported by it), with its server split and the average
    batch Triton formed (statistics delta around the run). Raises ``PerfAnalyzerError``."""
    before = triton_stats(servers.triton_http, w.model)
    row = pa.measure(w.model, servers.triton_grpc, w.arrays, concurrency, window_ms=window_ms)
    delta = stats_delta(before, triton_stats(servers.triton_http, w.model)) or {}
    lat = {k: float("nan") for k in ("mean", "p50", "p90", "p95", "p99", "max")} | row["latency_ms"]
    return {"workload": w.key, "model": w.model, "input": w.label, "path": "perf-analyzer",
            "concurrency": concurrency, "requests": delta.get("requests"), "errors": delta.get("failed", 0),
            "error_samples": [], "throughput_rps": row["throughput_rps"], "latency_ms": lat,
            "server": row["server"] | {"avg_batch": delta.get("avg_batch")}, "client_split": row["client"],
            "stable": row["stable"], "command": row["command"]}


def _pa_window_ms(duration_s: float) -> int:
    """perf_analyzer's measurement window for a level of ``duration_s``: half of it (it needs ≥ 2 windows), ≥ 0.5 s."""
    return max(500, int(duration_s * 1000 / 2))


def direct_level(w: Workload, concurrency: int, servers: Servers, sessions: dict, duration_s: float,
                 warmup_s: float, use_perf_analyzer: bool, progress: Callable[[float], None] | None = None) -> dict:
    """Triton direct: ``perf_analyzer`` when present, else the load engine over gRPC."""
    if use_perf_analyzer:
        return perf_analyzer_level(w, concurrency, servers, _pa_window_ms(duration_s))
    return measure("triton-grpc", w, concurrency, duration_s, warmup_s, servers, sessions, progress=progress)


def ort_ceiling(session, w: Workload, batch_sizes: tuple[int, ...] = CEILING_BATCH_SIZES,
                duration_s: float = 2.0) -> dict:
    """ONNX Runtime's in-process batched ceiling: for each batch size, back-to-back ``session.run`` on real samples
    concatenated to that batch for ``duration_s``; items/s and the p50 per run. ``best`` is the highest items/s."""
    rows = []
    names = list(w.arrays[0])
    for b in batch_sizes:
        feeds = [{k: np.concatenate([w.arrays[(j * b + i) % len(w.arrays)][k] for i in range(b)]) for k in names}
                 for j in range(4)]
        session.run(None, feeds[0])  # warm-up (allocations for this shape)
        lat, t_end, j = [], time.perf_counter() + duration_s, 0
        start = time.perf_counter()
        while (t0 := time.perf_counter()) < t_end:
            session.run(None, feeds[j % len(feeds)])
            lat.append((time.perf_counter() - t0) * 1e3)
            j += 1
        elapsed = time.perf_counter() - start
        rows.append({"batch": b, "runs": len(lat), "items_per_s": b * len(lat) / elapsed,
                     "p50_ms": float(np.percentile(lat, 50))})
    best = max(rows, key=lambda r: r["items_per_s"])
    return {"model": w.model, "input": w.label, "rows": rows, "best": best}


def measure(path: str, w: Workload, concurrency: int, duration_s: float, warmup_s: float, servers: Servers | None,
            sessions: dict, stats_url: str | None = None, progress: Callable[[float], None] | None = None) -> dict:
    """One (path, concurrency) cell on the load engine: client latencies, throughput, errors by cause and the
    client's CPU per request; Triton's split and every process's CPU per request when a server is involved."""
    urls = {} if servers is None else {"triton_http": servers.triton_http, "triton_grpc": servers.triton_grpc,
                                       "gateway": servers.gateway}
    t = traffic(path, w, concurrency, session=sessions.get(w.model), **urls)
    stats_url = stats_url or (servers.triton_http if servers is not None and path != "onnxruntime" else None)
    snap: dict = {}

    def before() -> None:
        if stats_url:
            snap["stats"] = triton_stats(stats_url, w.model)
        snap["cpu"] = cpu_by_pid()

    res = closed_level(t, concurrency, duration_s, warmup_s, before, progress)
    cpu_after = cpu_by_pid()
    server = stats_delta(snap.get("stats"), triton_stats(stats_url, w.model)) if stats_url else None
    cpu = cpu_ms_per_request(snap["cpu"], cpu_after, res.ok) if _own_servers(servers) else None
    return level_row(w, path, concurrency, res) | {"server": server, "cpu_ms_per_request": cpu}


def level_row(w: Workload, path: str, concurrency: int, res: LevelResult) -> dict:
    """A level's row in the results: what was sent, what was answered and how fast, and what the client spent."""
    return {"workload": w.key, "model": w.model, "input": w.label, "path": path, "concurrency": concurrency,
            "duration_s": res.duration_s, "sent": res.sent, "requests": res.ok, "errors": res.errors_total,
            "errors_by_cause": dict(res.errors), "error_samples": list(res.error_samples),
            "throughput_rps": res.throughput, "latency_ms": latency_summary(res.latencies_ms),
            "client_cpu_ms_per_request": res.cpu_ms_per_request}


def _own_servers(servers: Servers | None) -> bool:
    """CPU is only attributed to processes this run started (an attached server's tree is not ours to read)."""
    return servers is None or (servers.started_triton and (servers.gateway is None or servers.started_gateway))


def _add_gateway_share(runs: list[dict], gateway_protocol: str = "grpc") -> None:
    """Gateway latency minus Triton-direct latency at the same workload and concurrency (p50 and mean).

    Triton-direct is the gateway's own protocol to Triton where measured, else the other one.
    """
    own = direct_path(gateway_protocol)
    other = "triton-grpc" if own == "triton-http" else "triton-http"
    direct: dict[tuple[str, int], dict] = {}
    for path in (other, own):  # its own protocol, updated last, wins where both were measured
        direct.update({(r["workload"], r["concurrency"]): r for r in runs if r["path"] == path and r["requests"]})
    image = {(r["workload"], r["concurrency"]): r for r in runs if r["path"] == "triton-grpc-image" and r["requests"]}
    for r in runs:
        if r["path"] != "gateway":
            continue
        d = direct.get((r["workload"], r["concurrency"]))
        if d is not None:
            r["gateway_share_ms"] = {"vs": d["path"], "p50": r["latency_ms"]["p50"] - d["latency_ms"]["p50"],
                                     "mean": r["latency_ms"]["mean"] - d["latency_ms"]["mean"]}
        d = image.get((r["workload"], r["concurrency"]))
        if d is not None:  # the same work (decode, fit, tile, encode) in Triton: what the gateway alone adds
            r["gateway_share_image_ms"] = {"vs": d["path"], "p50": r["latency_ms"]["p50"] - d["latency_ms"]["p50"]}


def _workloads(onnx_dir: Path, served: Served, concurrency: tuple[int, ...], denoise_sizes: tuple[int, ...],
               denoise_concurrency: tuple[int, ...], paths: tuple[str, ...], classify_samples: int) -> list[Workload]:
    """The classifier's workload first (targets and the batching comparison use it), then one per denoiser size."""
    card = exported_card(served.classifier, onnx_dir)
    classify = classify_workload(served.classifier, classify_samples, card.lam.default if card.lam else None)
    classify.concurrency, classify.paths = tuple(concurrency), tuple(paths)
    out = [classify]
    for size in denoise_sizes:
        w = denoise_workload(served.denoiser, size)
        w.concurrency, w.paths = tuple(denoise_concurrency), tuple(p for p in paths if p in DENOISE_PATHS)
        out.append(w)
    return out


def run(concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY, duration_s: float = 5.0, warmup_s: float = 0.5,
        denoise_sizes: tuple[int, ...] = DEFAULT_DENOISE_SIZES,
        denoise_concurrency: tuple[int, ...] = DEFAULT_DENOISE_CONCURRENCY, batching_concurrency: int = 16,
        batching_rounds: int = 3, paths: tuple[str, ...] = PATHS, url: str | None = None,
        triton_url: str | None = None,
        triton_grpc_url: str | None = None, onnx_dir: Path = artifacts.ONNX_DIR, threads: int = 2,
        classify_samples: int = CLASSIFY_SAMPLES, progress: bool = True, out_dir: Path | None = None,
        log: Callable[[str], None] = print,
        perf_analyzer_concurrency: tuple[int, ...] = PERF_ANALYZER_CONCURRENCY,
        compare_queue_delays_us: tuple[int, ...] = COMPARE_QUEUE_DELAYS_US,
        ceiling_batch_sizes: tuple[int, ...] = CEILING_BATCH_SIZES) -> dict:
    """Start (or attach to) Triton and the gateway, sweep every workload × path × concurrency; write results.

    ``url`` attaches to a running gateway (then ``triton_url``, the Triton behind it, is required);
    ``triton_url`` (HTTP ``host:port``) attaches to a running Triton (gRPC: ``triton_grpc_url``, by
    default the HTTP port + 1). The no-batching comparison always starts its own Triton.

    Triton direct is also measured with ``perf_analyzer`` (Triton's own client, :mod:`unroll.benchmarks.
    perf_analyzer`) when it is set up, at ``perf_analyzer_concurrency`` for the classifier and the denoiser
    concurrency for each image size; it then also drives the batching on/off rounds and the queue-delay
    comparison (a Triton per delay in ``compare_queue_delays_us``, against the repository default). When it is
    missing, the results say so with the set-up command and those use the load engine over gRPC.
    ONNX Runtime's in-process batched ceiling (``ceiling_batch_sizes``) is measured on the classifier.
    """
    _check_options(batching_rounds, paths, url, triton_url)
    onnx_dir = Path(onnx_dir)
    pa_binary = pa.find()
    use_pa = pa_binary is not None
    payload: dict = {"benchmark": "serve", "machine": machine_info(threads),
                     "perf_analyzer": {"available": use_pa, "missing": None if use_pa else pa.missing_reason(),
                                       "runs": []}}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="unroll-bench-serve-")))
        served = served_models()
        log(f"writing Triton repositories from {onnx_dir}")
        repo_on, repo_off = write_repositories(onnx_dir, tmp, served)
        classify_input = exported_card(served.classifier, onnx_dir).input.name
        delays = [d for d in dict.fromkeys(compare_queue_delays_us) if d != DEFAULT_QUEUE_DELAY_US]
        repo_delays = {d: write_delay_repository(onnx_dir, tmp / f"delay-{d}", served, d) for d in delays}
        workloads = _workloads(onnx_dir, served, concurrency, denoise_sizes, denoise_concurrency, paths,
                               classify_samples)
        payload["config"] = {
            "duration_s": duration_s, "warmup_s": warmup_s, "threads": threads, "spinning": INTRA_OP_SPINNING,
            "workloads": {w.key: {"model": w.model, "input": w.label, "paths": list(w.paths),
                                  "concurrency": list(w.concurrency)} for w in workloads},
            "batching_concurrency": batching_concurrency,
            "client": CLIENT}
        servers = _servers(stack, tmp, repo_on, paths, url, triton_url, triton_grpc_url, log)
        sessions = {m: ort_session(artifacts.graph(m, onnx_dir=onnx_dir), threads, spinning=INTRA_OP_SPINNING)
                    for m in (served.classifier, served.denoiser)}
        payload["servers"] = _servers_info(servers, served)
        cells = [(w, p, c) for w in workloads for p in w.paths for c in w.concurrency]
        with progress_bars(progress) as bars:
            bar = _Bars(bars, bars.add_task("serve sweep", total=len(cells) + 5, info=""),
                        bars.add_task("level", total=1.0, info=""), duration_s)
            runs = _sweep(bar, cells, duration_s, warmup_s, servers, sessions)
            if servers.started_gateway:
                payload["other_spinning"] = _other_spinning(bar, onnx_dir, tmp, served, workloads[0], sessions,
                                                            duration_s, warmup_s)
            bar.advance()
            classify = workloads[0]
            bar.show("ONNX Runtime batched ceiling")
            payload["ort_ceiling"] = ort_ceiling(sessions[served.classifier], classify, tuple(ceiling_batch_sizes))
            payload["ort_ceiling"]["threads"] = threads
            bar.advance()
            if use_pa:
                payload["perf_analyzer"]["runs"] = _perf_analyzer_runs(bar, workloads, perf_analyzer_concurrency,
                                                                       servers)
            bar.advance()
            level = _Level(classify, servers, sessions, duration_s, warmup_s, use_pa)
            rounds, off_cfg = _batching_rounds(bar, level, tmp, repo_off, payload, batching_concurrency,
                                               batching_rounds, classify_input)
            bar.advance(2)
            payload["queue_delay"] = _queue_delays(bar, level, tmp, repo_delays, batching_concurrency, served)
    _add_gateway_share(runs, servers.gateway_protocol)
    payload["runs"] = runs
    payload["batching"] = _batching_summary(rounds, batching_concurrency, served.classifier, use_pa,
                                            payload["servers"]["config"].get(served.classifier, {}), off_cfg)
    payload["targets"] = targets(payload)
    if out_dir is not None:
        write(payload, Path(out_dir))
    return payload



def _servers_info(servers: Servers, served: Served) -> dict:
    """What was measured: the servers' addresses, whether this run started them, and Triton's model configs."""
    return {"triton_http": servers.triton_http, "triton_grpc": servers.triton_grpc,
            "gateway": servers.gateway, "started_triton": servers.started_triton,
            "started_gateway": servers.started_gateway, "gateway_triton_protocol": servers.gateway_protocol,
            "config": {m: triton_config(servers.triton_http, m) for m in served.triton_models}}


def _perf_analyzer_runs(bar: _Bars, workloads: list[Workload], classify_concurrency: tuple[int, ...],
                        servers: Servers) -> list[dict]:
    """Triton direct through perf_analyzer: the classifier at ``classify_concurrency``, the denoisers at theirs; each
    with the float tensors and with the PNG files themselves (``request``: ``tensors`` or ``png``)."""
    runs = []
    for w in workloads:
        png = dataclasses.replace(w, arrays=image_feeds(w))
        for c in (classify_concurrency if w is workloads[0] else w.concurrency):
            for request, feeds in (("tensors", w), ("png", png)):
                bar.show(f"{w.key} perf_analyzer c={c} ({request})")
                row = perf_analyzer_level(feeds, c, servers, _pa_window_ms(bar.duration_s))
                runs.append(row | {"request": request})
    return runs


def _batching_summary(rounds: list[dict], concurrency: int, model: str, use_pa: bool, config_on: dict,
                      config_off: dict) -> dict:
    """The batching on/off comparison: its median round, every round, and both servers' configs."""
    median = _median_round(rounds)
    return {"concurrency": concurrency, "model": model, "path": "perf-analyzer" if use_pa else "triton-grpc",
            "on": median["on"], "off": median["off"], "speedup": median["speedup"],
            "rounds": rounds, "speedups": [r["speedup"] for r in rounds],
            "config_on": config_on, "config_off": config_off}

def _check_options(batching_rounds: int, paths: tuple[str, ...], url: str | None, triton_url: str | None) -> None:
    if batching_rounds < 1:
        raise BenchError(f"batching rounds must be ≥ 1, not {batching_rounds}")
    bad = [p for p in paths if p not in PATHS]
    if bad:
        raise BenchError(f"unknown path(s) {bad}; choose from {', '.join(PATHS)}")
    if url is not None and triton_url is None:
        raise BenchError("--url needs --triton-url: the Triton behind that gateway (for Triton-direct and its "
                         "statistics)")


def _servers(stack: contextlib.ExitStack, tmp: Path, repo_on: Path, paths: tuple[str, ...], url: str | None,
             triton_url: str | None, triton_grpc_url: str | None, log: Callable[[str], None]) -> Servers:
    """Triton (started on the batching repository, or attached) and, when measured, the gateway (started in front
    of that Triton's gRPC port, or attached); what is started stops with ``stack``."""
    if triton_url is None:
        log("starting Triton (batching repository)")
        http_url, grpc_url = stack.enter_context(triton_server(repo_on, tmp / "triton.log"))
        servers = Servers(http_url, grpc_url, None, started_triton=True)
    else:
        host, port = triton_url.rsplit(":", 1)
        servers = Servers(triton_url, triton_grpc_url or f"{host}:{int(port) + 1}", None)
        wait_attached(f"http://{triton_url}/v2/health/ready", 10)
        check_grpc(servers.triton_grpc)
    if "gateway" not in paths:
        return servers
    if url is None:
        log("starting the gateway")
        settings = Settings(triton_url=servers.triton_grpc, triton_protocol="grpc")
        try:
            servers.gateway = stack.enter_context(gateway_process(settings, tmp / "gw.log"))
        except GatewayStartError as e:
            raise BenchError(str(e)) from None
        servers.started_gateway = True
    else:
        servers.gateway = url.rstrip("/")
        servers.gateway_protocol = "unknown (attached)"
        wait_attached(servers.gateway + "/readyz", 10)
    return servers


@dataclass
class _Bars:
    """The sweep's two progress bars: the whole sweep (``total``) and the level being measured (``level``)."""

    bars: Any
    total: Any
    level: Any
    duration_s: float

    def show(self, description: str, info: str | None = "") -> None:
        """A new level: its description, its bar back at 0 (and its info line cleared unless ``None``)."""
        self.bars.update(self.level, description=description, completed=0,
                         **({} if info is None else {"info": info}))

    def tick(self, fraction: float) -> None:
        """The level's progress (the engine's: a fraction of its warm-up and measured window)."""
        self.bars.update(self.level, completed=min(fraction, 1.0))

    def advance(self, n: int = 1) -> None:
        self.bars.advance(self.total, n)


@dataclass
class _Level:
    """How a Triton-direct level of the classifier is measured (:func:`direct_level`) in the comparisons."""

    classify: Workload
    servers: Servers
    sessions: dict
    duration_s: float
    warmup_s: float
    use_pa: bool

    def __call__(self, concurrency: int, servers: Servers | None = None,
                 progress: Callable[[float], None] | None = None) -> dict:
        return direct_level(self.classify, concurrency, servers or self.servers, self.sessions, self.duration_s,
                            self.warmup_s, self.use_pa, progress=progress)


def _sweep(bar: _Bars, cells: list[tuple[Workload, str, int]], duration_s: float, warmup_s: float,
           servers: Servers, sessions: dict) -> list[dict]:
    """Every workload × path × concurrency cell, one after the other."""
    runs = []
    for w, p, c in cells:
        bar.show(f"{w.key} {p} c={c}")
        r = measure(p, w, c, duration_s, warmup_s, servers, sessions, progress=bar.tick)
        bar.bars.update(bar.level, info=f"{r['throughput_rps']:.1f} req/s, p50 {r['latency_ms']['p50']:.1f} ms"
                                        + (f", {r['errors']} errors" if r["errors"] else ""))
        runs.append(r)
        bar.advance()
    return runs


def _batching_rounds(bar: _Bars, level: _Level, tmp: Path, repo_off: Path, payload: dict, concurrency: int,
                     n_rounds: int, classify_input: str) -> tuple[list[dict], dict]:
    """Dynamic batching on (the main server) vs off (a Triton of its own), the classifier at ``concurrency``, in
    interleaved rounds so that drifting load hits both alike; with perf_analyzer also the Python backend's floor
    (a do-nothing model, same inputs, concurrency 1) into ``payload``. The rounds and the off server's config."""
    bar.show("starting Triton without batching")
    rounds = []
    with triton_server(repo_off, tmp / "triton-off.log") as (off_http, off_grpc):
        off_servers = Servers(off_http, off_grpc, None)
        off_cfg = triton_config(off_http, level.classify.model)
        if level.use_pa:
            bar.show("perf_analyzer: Python-backend floor c=1")
            classify = level.classify
            floor = Workload("floor", FLOOR_MODEL, classify.label,
                             [{"x": a[classify_input]} for a in classify.arrays], [], "", "y")
            payload["perf_analyzer"]["floor"] = perf_analyzer_level(
                floor, 1, off_servers, _pa_window_ms(level.duration_s))
        for k in range(n_rounds):
            pair = {}
            for tag, srv in (("on", level.servers), ("off", off_servers)):
                bar.show(f"batching {tag}, c={concurrency} (round {k + 1}/{n_rounds})", info=None)
                pair[tag] = level(concurrency, srv, progress=bar.tick)
            off_rps = pair["off"]["throughput_rps"]
            pair["speedup"] = pair["on"]["throughput_rps"] / off_rps if off_rps else None
            rounds.append(pair)
    return rounds, off_cfg


def _queue_delays(bar: _Bars, level: _Level, tmp: Path, repo_delays: dict[int, Path], batching_concurrency: int,
                  served: Served) -> dict:
    """The default queue delay (the main server) vs each other one (a Triton each), at concurrency 1 and the
    batching level."""
    levels = sorted({1, batching_concurrency})
    qd = {DEFAULT_QUEUE_DELAY_US: {c: level(c) for c in levels}}
    for d, repo in repo_delays.items():
        bar.show(f"starting Triton with queue delay {d} µs")
        with triton_server(repo, tmp / f"triton-delay-{d}.log") as (d_http, d_grpc):
            qd[d] = {c: level(c, Servers(d_http, d_grpc, None)) for c in levels}
    return {"default_us": DEFAULT_QUEUE_DELAY_US, "model": served.classifier,
            "client": "perf_analyzer" if level.use_pa else "the load engine, gRPC", "concurrency": levels,
            "rows": [{"delay_us": d, "concurrency": c, **{k: r[k] for k in ("throughput_rps", "latency_ms", "server")}}
                     for d, by_c in qd.items() for c, r in by_c.items()]}


def _other_spinning(bar: _Bars, onnx_dir: Path, tmp: Path, served: Served, classify: Workload, sessions: dict,
                    duration_s: float, warmup_s: float) -> dict:
    """The classifier through the gateway and Triton's HTTP endpoint (:data:`SPINNING_PATHS`) at concurrency 1 and
    its highest level again, on a Triton whose ONNX Runtime threads spin the other way than the default
    (``intra_op_spinning``), with a gateway of its own: what spinning costs or buys the whole service."""
    spinning = not INTRA_OP_SPINNING
    repo = tmp / "other-spinning"
    write_repository("cpu", [m for m in (served.classifier, served.lam_rule) if m], repo, onnx_dir=onnx_dir,
                     spinning=spinning)
    bar.show(f"starting Triton with spinning {'on' if spinning else 'off'}")
    levels = sorted({1, max(classify.concurrency)})
    rows = []
    with triton_server(repo, tmp / "triton-other-spinning.log") as (http_url, grpc_url), \
            gateway_process(Settings(triton_url=grpc_url), tmp / "gw-other-spinning.log") as gateway:
        servers = Servers(http_url, grpc_url, gateway, started_triton=True, started_gateway=True)
        for path in (p for p in SPINNING_PATHS if p in classify.paths):
            for c in levels:
                bar.show(f"spinning {'on' if spinning else 'off'}: {classify.key} {path} c={c}")
                rows.append(measure(path, classify, c, duration_s, warmup_s, servers, sessions, progress=bar.tick))
    return {"spinning": spinning, "runs": rows}


def _median_round(rounds: list[dict]) -> dict:
    """The round whose on/off ratio is the median (lower median for an even count; failed ratios last)."""
    ranked = sorted(rounds, key=lambda r: (r["speedup"] is None, r["speedup"] or 0.0))
    valid = [r for r in ranked if r["speedup"] is not None] or ranked
    return valid[(len(valid) - 1) // 2]


def write(payload: dict, out_dir: Path) -> list[Path]:
    """``serve.json``, ``serve.md`` and the three PNG plots; for the committed results also the pages' blocks."""
    paths = list(write_results("serve", payload, markdown(payload), out_dir))
    paths += plots.serve_plots(payload, out_dir)
    if out_dir.resolve() == RESULTS.resolve():
        write_docs_blocks(RESULTS.parent.parent, README_BEGIN, README_END, readme_block(payload))
    return paths


