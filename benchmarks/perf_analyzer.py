"""Triton's own load generator, ``perf_analyzer``, as the reference client for Triton-direct numbers.

``perf_analyzer`` ships in the ``tritonclient[all]`` wheel; release 2.47.0 is the newest whose binary runs
on this glibc and it pins ``numpy<2``, so it lives in its own virtualenv, set up (idempotently) by
``bash scripts/perf_analyzer_setup.sh`` (Debian's ``libb64-0d``, the ``nvidia-cuda-runtime-cu12`` libraries
on ``LD_LIBRARY_PATH`` through a wrapper). :func:`find` locates that wrapper (or ``$UNROLL_PERF_ANALYZER``);
when it is absent, ``unroll bench serve`` reports it missing with :data:`SETUP` and measures with its own
Python client only.

Inputs are real (``--input-data`` JSON from :func:`input_data`: the classifier's test digits, the denoiser's
noisy photos), one level per ``perf_analyzer`` call (``--concurrency-range C:C``) over gRPC, synchronous
requests, percentiles from its ``--verbose-csv`` report (:func:`parse_csv`), including the server's own split
per request (queue, compute input, compute infer, compute output) that ``perf_analyzer`` reads from Triton's
statistics over the measurement windows.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from unroll.errors import PerfAnalyzerError

ROOT = Path(__file__).resolve().parent.parent
SETUP = "bash scripts/perf_analyzer_setup.sh"
#: Where ``scripts/perf_analyzer_setup.sh`` puts its virtualenv and the wrapper that sets LD_LIBRARY_PATH.
DEFAULT_WRAPPER = ROOT / "build" / "perf_analyzer-venv" / "bin" / "perf_analyzer-run"
ENV_VAR = "UNROLL_PERF_ANALYZER"
#: ``perf_analyzer`` defaults for a shared 2-core machine: its default stability (the last 3 windows within 10 %
#: of each other) is rarely reached there, and it then reports nothing. We ask for 100 % over up to 6 windows of
#: 2 s; when even that fails, one retry with no stability demand (:data:`UNSTABLE_PCT`) reports the last 3 windows
#: and the row says ``stable: false``.
DEFAULT_WINDOW_MS = 2000
DEFAULT_STABILITY_PCT = 100
DEFAULT_MAX_TRIALS = 6
UNSTABLE_PCT = 100000
#: Server-side split columns of the CSV (µs per request) → our keys (ms), as in serve_bench's Triton split.
SERVER_COLUMNS = {"Server Queue": "queue_ms", "Server Compute Input": "compute_input_ms",
                  "Server Compute Infer": "compute_infer_ms", "Server Compute Output": "compute_output_ms"}
CLIENT_COLUMNS = {"Client Send": "client_send_ms", "Network+Server Send/Recv": "network_ms",
                  "Client Recv": "client_recv_ms"}
PERCENTILES = ("p50", "p90", "p95", "p99")


def find() -> Path | None:
    """The ``perf_analyzer`` to run: ``$UNROLL_PERF_ANALYZER``, else the set-up script's wrapper; ``None`` if absent."""
    env = os.environ.get(ENV_VAR)
    if env:
        p = Path(env)
        return p if p.is_file() and os.access(p, os.X_OK) else None
    return DEFAULT_WRAPPER if DEFAULT_WRAPPER.is_file() and os.access(DEFAULT_WRAPPER, os.X_OK) else None


def missing_reason() -> str:
    return (f"perf_analyzer not found (looked at ${ENV_VAR} and {DEFAULT_WRAPPER.relative_to(ROOT)}); "
            f"set it up with `{SETUP}`")


def input_data(feeds: Sequence[dict[str, np.ndarray]], batching: bool = True) -> dict:
    """``--input-data`` JSON for ``feeds`` (one dict of graph inputs per request, batch 1).

    With ``batching`` (``max_batch_size`` > 0) the batch axis is dropped (``perf_analyzer`` adds it, ``-b 1``);
    a ``[1]`` graph input (λ, σ) is then the config's ``dims: [1]``.
    """
    steps = []
    for feed in feeds:
        step = {}
        for name, a in feed.items():
            a = np.asarray(a)
            if batching:
                if a.shape[:1] != (1,):
                    raise ValueError(f"input {name!r} has shape {list(a.shape)}: batch 1 expected")
                shape = list(a.shape[1:]) or [1]
            else:
                shape = list(a.shape)
            step[name] = {"content": a.ravel().tolist(), "shape": shape}
        steps.append(step)
    return {"data": steps}


def write_input_data(feeds: Sequence[dict[str, np.ndarray]], path: Path, batching: bool = True) -> Path:
    path = Path(path)
    path.write_text(json.dumps(input_data(feeds, batching)))
    return path


