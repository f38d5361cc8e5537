"""``unroll profile``: a deployment measured against a latency objective, level by level, on :mod:`.loadgen`.

An objective (:func:`parse_slo`) is one or more limits joined by commas: ``p50``/``p90``/``p95``/``p99``/``max``/
``mean`` latency (``20ms``, ``0.5s``, ``800us``) and ``errors`` (``1%`` or ``0.01``). Per level: whether it is met
(and each limit's measured value), the *attainment* (share of the requests sent that were answered within the latency
limit of the objective's highest percentile) and the *goodput* (those requests per second). :func:`search` finds the
highest sustained rate that meets it: doubling from the start rate until a level fails, then bisecting between the
last level met and the first failed until they are within ``resolution`` of each other; the report names the first
failing level and why. Where Triton's HTTP URL is given, each level also holds the model's Triton statistics over
the level (:func:`triton_stats_delta`: queue, compute input / infer / output per request, executed batch sizes).
Results: a JSON (:data:`SCHEMA_VERSION`), a CSV of the levels, a rich table.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unroll.benchmarks import loadgen
from unroll.benchmarks.common import latency_summary, machine_info
from unroll.benchmarks.loadgen import LevelResult, Load
from unroll.benchmarks.profile_observe import Observer
from unroll.benchmarks.profile_target import Deployment
from unroll.errors import BenchError, ClientBound, SloMissed, UsageError
from unroll.objective import PERCENTILES, Bound, good_ms, parse_bounds

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Limit(Bound):
    """One limit of an objective, measured on a level."""

    def measured(self, level: LevelResult) -> float:
        if self.metric == "errors":
            return level.error_rate
        if self.metric == "mean":
            return latency_summary(level.latencies_ms)["mean"]
        return level.percentile(PERCENTILES[self.metric])

    def met(self, level: LevelResult) -> bool:
        v = self.measured(level)
        return not math.isnan(v) and (v < self.value if self.strict else v <= self.value)

    def why(self, level: LevelResult) -> str:
        v = self.measured(level)
        if self.metric == "errors":
            return f"errors {100 * v:.2f}% > {100 * self.value:g}%"
        if math.isnan(v):
            return f"{self.metric}: no request answered"
        return f"{self.metric} {v:.1f} ms > {self.value:g} ms"


@dataclass(frozen=True)
class Slo:
    """An objective: every limit must be met."""

    limits: tuple[Limit, ...]

    def __str__(self) -> str:
        return ",".join(map(str, self.limits))

    @property
    def good_ms(self) -> float | None:
        """Latency bound a request must meet to count as good: that of the highest percentile limited."""
        return good_ms(self.limits)

    def failures(self, level: LevelResult) -> list[str]:
        return [lim.why(level) for lim in self.limits if not lim.met(level)]

    def attainment(self, level: LevelResult) -> float:
        """Share of the requests sent that were answered (within :attr:`good_ms`, where latency is limited)."""
        if not level.sent:
            return float("nan")
        bound = self.good_ms
        good = level.ok if bound is None else sum(1 for x in level.latencies_ms if x <= bound)
        return good / level.sent

    def goodput(self, level: LevelResult) -> float:
        a = self.attainment(level)
        return a * level.sent / level.duration_s if level.duration_s > 0 and not math.isnan(a) else float("nan")


def parse_slo(text: str | None) -> Slo | None:
    """``"p99<=20ms,errors<=1%"`` → :class:`Slo` (``None``/empty: no objective; grammar: :mod:`unroll.objective`)."""
    if not text or not text.strip():
        return None
    return Slo(tuple(Limit(b.metric, b.value, b.strict) for b in parse_bounds(text)))


def parse_range(text: str, what: str, integer: bool = False) -> list[float]:
    """``"A:B:STEP"`` → A, A+STEP, … ≤ B; ``"A:B"`` (step A); ``"A,B,C"`` or ``"A"``: those values."""
    try:
        if ":" in text:
            parts = [float(x) for x in text.split(":")]
            if len(parts) == 2:
                parts.append(parts[0])
            a, b, step = parts
            if step <= 0 or b < a:
                raise ValueError
            values = [a + k * step for k in range(int(math.floor((b - a) / step + 1e-9)) + 1)]
        else:
            values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{what}: cannot read {text!r}: write START:STOP:STEP (e.g. 10:100:10) or a list (10,20,50)"
                         ) from None
    if not values or any(v <= 0 for v in values):
        raise UsageError(f"{what}: {text!r}: values must be positive")
    return [float(int(v)) for v in values] if integer else values


# -------------------------------------------------------------------------------------------- repeated runs


def mean_interval(values: Sequence[float], level_pct: float = 95.0) -> tuple[float, float] | None:
    """The mean of ``values`` and the half-width of its ``level_pct`` % confidence interval (Student's t);
    ``None`` with fewer than two finite values."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if len(values) < 2:
        return None
    from scipy import stats

    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, float(stats.t.ppf(0.5 + level_pct / 200, n - 1)) * sd / math.sqrt(n)


def pool(runs: Sequence[LevelResult]) -> LevelResult:
    """Repeated runs of one level as one result: their requests, latencies and errors together over their summed
    windows; client-bound when any run was."""
    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    out = LevelResult(load=first.load, duration_s=sum(r.duration_s for r in runs),
                      late_tolerance_ms=first.late_tolerance_ms, rate_tolerance=first.rate_tolerance)
    for r in runs:
        out.add(r)
        out.wall_s += r.wall_s
    out.aborted = next((r.client_bound for r in runs if r.client_bound), None)
    return out


# --------------------------------------------------------------------------------------------- levels, search


@dataclass
class Level:
    """One measured level (its runs pooled in :attr:`result`), what the deployment reported over it, and its verdict
    against the objective: with repeated runs, each limit is judged on its confidence interval's unfavourable end."""

    result: LevelResult
    slo: Slo | None
    triton: dict | None = None
    observed: dict[str, Any] = field(default_factory=dict)  #: the other observers' reports (gateway, CPU, GPU)
    runs: list[LevelResult] = field(default_factory=list)  #: the repetitions (``--runs``), when more than one

    def interval(self, limit: Limit) -> tuple[float, float] | None:
        """The limit's measured mean and CI half-width over the runs (``None``: fewer than two runs)."""
        return mean_interval([limit.measured(r) for r in self.runs]) if len(self.runs) >= 2 else None

    @property
    def failures(self) -> list[str]:
        bound = self.result.client_bound
        out = [f"client-bound: {bound}"] if bound else []
        if self.slo is None:
            return out
        for lim in self.slo.limits:
            ci = self.interval(lim)
            if ci is None:
                if not lim.met(self.result):
                    out.append(lim.why(self.result))
                continue
            worst = ci[0] + ci[1]
            if not (worst < lim.value if lim.strict else worst <= lim.value):
                unit = ("%", 100.0) if lim.metric == "errors" else (" ms", 1.0)
                out.append(f"{lim.metric} {unit[1] * ci[0]:.3g} ± {unit[1] * ci[1]:.2g}{unit[0]} over "
                           f"{len(self.runs)} runs: its 95% interval's upper end is over {unit[1] * lim.value:g}"
                           f"{unit[0]}")
        return out

    @property
    def met(self) -> bool:
        return not self.failures

    def row(self, with_runs: bool = True) -> dict[str, Any]:
        r, lat = self.result, latency_summary(self.result.latencies_ms)
        row: dict[str, Any] = {
            "load": r.load.label, "mode": "open" if r.load.open_loop else "closed", "arrivals": r.load.arrivals,
            "cv": r.load.cv if r.load.arrivals == "gamma" else None, "offered_rps": r.offered_rate,
            "concurrency": r.load.concurrency, "scheduled_rps": r.scheduled_rate if r.load.open_loop else None,
            "send_rps": r.send_rate if r.load.open_loop else None,
            "late_p99_ms": r.late_p99_ms if r.load.open_loop else None, "client_bound": r.client_bound,
            "duration_s": r.duration_s, "sent": r.sent, "ok": r.ok, "throughput_rps": r.throughput,
            "error_rate": r.error_rate, "errors": dict(r.errors),
            **{f"{k}_ms": v for k, v in lat.items()},
            "client_cpu_s": r.client_cpu_s, "client_cpu_ms_per_request": r.cpu_ms_per_request,
        }
        if self.slo is not None:
            row.update(slo_met=self.met, slo_failures=self.failures, attainment=self.slo.attainment(r),
                       goodput_rps=self.slo.goodput(r))
        if self.triton is not None:
            row["triton"] = self.triton
        row.update(self.observed)
        if with_runs and len(self.runs) >= 2:
            row["runs"] = [Level(run, self.slo).row(with_runs=False) for run in self.runs]
        return row


@dataclass
class Runner:
    """Runs levels against one deployment (its bodies, its headers), ``runs`` times each, with the observers
    (:mod:`.profile_observe`) read around each run."""

    deployment: Deployment
    slo: Slo | None
    duration_s: float = 10.0
    warmup_s: float = 2.0
    timeout_s: float = 30.0
    requests: int | None = None
    observers: Sequence[Observer] = ()
    progress: Callable[[Load, float], None] | None = None
    seed: int = 0
    late_tolerance_ms: float = loadgen.LATE_TOLERANCE_MS
    runs: int = 1

    def _once(self, load: Load, k: int) -> tuple[LevelResult, dict[str, Any]]:
        d = self.deployment
        for o in self.observers:
            o.start()
        result = loadgen.run(d.url, d.payloads, load, self.duration_s, self.warmup_s, self.timeout_s, d.headers,
                             self.seed + k, self.requests,
                             None if self.progress is None else
                             lambda f: self.progress(load, (k + f) / self.runs), self.late_tolerance_ms)
        return result, {o.name: o.stop(result.client_requests) for o in self.observers}

    def level(self, load: Load) -> Level:
        results, reports = [], []
        for k in range(self.runs):
            result, seen = self._once(load, k)
            results.append(result)
            reports.append(seen)
            if result.client_bound:
                break
        observed = _pool_reports(reports)
        return Level(pool(results), self.slo, observed.pop("triton", None), observed,
                     results if len(results) > 1 else [])


def _pool_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The observers' reports of a level's runs: the last run's (each is a whole run's own picture), a run's
    missing report replaced by an earlier one's."""
    out: dict[str, Any] = {}
    for seen in reports:
        out.update({k: v for k, v in seen.items() if v is not None or k not in out})
    return out


