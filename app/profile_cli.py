"""``unroll profile MODEL --url URL``: a running deployment profiled against a latency objective under open- or
closed-loop load (:mod:`unroll.benchmarks.profile`, on the load engine :mod:`unroll.benchmarks.loadgen`), its
results written as JSON, CSV and plots (:mod:`unroll.benchmarks.profile_plots`); ``unroll profile compare A B``
sets two results side by side (:mod:`unroll.benchmarks.profile_compare`).

``profile`` is a group (:class:`ProfileGroup`) whose ``run`` command is its default: a first argument that names no
command of the group (the model, or one of ``run``'s options) is ``run``'s, so ``unroll profile MODEL --url URL`` and
``unroll profile run MODEL --url URL`` are the same command (a model named ``compare`` needs the second form).

The measuring modules are imported inside the command (this module is imported at every ``unroll`` start). Every
failure before the results are complete — an unreachable URL, a refused key, a model not served, an objective
missed at the lowest level, a rate the client cannot send — is one ``error:`` line and a non-zero exit, and
nothing is written.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import click
import typer
from rich.console import Console
from typer.core import TyperGroup

from unroll.app.errors import handles_errors
from unroll.errors import UsageError

console = Console()
err = Console(stderr=True)


DEFAULT_COMMAND = "run"


class ProfileGroup(TyperGroup):
    """``unroll profile``'s commands, ``run`` the default for a first argument that names none of them."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            args = [DEFAULT_COMMAND, *args]
        return super().parse_args(ctx, args)

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return ["MODEL --url URL [OPTIONS] | COMMAND [ARGS]..."]


profile_app = typer.Typer(
    cls=ProfileGroup, no_args_is_help=True,
    help="Profile a running deployment against a latency objective, or compare two profiles.\n\n"
         "`unroll profile MODEL --url URL [OPTIONS]` (short for `unroll profile run MODEL …`; its options: "
         "`unroll profile run --help`) measures MODEL level by level under open- or closed-loop load and writes "
         "MODEL-profile.json, .csv and PNG plots.\n\n"
         "`unroll profile compare A.json B.json [--out DIR]` sets two such results side by side, level by level, "
         "with an overlay plot of their latency curves.")