def parse_csv(text: str) -> list[dict]:
    """``perf_analyzer -f FILE --verbose-csv`` → one dict per level (times in ms).

    Keys: ``concurrency`` (or ``request_rate``, a ``--request-rate-range`` report), ``throughput_rps``,
    ``latency_ms`` (p50/p90/p95/p99 and avg if reported), ``server`` (queue/compute input/infer/output ms per
    request), ``client`` (send, network + server, receive ms).
    Raises ValueError when the report lacks the columns (not a perf_analyzer latency report).
    """
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows:
        raise ValueError("perf_analyzer's CSV report has no rows")
    level = "Request Rate" if "Request Rate" in rows[0] else "Concurrency"
    need = {level, "Inferences/Second", "p50 latency", *SERVER_COLUMNS}
    missing = need - set(rows[0])
    if missing:
        raise ValueError(f"perf_analyzer's CSV report lacks {sorted(missing)} (columns: {sorted(rows[0])})")
    out = []
    for r in rows:
        lat = {p: float(r[f"{p} latency"]) / 1e3 for p in PERCENTILES if r.get(f"{p} latency")}
        if r.get("Avg latency"):
            lat["mean"] = float(r["Avg latency"]) / 1e3
        key = {"request_rate": float(r[level])} if level == "Request Rate" else {"concurrency": int(r[level])}
        out.append({**key, "throughput_rps": float(r["Inferences/Second"]),
                    "latency_ms": lat,
                    "server": {k: float(r[c]) / 1e3 for c, k in SERVER_COLUMNS.items()},
                    "client": {k: float(r[c]) / 1e3 for c, k in CLIENT_COLUMNS.items() if r.get(c)}})
    return out


def command(binary: Path, model: str, grpc_url: str, data: Path, concurrency: int, report: Path,
            window_ms: int = DEFAULT_WINDOW_MS, stability_pct: int = DEFAULT_STABILITY_PCT,
            max_trials: int = DEFAULT_MAX_TRIALS, rate: float | None = None, distribution: str = "constant",
            protocol: str = "grpc") -> list[str]:
    """The ``perf_analyzer`` command line for one level (batch 1, real inputs): ``concurrency`` synchronous requests
    in flight, or (``rate``) an open-loop request rate with ``distribution`` (constant or poisson), asynchronous
    requests (synchronous ones would cap what is outstanding at its threads: a closed loop); ``grpc_url`` is
    the ``host:port`` of ``protocol`` (grpc, or http: Triton's HTTP port or the gateway's ``/v2`` front)."""
    level = ["--request-rate-range", f"{rate:g}:{rate:g}", "--request-distribution", distribution] \
        if rate is not None else ["--concurrency-range", f"{concurrency}:{concurrency}"]
    return [str(binary), "-m", model, "-u", grpc_url, "-i", protocol, "--async" if rate is not None else "--sync",
            "-b", "1",
            "--input-data", str(data), *level,
            "--measurement-interval", str(window_ms), "--stability-percentage", str(stability_pct),
            "--max-trials", str(max_trials), "--percentile", "50", "-f", str(report), "--verbose-csv"]


def measure(model: str, grpc_url: str, feeds: Sequence[dict[str, np.ndarray]], concurrency: int,
            window_ms: int = DEFAULT_WINDOW_MS, stability_pct: int = DEFAULT_STABILITY_PCT,
            max_trials: int = DEFAULT_MAX_TRIALS, binary: Path | None = None, batching: bool = True,
            timeout_s: float | None = None, rate: float | None = None, distribution: str = "constant",
            protocol: str = "grpc") -> dict:
    """One level: run ``perf_analyzer`` against ``model`` at ``grpc_url`` on ``feeds`` and parse its report.

    Returns :func:`parse_csv`'s row plus ``command`` (what ran) and ``stable`` (False: the stability demand was
    dropped, see :data:`DEFAULT_STABILITY_PCT`). Raises :class:`PerfAnalyzerError`.
    """
    binary = binary or find()
    if binary is None:
        raise PerfAnalyzerError(missing_reason())
    timeout_s = timeout_s or max_trials * window_ms / 1e3 * 2 + 60
    tmp = Path(tempfile.mkdtemp(prefix="unroll-perf-analyzer-"))
    try:
        data = write_input_data(feeds, tmp / "input.json", batching)
        report = tmp / "report.csv"
        stable = True
        for pct in (stability_pct, UNSTABLE_PCT):
            cmd = command(binary, model, grpc_url, data, concurrency, report, window_ms, pct, max_trials, rate,
                          distribution, protocol)
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=tmp)
            except subprocess.TimeoutExpired:
                raise PerfAnalyzerError(f"perf_analyzer did not finish within {timeout_s:g} s: "
                                        f"{' '.join(cmd)}") from None
            except OSError as e:
                raise PerfAnalyzerError(f"could not run {binary}: {e}; {missing_reason()}") from None
            if p.returncode == 0 or "stable measurement" not in p.stdout + p.stderr:
                break
            stable = False
        if p.returncode != 0 or not report.exists():
            tail = " | ".join((p.stdout + p.stderr).strip().splitlines()[-4:])
            raise PerfAnalyzerError(f"perf_analyzer exited with {p.returncode} and "
                                    f"{'no' if not report.exists() else 'a'} report: {tail}")
        rows = parse_csv(report.read_text())
        row = rows[-1] if rate is not None else next((r for r in rows if r["concurrency"] == concurrency), rows[-1])
        row["stable"] = stable
        row["command"] = " ".join(Path(c).name if c in (str(data), str(report)) else c for c in cmd)
        return row
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