@dataclass
class SearchResult:
    """The highest rate met, the first level that failed (and why), every level run, in order."""

    best: Level | None
    first_failed: Level | None
    levels: list[Level]
    resolution: float
    capped: bool = False  #: the search reached ``max_rate`` with every level met

    def summary(self) -> dict[str, Any]:
        return {"highest_rate_met_rps": self.best.result.offered_rate if self.best else None,
                "first_failed_rps": self.first_failed.result.offered_rate if self.first_failed else None,
                "first_failed_why": self.first_failed.failures if self.first_failed else None,
                "resolution": self.resolution, "reached_max_rate": self.capped}


def _rate_load(rate: float, arrivals: str, cv: float) -> Load:
    return Load(rate=rate, arrivals=arrivals, cv=cv)


def _check_client(level: Level, best: Level | None = None) -> None:
    bound = level.result.client_bound
    if bound:
        so_far = f"; the highest rate met before it: {best.result.offered_rate:g} req/s" if best else ""
        raise ClientBound(f"the client cannot send {level.result.load.label}: {bound}{so_far} (run the client on "
                          "another machine, or lower the rate)")


def search(run_level: Callable[[Load], Level], slo: Slo, start: float, arrivals: str = "constant", cv: float = 1.0,
           resolution: float = 0.05, max_rate: float = 100_000.0) -> SearchResult:
    """Bracket by doubling from ``start`` until a level fails the objective, then bisect between the last rate met
    and the first failed until ``(high - low) / low <= resolution``. A level the client could not send stops the
    search (:class:`ClientBound`); an objective missed at ``start`` is :class:`SloMissed`."""
    if start <= 0 or resolution <= 0:
        raise UsageError("the search needs a positive start rate and resolution")
    levels: list[Level] = []

    def measure(rate: float) -> Level:
        lv = run_level(_rate_load(rate, arrivals, cv))
        levels.append(lv)
        _check_client(lv, best)
        return lv

    best: Level | None = None
    rate = start
    first = measure(rate)
    if not first.met:
        raise SloMissed(f"the objective {slo} is missed already at the lowest rate, {rate:g} req/s: "
                        f"{'; '.join(first.failures)}")
    best, failed = first, None
    while failed is None:
        if rate * 2 > max_rate:
            return SearchResult(best, None, levels, resolution, capped=True)
        rate *= 2
        lv = measure(rate)
        if lv.met:
            best = lv
        else:
            failed = lv
    lo, hi = best.result.offered_rate or start, failed.result.offered_rate or rate
    first_failed = failed
    while (hi - lo) / lo > resolution:
        mid = (lo + hi) / 2
        lv = measure(mid)
        if lv.met:
            best, lo = lv, mid
        else:
            first_failed, hi = lv, mid
    return SearchResult(best, first_failed, levels, resolution)