@handles_errors
def profile(
    model: Annotated[str, typer.Argument(help="The served model's name (as `GET /v1/models` or Triton lists it)")],
    url: Annotated[str, typer.Option(help="The deployment: the gateway's base URL (http://host:8080), or with "
                                          "--target triton Triton's HTTP URL (http://host:8000) or gRPC port "
                                          "(grpc://host:8001)")],
    target: Annotated[str, typer.Option(help="v1: the gateway's task route with images; v2: the gateway's KServe v2 "
                                             "front; triton: Triton's own HTTP or gRPC port")] = "v1",
    key: Annotated[str | None, typer.Option(help="API key: the gateway's (X-API-Key), or Triton's restricted-API "
                                                 "key with --target triton", envvar="UNROLL_PROFILE_KEY")] = None,
    triton_url: Annotated[str | None, typer.Option(help="Where to read Triton's statistics per level (queue, compute, "
                                                        "batch sizes): Triton's HTTP or grpc:// URL; default: --url "
                                                        "(the gateway's /v2 front serves them too)")] = None,
    triton_key: Annotated[str | None, typer.Option(help="Triton's restricted-API key for --triton-url (default: "
                                                        "--key with --target triton)")] = None,
    rate_range: Annotated[str | None, typer.Option(help="Open-loop request rates, req/s: START:STOP:STEP or a "
                                                        "list (10,20,50)")] = None,
    search: Annotated[bool, typer.Option("--search", help="Find the highest rate meeting --slo: double from "
                                                          "--start-rate until a level fails, then bisect")] = False,
    start_rate: Annotated[float, typer.Option(help="--search: the first rate, req/s")] = 10.0,
    resolution: Annotated[float, typer.Option(help="--search: stop bisecting when (high - low) / low is at most "
                                                   "this")] = 0.05,
    max_rate: Annotated[float, typer.Option(help="--search: never offer more than this, req/s")] = 10_000.0,
    concurrency_range: Annotated[str | None, typer.Option(help="Closed-loop levels (requests in flight): "
                                                               "START:STOP:STEP or a list (1,4,16)")] = None,
    arrivals: Annotated[str, typer.Option(help="Open-loop arrivals: constant, poisson or gamma")] = "poisson",
    cv: Annotated[float, typer.Option(help="gamma: coefficient of variation of the gaps (1 = Poisson, above 1: "
                                           "bursty)")] = 2.0,
    trace: Annotated[Path | None, typer.Option(help="Replay the send times in this file (seconds, one a line) as "
                                                    "one open-loop level, whole (--duration does not cut "
                                                    "it)")] = None,
    slo: Annotated[str | None, typer.Option(help="Objective, limits joined by commas: p50/p90/p95/p99/max/mean "
                                                 "latency (p99<=20ms) and errors (errors<=1%)")] = None,
    duration: Annotated[float, typer.Option(help="Measured seconds per level")] = 10.0,
    runs: Annotated[int, typer.Option(help="Measure each level this many times: the levels then hold 95% "
                                           "confidence intervals, and a level meets --slo only if each interval's "
                                           "unfavourable end does")] = 1,
    requests: Annotated[int | None, typer.Option(help="Measured requests per level, instead of --duration")] = None,
    warmup: Annotated[float, typer.Option(help="Seconds of load before each level's measurement (not "
                                               "counted)")] = 2.0,
    timeout: Annotated[float, typer.Option(help="Request timeout, s (a request past it counts as an error)")] = 30.0,
    late_tolerance_ms: Annotated[float, typer.Option(help="A level whose sends fell behind schedule by more than "
                                                          "this (p99, ms) or than the mean gap between sends is "
                                                          "client-bound: refused, not reported")] = 10.0,
    images: Annotated[Path | None, typer.Option(help="--target v1: send the image files of this folder")] = None,
    inputs: Annotated[str, typer.Option(help="--target v1 without --images: card (the test images of the dataset "
                                             "the model's card names), generated, or auto (card where this package "
                                             "has that dataset)")] = "auto",
    size: Annotated[int | None, typer.Option(help="Generated inputs: images of SIZE×SIZE (v1), dynamic tensor axes "
                                                  "of SIZE (v2, triton); default 64. Card images: centre-cropped to "
                                                  "SIZE×SIZE")] = None,
    binary: Annotated[bool, typer.Option("--binary/--json", help="v2, triton: binary tensors or JSON")] = True,
    out: Annotated[Path | None, typer.Option(help="Folder for MODEL-profile.json and .csv (default: "
                                                  "./profile-MODEL-UTCTIME)")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar")] = True,
) -> None:
    """Profile MODEL of a running deployment: latency, throughput and errors per load level, against --slo.

    Open-loop levels (--rate-range, --search, --trace) time each request from its scheduled send time, so a server
    that stalls shows its queue; a level the client could not send at is refused, never reported as offered.
    Closed-loop levels (--concurrency-range) keep that many requests in flight. Per level it also reads what the
    deployment reports: Triton's time split and batch sizes, the gateway's own metrics, CPU ms per request of each
    local process (gateway workers, tritonserver, backend stubs: a deployment on this machine) and the GPU (NVML,
    where present). Writes a JSON (machine, the deployment's /v1/models answer, every level), a CSV, and the plots
    the run has data for: MODEL-profile-latency.png (percentiles against offered load), -throughput.png (against
    concurrency), -split.png (Triton's time split per level).
    """
    from unroll.benchmarks import loadgen
    from unroll.benchmarks import profile as prof
    from unroll.benchmarks.profile_observe import observers_for
    from unroll.benchmarks.profile_target import discover

    if duration <= 0 or warmup < 0 or timeout <= 0 or runs < 1:
        raise UsageError("--duration and --timeout must be positive, --warmup not negative, --runs at least 1")
    slo_ = prof.parse_slo(slo)
    if search and (rate_range or concurrency_range or trace):
        raise UsageError("--search finds the rate itself: give it without --rate-range, --concurrency-range, --trace")
    if search and slo_ is None:
        raise UsageError("--search needs an objective: --slo p99<=20ms (for example)")
    if arrivals not in ("constant", "poisson", "gamma"):
        raise UsageError(f"--arrivals: constant, poisson or gamma, not {arrivals!r} (a trace: --trace FILE)")
    rates = prof.parse_range(rate_range, "--rate-range") if rate_range else []
    concurrencies = prof.parse_range(concurrency_range, "--concurrency-range", integer=True) \
        if concurrency_range else []
    trace_times = loadgen.read_trace(trace) if trace is not None else None
    if not search:
        loads = prof.ensure_loads(rates, concurrencies, arrivals, cv, trace_times)
    deployment = discover(target, url, model, key, images, size, binary, inputs=inputs)
    observers = observers_for(target, deployment.url, model, key, triton_url, triton_key)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeElapsedColumn(), console=err, disable=not progress, transient=False) as bar:
        tasks: dict[str, int] = {}

        def on_progress(load: loadgen.Load, fraction: float) -> None:
            key_ = load.label + f"#{len(runner_levels)}"
            if key_ not in tasks:
                tasks[key_] = bar.add_task(load.label, total=1.0)
            bar.update(tasks[key_], completed=fraction)

        runner_levels: list[prof.Level] = []
        runner = prof.Runner(deployment, slo_, duration, warmup, timeout, requests, observers, on_progress,
                             late_tolerance_ms=late_tolerance_ms, runs=runs)

        def run_level(load: loadgen.Load) -> prof.Level:
            lv = runner.level(load)
            runner_levels.append(lv)
            return lv

        found = None
        if search:
            assert slo_ is not None
            found = prof.search(run_level, slo_, start_rate, arrivals, cv, resolution, max_rate)
            levels = found.levels
        else:
            levels = prof.sweep(run_level, loads, slo_)
    settings = {"target": target, "arrivals": arrivals, "cv": cv if arrivals == "gamma" else None,
                "duration_s": duration, "requests": requests, "warmup_s": warmup, "timeout_s": timeout,
                "size": size if images is None else None, "images": str(images) if images else None,
                "inputs": inputs if images is None else "images",
                "binary": binary, "trace": str(trace) if trace else None,
                "late_tolerance_ms": late_tolerance_ms, "rate_tolerance": loadgen.RATE_TOLERANCE, "runs": runs,
                "observers": {o.name: o.why_absent or "read" for o in observers}}
    payload = prof.results_payload(deployment, levels, slo_, settings, found)
    folder = out or Path(f"profile-{model}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    json_path, csv_path = prof.write_outputs(folder, f"{model}-profile", payload, levels)
    from unroll.benchmarks.profile_plots import write_plots

    plots = write_plots(json.loads(json_path.read_text()), folder, f"{model}-profile")  # what the file holds
    console.print(prof.table(levels, slo_, f"{model} via {target} at {deployment.url} ({deployment.inputs})"))
    if found is not None:
        s = found.summary()
        if found.best is not None and found.capped:
            console.print(f"every level met {slo_} up to --max-rate: capacity ≥ {s['highest_rate_met_rps']:g} req/s")
        elif found.best is not None:
            console.print(f"highest rate meeting {slo_}: [bold]{s['highest_rate_met_rps']:.4g} req/s[/] (first "
                          f"failed: {s['first_failed_rps']:.4g} req/s: {'; '.join(s['first_failed_why'])})")
    console.print(f"wrote {json_path}, {csv_path}" + "".join(f", {p.name}" for p in plots))


@handles_errors
def compare(
    a: Annotated[Path, typer.Argument(help="A results JSON of `unroll profile` (MODEL-profile.json): the baseline, A",
                                      metavar="A.json", show_default=False)],
    b: Annotated[Path, typer.Argument(help="The results JSON set against it, B", metavar="B.json",
                                      show_default=False)],
    out: Annotated[Path | None, typer.Option(help="Folder for profile-compare.md and profile-compare-latency.png "
                                                  "(default: ./profile-compare-UTCTIME)")] = None,
) -> None:
    """Set two `unroll profile` results side by side, level by level, with an overlay plot.

    Per level (matched by offered rate or concurrency): p50, p95, p99, the answered rate, errors and attainment as
    A → B (change), and each run's capacity from --search; a rich table, profile-compare.md and
    profile-compare-latency.png. Confidence intervals appear only where levels hold repeated runs. A missing file, a
    file that is not a profile result or one of another schema_version is one error line.
    """
    from unroll.benchmarks import profile_compare as pc

    cmp = pc.compare([a, b])  # both read and checked before anything is written
    folder = out or Path(f"profile-compare-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    written = pc.write(cmp, folder)
    console.print(pc.table(cmp))
    console.print("wrote " + ", ".join(map(str, written)))


profile_app.command(DEFAULT_COMMAND)(profile)
profile_app.command("compare")(compare)