def sweep(run_level: Callable[[Load], Level], loads: Sequence[Load], slo: Slo | None) -> list[Level]:
    """Each load in turn; a level the client could not send stops the sweep (:class:`ClientBound`), and an objective
    missed at the first level is :class:`SloMissed` (later misses are results)."""
    levels = []
    for k, load in enumerate(loads):
        lv = run_level(load)
        _check_client(lv)
        if k == 0 and slo is not None and not lv.met:
            raise SloMissed(f"the objective {slo} is missed already at the lowest level, {load.label}: "
                            f"{'; '.join(lv.failures)}")
        levels.append(lv)
    return levels


# ------------------------------------------------------------------------------------------------------ output

CSV_FIELDS = ("load", "mode", "arrivals", "cv", "offered_rps", "concurrency", "scheduled_rps", "send_rps",
              "late_p99_ms", "client_bound", "duration_s", "sent", "ok", "throughput_rps", "error_rate", "mean_ms",
              "p50_ms", "p90_ms", "p95_ms", "p99_ms", "max_ms", "slo_met", "attainment", "goodput_rps",
              "client_cpu_s", "client_cpu_ms_per_request", "errors", "triton_queue_ms", "triton_compute_input_ms",
              "triton_compute_infer_ms", "triton_compute_output_ms", "triton_batch_sizes",
              "service_cpu_ms_per_request", "gateway_triton_call_mean_ms", "gpu_util_mean")


def results_payload(deployment: Deployment, levels: list[Level], slo: Slo | None, settings: dict[str, Any],
                    found: SearchResult | None = None) -> dict[str, Any]:
    """The results JSON: schema version, machine, the deployment (its ``/v1/models`` answer), settings, levels."""
    return {"schema_version": SCHEMA_VERSION, "kind": "unroll-profile", "machine": machine_info(threads=1),
            "deployment": {"target": deployment.target, "url": deployment.url, "model": deployment.model,
                           "task": deployment.task, "inputs": deployment.inputs, "v1_models": deployment.listing,
                           "model_info": deployment.metadata},
            "settings": settings, "slo": str(slo) if slo else None,
            "search": found.summary() if found else None, "levels": [lv.row() for lv in levels]}


def csv_text(levels: list[Level]) -> str:
    """The levels as CSV (one row a level; Triton's split flattened)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for lv in levels:
        row = lv.row()
        t = row.pop("triton", None) or {}
        for k in ("queue", "compute_input", "compute_infer", "compute_output"):
            row[f"triton_{k}_ms"] = t.get(f"{k}_ms")
        row["triton_batch_sizes"] = json.dumps(t["batch_sizes"]) if t else None
        row["service_cpu_ms_per_request"] = (row.get("service_cpu") or {}).get("total_cpu_ms_per_request")
        row["gateway_triton_call_mean_ms"] = (row.get("gateway") or {}).get("triton_call_mean_ms")
        row["gpu_util_mean"] = (row.get("gpu") or {}).get("gpu_util_mean")
        row["errors"] = json.dumps(row["errors"]) if row["errors"] else ""
        w.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()})
    return buf.getvalue()


def write_outputs(out_dir: Path, stem: str, payload: dict[str, Any], levels: list[Level]) -> tuple[Path, Path]:
    """``out_dir/STEM.json`` and ``out_dir/STEM.csv``, each written whole (a temporary file renamed into place)."""
    from unroll.benchmarks.common import _strict

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / f"{stem}.json", out_dir / f"{stem}.csv"
    texts = json.dumps(_strict(payload), indent=2, allow_nan=False) + "\n", csv_text(levels)
    for path, text in zip(paths, texts, strict=True):
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    return paths


def table(levels: list[Level], slo: Slo | None, title: str):
    """A rich table of the levels."""
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for col in ("load", "sent/s", "answered/s", "p50 ms", "p95 ms", "p99 ms", "errors", "client ms/req"):
        t.add_column(col, justify="left" if col == "load" else "right")
    if slo is not None:
        t.add_column("goodput/s", justify="right")
        t.add_column(f"SLO {slo}")
    if any(lv.triton for lv in levels):
        t.add_column("Triton queue / infer ms", justify="right")
    service = any(lv.observed.get("service_cpu") for lv in levels)
    if service:
        t.add_column("server CPU ms/req", justify="right")
    for lv in levels:
        r = lv.result
        send = f"{r.send_rate:.1f}" if r.load.open_loop else "-"
        cells = [r.load.label, send, f"{r.throughput:.1f}", f"{r.percentile(50):.1f}", f"{r.percentile(95):.1f}",
                 f"{r.percentile(99):.1f}", f"{100 * r.error_rate:.2f}%" if r.sent else "-",
                 f"{r.cpu_ms_per_request:.2f}"]
        if slo is not None:
            cells += [f"{slo.goodput(r):.1f}", "[green]met[/]" if lv.met else f"[red]{'; '.join(lv.failures)}[/]"]
        if any(x.triton for x in levels):
            tr = lv.triton or {}
            q, i = tr.get("queue_ms"), tr.get("compute_infer_ms")
            cells.append("-" if q is None or i is None else f"{q:.2f} / {i:.2f}")
        if service:
            total = (lv.observed.get("service_cpu") or {}).get("total_cpu_ms_per_request")
            cells.append("-" if total is None else f"{total:.2f}")
        t.add_row(*cells)
    return t


def ensure_loads(rates: Sequence[float], concurrencies: Sequence[float], arrivals: str, cv: float,
                 trace: tuple[float, ...] | None) -> list[Load]:
    """The levels of a sweep: a trace (one level), else the rates, then the concurrencies."""
    if trace is not None:
        return [Load(arrivals="trace", trace=trace)]
    loads = [Load(rate=r, arrivals=arrivals, cv=cv) for r in rates]
    loads += [Load(concurrency=int(c)) for c in concurrencies]
    if not loads:
        raise BenchError("nothing to run: give --rate-range, --concurrency-range, --trace or --search")
    return loads
