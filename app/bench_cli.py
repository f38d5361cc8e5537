"""``unroll bench serve | models | quality | all``: Typer-annotated functions for ``bench_app`` in ``cli``.

The benchmark modules are imported inside the commands: they pull in torch, onnxruntime and libraries the serving
image does not install, and this module is imported at every ``unroll`` start, in that image too.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from unroll import artifacts
from unroll.app.errors import fail, handles_errors
from unroll.errors import BenchError, QuantizeError
from unroll.registry import list_models

RESULTS = artifacts.RESULTS_DIR
ONNX_DIR = artifacts.ONNX_DIR
err = Console(stderr=True)

OutOpt = Annotated[Path, typer.Option("--out", help="Results folder (JSON, Markdown, PNG are rewritten there)")]
OnnxOpt = Annotated[Path, typer.Option(help="ONNX exports (missing or stale ones are exported first)")]
ThreadsOpt = Annotated[int, typer.Option(help="Threads for every engine (PyTorch, ONNX Runtime, Triton's models)")]
ProgressOpt = Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress bars")]


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise typer.BadParameter(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise typer.BadParameter(f"{what}: expected integers ≥ 1, got {text!r}")
    return vals


def _wrote(out: Path, stems: list[str]) -> None:
    """Name the files a benchmark wrote: STEM.json, STEM.md, STEM.png and its STEM_*.png plots."""
    files = sorted(p.name for s in stems for p in out.glob(f"{s}*")
                   if (p.stem == s and p.suffix in (".json", ".md", ".png"))
                   or (p.stem.startswith(f"{s}_") and p.suffix == ".png"))
    err.print(f"[green]✓[/] wrote {', '.join(files)} in {out}")


def _targets(payload: dict) -> None:
    for t in payload.get("targets", []):
        mark = "[dim]n/a[/]" if t["met"] is None else ("[green]met[/]" if t["met"] else "[bold red]not met[/]")
        err.print(f"  {mark}  {t['target']}: {t['measured'] or 'not measured'}")


@handles_errors
def bench_serve(
    duration: Annotated[float, typer.Option(help="Measured seconds per concurrency level")] = 5.0,
    warmup: Annotated[float, typer.Option(help="Unrecorded warm-up seconds before each level")] = 0.5,
    concurrency: Annotated[str, typer.Option(help="In-flight requests per level, the classifier")] = "1,2,4,8,16,32",
    denoise_concurrency: Annotated[str, typer.Option(help="In-flight requests per level, the denoiser")] = "1,4",
    denoise_sizes: Annotated[str, typer.Option(help="Denoiser image sides (square images)")] = "256,512",
    batching_concurrency: Annotated[int, typer.Option(help="Concurrency of the batching on/off comparison")] = 16,
    batching_rounds: Annotated[int | None, typer.Option(help="Interleaved on/off rounds of that comparison, median "
                                                             "ratio reported [default: 3; 1 with --quick]")] = None,
    paths: Annotated[str, typer.Option(help="Paths to measure: onnxruntime, triton-http, triton-grpc, "
                                            "triton-grpc-image (the PNG bytes), gateway")]
    = "onnxruntime,triton-http,triton-grpc,triton-grpc-image,gateway",
    url: Annotated[str | None, typer.Option(help="Attach to a running gateway (base URL, e.g. "
                                                 "http://127.0.0.1:8080); needs --triton-url")] = None,
    triton_url: Annotated[str | None, typer.Option(help="Attach to a running Triton: its HTTP HOST:PORT")] = None,
    triton_grpc_url: Annotated[str | None, typer.Option(help="Its gRPC HOST:PORT (default: HTTP port + 1)")] = None,
    quick: Annotated[bool, typer.Option(help="Smoke run: 1 s levels, concurrency 1,4, one 128² denoiser size")]
    = False,
    threads: ThreadsOpt = 2,
    onnx_dir: OnnxOpt = ONNX_DIR,
    out: OutOpt = RESULTS,
    progress: ProgressOpt = True,
) -> None:
    """The serving path under load: in-process ONNX Runtime vs Triton (HTTP, gRPC) vs the REST gateway.

    Starts Triton and the gateway on free ports (or attaches with --url / --triton-url), then runs a
    closed-loop concurrency sweep on the trained demo models (registered with committed weights): the
    classifier's test samples and the denoiser's noisy held-out photos (inputs from their cards).
    Per level: throughput, client latency p50/p90/p95/p99/max, errors, Triton's own split (queue,
    compute input, infer, output) and average batch size, the gateway's share. Then dynamic
    batching on vs off (a second Triton with max_batch_size 1) at --batching-concurrency.
    Writes serve.json, serve.md (with the targets) and serve_latency/throughput/split.png.
    """
    from unroll.benchmarks import serve_bench

    kw: dict = {"duration_s": duration, "warmup_s": warmup, "concurrency": _ints(concurrency, "--concurrency"),
                "denoise_concurrency": _ints(denoise_concurrency, "--denoise-concurrency"),
                "denoise_sizes": _ints(denoise_sizes, "--denoise-sizes")}
    if quick:
        kw = {"duration_s": min(duration, 1.0), "warmup_s": min(warmup, 0.3), "concurrency": (1, 4),
              "denoise_concurrency": (1,), "denoise_sizes": (128,), "classify_samples": 64}
    if batching_rounds is None:
        batching_rounds = 1 if quick else 3
    payload = serve_bench.run(**kw, batching_concurrency=batching_concurrency, batching_rounds=batching_rounds,
                              paths=tuple(p.strip() for p in paths.split(",") if p.strip()), url=url,
                              triton_url=triton_url, triton_grpc_url=triton_grpc_url, onnx_dir=onnx_dir,
                              threads=threads, progress=progress, out_dir=out, log=lambda m: err.print(m))
    _targets(payload)
    _wrote(out, ["serve"])


@handles_errors
def bench_gateway_profile(
    duration: Annotated[float, typer.Option(help="Profiled seconds per concurrency level (and per worker count)")]
    = 10.0,
    concurrency: Annotated[str, typer.Option(help="Concurrency levels to profile")] = "1,32",
    rate: Annotated[int, typer.Option(help="py-spy samples per second")] = 250,
    workers: Annotated[str | None, typer.Option(help="Gateway worker counts for the throughput rows "
                                                     "[default: 1 and unroll serve's default, at least 2]")] = None,
    throughput_concurrency: Annotated[int, typer.Option(help="Concurrency of the throughput rows")] = 32,
    onnx_dir: OnnxOpt = ONNX_DIR,
    out: OutOpt = RESULTS,
) -> None:
    """Where a gateway request's time goes: py-spy samples of a real gateway under real load, per stage.

    Real tritonserver + one gateway process + keep-alive clients sending the classifier's test digits; per
    concurrency level the share of samples and ms per request of each stage (body read, decode, preprocess,
    Triton gRPC call, postprocess, JSON, HTTP server, routing, threadpool hand-off, waiting); in-process ONNX
    Runtime at concurrency 1 for the +2 ms target; then gateway throughput with 1 vs N worker processes.
    Needs py-spy (benchmark extra) with ptrace rights. Writes gateway_profile.json and gateway_profile.md.
    """
    from unroll.benchmarks import gateway_profile

    payload = gateway_profile.run(concurrency=_ints(concurrency, "--concurrency"), duration_s=duration, rate=rate,
                                  onnx_dir=onnx_dir, workers=_ints(workers, "--workers") if workers else None,
                                  throughput_concurrency=throughput_concurrency, log=lambda m: err.print(m))
    gateway_profile.write(payload, out)
    _targets(payload)
    _wrote(out, ["gateway_profile"])


@handles_errors
def bench_models(
    model: Annotated[list[str] | None, typer.Option("--model", "-m", help="Only these models (repeatable); "
                                                                         "default: every registered model")] = None,
    device: Annotated[str, typer.Option(
        help="cpu: the engines on the CPU (models.json/md); cuda: PyTorch eager and torch.compile on the GPU vs "
             "ONNX Runtime's CUDA provider, FP32/FP16 at batch 1 and 64, and the FP16/INT8 gates with the "
             "candidate on the GPU (models_cuda.json/md); without CUDA it exits 1 and writes nothing")] = "cpu",
    budget: Annotated[float, typer.Option(help="Seconds of timed repeats per engine and case (at least 3 repeats)")]
    = 1.0,
    compile_: Annotated[bool | None, typer.Option("--compile/--no-compile",
                                                  help="Also time torch.compile (compiles every case: slow) "
                                                       "[default: on with --device cuda, off on cpu]")] = None,
    scaling: Annotated[bool, typer.Option("--scaling/--no-scaling",
                                          help="cpu: denoiser latency vs pixels (128²…1024²), classifier throughput "
                                               "vs batch")] = True,
    quick: Annotated[bool, typer.Option(help="Smoke run: batch 1 and 4, 64² denoiser, 0.2 s budget")] = False,
    threads: ThreadsOpt = 2,
    onnx_dir: OnnxOpt = ONNX_DIR,
    out: OutOpt = RESULTS,
    progress: ProgressOpt = True,
) -> None:
    """PyTorch eager vs torch.compile vs ONNX Runtime FP32/FP16/INT8 for every registered model.

    Same threads and inputs for every engine, warm-up, median of repeats, ratios to PyTorch eager
    from the same run. FP16/INT8 where `unroll quantize` left the graphs. Also: denoiser latency vs
    pixel count with a fitted power-law exponent, classifier throughput vs batch size, and the
    FP32/FP16/INT8 speed + accuracy table. Writes models.json, models.md, models_scaling.png.

    --device cuda runs wherever PyTorch has CUDA (TensorRT or not); every row it does not run is listed with
    the reason (no onnxruntime-gpu, a graph not quantized, --no-compile, out of memory). Writes
    models_cuda.json and models_cuda.md with the GPU, driver, CUDA, torch and ONNX Runtime versions.
    """
    from unroll.benchmarks import models_bench, models_cuda

    registered = list_models()  # (imports the shipped models first: the registry is empty until then)
    unknown = [m for m in model or [] if m not in registered]
    if unknown:
        raise fail(f"unknown model(s) {', '.join(unknown)}; registered: {', '.join(registered)}")
    if device not in ("cpu", "cuda"):
        raise typer.BadParameter(f"--device must be cpu or cuda, not {device!r}")
    if device == "cuda":
        env = models_cuda.cuda_environment("cuda")
        if env.reason:
            raise fail(f"--device cuda: {env.reason}; nothing was measured and nothing was written")
        try:
            payload = models_cuda.run_cuda(model or None, budget_s=budget, with_compile=compile_ is not False,
                                           quick=quick, threads=threads, onnx_dir=onnx_dir, out_dir=out,
                                            progress=progress, env=env)
        except models_cuda.NothingMeasured as e:  # the device belongs on the line
            raise BenchError(f"--device cuda: {e}; nothing was written") from None
        by: dict[str, int] = {}
        for s in payload["skipped"]:
            by[s["reason"]] = by.get(s["reason"], 0) + 1
        for why, n in by.items():
            err.print(f"  [yellow]skipped[/] {n} row(s): {escape(why)}")
        _wrote(out, ["models_cuda"])
        return
    models_bench.run(model or None, threads=threads, budget_s=budget, with_compile=bool(compile_), quick=quick,
                     onnx_dir=onnx_dir, progress=progress, out_dir=out, with_scaling=scaling)
    _wrote(out, ["models"])


@handles_errors
def bench_quality(
    task: Annotated[str, typer.Option(help="denoise, classify or all")] = "all",
    bm3d: Annotated[bool, typer.Option("--bm3d/--no-bm3d", help="Include BM3D (~8 s per 512² image)")] = True,
    quick: Annotated[bool, typer.Option(help="Smoke run: 2 images cropped to 128², σ=25; 200 samples, σ 0 and 0.3")]
    = False,
    threads: ThreadsOpt = 2,
    onnx_dir: OnnxOpt = ONNX_DIR,
    out: OutOpt = RESULTS,
    progress: ProgressOpt = True,
) -> None:
    """Denoising PSNR/SSIM (FP32/FP16/INT8 vs BM3D, NL-means, TV, wavelet) and classifier accuracy per precision.

    Denoising: the 8 held-out images at σ = 15/25/50, the same seeded noisy image for every method,
    with each method's wall time per image and the 512×512 speed ratio vs BM3D. Classification:
    the card's held-out samples, clean and under Gaussian noise σ = 0.1…0.5, λ fixed vs lam=auto. The models
    are the trained ones (committed weights) of each task.
    Writes quality_denoise.{json,md,png} and quality_classify.{json,md,png}.
    """
    from unroll.benchmarks import quality_bench

    if task not in ("denoise", "classify", "all"):
        raise fail(f"--task must be denoise, classify or all, not {task!r}")
    if task in ("denoise", "all"):
        quality_bench.run_denoise(threads, quick=quick, with_bm3d=bm3d, onnx_dir=onnx_dir, progress=progress,
                                  out_dir=out)
    if task in ("classify", "all"):
        quality_bench.run_classify(threads, quick=quick, onnx_dir=onnx_dir, progress=progress, out_dir=out)
    _wrote(out, [f"quality_{t}" for t in (("denoise", "classify") if task == "all" else (task,))])


@handles_errors
def bench_soak(
    requests: Annotated[int, typer.Option(help="Mixed requests in all, spread over the rounds (more when a restart "
                                                "is slow: a round ends once traffic has recovered)")] = 10_000,
    concurrency: Annotated[int, typer.Option(help="Clients in closed loop")] = 32,
    rounds: Annotated[int, typer.Option(help="Kills per phase (each phase kills, waits for recovery, again)")] = 3,
    no_standby_rounds: Annotated[int, typer.Option(
        min=0, help="Kills of each kind in phase 5, against `unroll serve --no-standby` (0: no phase 5)")] = 3,
    out: OutOpt = RESULTS,
) -> None:
    """Traffic through a real `unroll serve` while parts of Triton are killed (SIGKILL), several times.

    Phases 1 to 4 on the default `unroll serve` (a warm standby where the memory allows it): phase 1 kills the
    denoiser's Python-backend process under 512×512 denoise load and the classifier's under classify load (once per
    round); phase 2 sends mixed traffic with tritonserver killed halfway through each round; phase 3 stops
    tritonserver (SIGSTOP); phase 4 runs `unroll deploy` under load. Phase 5: the kills of phases 1 and 2 against a
    new `unroll serve --no-standby`, to show what the standby saves. Each phase is judged on the fault window its
    clients saw (from the kill to the last non-200 answer, backoff included) against 3 s, and on lost requests
    (neither success nor the documented 503). Passes when the default deployment meets both in every phase, phase 5
    loses nothing (its windows are shown, not required), and no process or /dev/shm region of any Triton is left.
    Writes soak.json and soak.md (and the README's soak paragraph when writing the committed results); exits 1 when
    the run did not pass.
    """
    from unroll.benchmarks import soak

    if requests < 100 or concurrency < 1 or rounds < 1:
        raise typer.BadParameter("--requests must be ≥ 100, --concurrency ≥ 1 and --rounds ≥ 1")
    with err.status("soak") as status:
        payload = soak.run(requests, concurrency, out, progress=lambda m: status.update(m), rounds=rounds,
                           no_standby_rounds=no_standby_rounds)
    _wrote(out, ["soak"])
    err.print(soak.markdown(payload))
    if not payload["passed"]:
        raise typer.Exit(1)


@handles_errors
def bench_memory(
    requests: Annotated[int, typer.Option(help="Concurrent maximum-size denoise requests")] = 20,
    out: OutOpt = RESULTS,
) -> None:
    """The whole service's memory (the default `unroll serve`: gateway + tritonserver, and its warm standby when it
    starts one, + backend processes; PSS) idle, under REQUESTS concurrent denoise requests of UNROLL_MAX_PIXELS
    pixels each, and after them.

    Passes when every request got 200, the peak stayed within 4 GiB and the service came back within 500 MiB of
    idle. Writes memory.json and memory.md; exits 1 when the run did not pass.
    """
    from unroll.benchmarks import memory

    if requests < 1:
        raise typer.BadParameter("--requests must be ≥ 1")
    with err.status("memory") as status:
        payload = memory.run(requests, out=out, log=lambda m: status.update(m))
    _wrote(out, ["memory"])
    err.print(memory.markdown(payload))
    if not all(payload["passed"].values()):
        raise typer.Exit(1)


@handles_errors
def bench_stress(
    models: Annotated[str, typer.Option(help="Denoisers, comma-separated")] = "csc-denoiser",
    onnx_dir: OnnxOpt = ONNX_DIR,
    threads: ThreadsOpt = 2,
    out: OutOpt = RESULTS,
) -> None:
    """What FP16 and INT8 lose against FP32 on seeded synthetic patterns (checkerboards, gratings, stripes, text,
    hard edges, texture on flat ground), on ONNX Runtime and OpenVINO: the worst image and σ of the patterns the
    quantizer chose on (gate seeds) and of patterns it never saw (report seeds).

    Builds what is missing first (export; `unroll quantize` for each precision, behind its gate). Writes
    precision_stress.json and precision_stress.md.
    """
    from unroll import pipeline
    from unroll.benchmarks import precision_stress

    names = [m.strip() for m in models.split(",") if m.strip()]
    if not names:
        raise typer.BadParameter("--models: name at least one denoiser")
    for name in names:
        for precision in ("fp16", "int8"):
            try:
                pipeline.run(pipeline.plan([name], onnx_dir=onnx_dir, companions=False, precision=precision),
                             err.print)
            except QuantizeError as e:  # a refused gate is a result: the table says the graph is missing and why
                err.print(f"[yellow]{name} {precision}:[/] {escape(str(e))}")
    with err.status("stress patterns") as status:
        payload = precision_stress.run(names, onnx_dir, out, threads, log=lambda m: status.update(m))
    _wrote(out, ["precision_stress"])
    err.print(precision_stress.markdown(payload))


@handles_errors
def bench_png_level(out: OutOpt = RESULTS) -> None:
    """The zlib level of the denoisers' PNG answers: encode CPU time and size per level on real photos, and the level
    whose encode + send time is nearest the best on both a 100 Mbit/s and a 1 Gbit/s client link.

    Writes png_level.json and png_level.md; the gateway and the Triton backend encode at the chosen level
    (serving/imaging/images.py:PNG_LEVEL, kept equal to the result by a test).
    """
    from unroll.benchmarks import png_level

    with err.status("encoding photos at every PNG level"):
        payload = png_level.run(out)
    _wrote(out, ["png_level"])
    err.print(png_level.markdown(payload))



def bench_ham_draws(
    draws: Annotated[int, typer.Option(help="Official random draws of the NMF bases (seeded, so reproducible)")] = 32,
    seed: Annotated[int, typer.Option(help="Seed of the official draws' generator")] = 100,
    out: OutOpt = RESULTS,
) -> None:
    """Hamburger's NMF bases: how far the official random draws are from each other and from their mean, and how far
    each deterministic serving policy is from that mean (golden fixture input, eval mode).

    Writes ham_draws.json and ham_draws.md; unroll/solvers/nmf.py:DEFAULT_BASES is the chosen policy (kept equal to
    the result by a test).
    """
    from unroll.benchmarks import ham_draws

    if draws < 3:
        raise typer.BadParameter("--draws: at least 3")
    with err.status(f"running {draws} official NMF draws and the deterministic candidates"):
        payload = ham_draws.run(n_draws=draws, seed=seed, out_dir=out)
    _wrote(out, ["ham_draws"])
    err.print(ham_draws.markdown(payload))


@handles_errors
def bench_ood(
    model: Annotated[list[str] | None, typer.Option("--model", "-m", help="Classifier(s) with a solver layer "
                                                                          "[default: every trained digit classifier "
                                                                          "that has one]")] = None,
    digits: Annotated[int | None, typer.Option(help="Use the first N validation and test digits only (a smoke "
                                                    "run) [default: all]")] = None,
    served: Annotated[bool, typer.Option(help="Also measure what the score costs a client: the models whose card "
                                              "declares ood served with it and without it, in alternating "
                                              "whole-server runs (tritonserver + gateway as `unroll serve` writes "
                                              "them, concurrency 1; about 10 minutes), with an A/A arm and 95% "
                                              "intervals; exports into build/onnx where missing or stale")] = True,
    out: OutOpt = RESULTS,
) -> None:
    """An out-of-distribution score from the first solver layer's reconstruction residual, beside the maximum
    softmax probability and the energy score: rule and threshold chosen on validation digits and validation sets
    (photo crops, letters, noise, blank images, inverted digits), AUROC and FPR95 on disjoint test sets, the share
    of clean test digits flagged, three whole photos, corrupted digits by severity, and the added work.

    Scores in-process in PyTorch; the rules of models whose card declares ood go into their training records (export
    puts them on the served card); then (--served) what the residual output costs a served request. Writes
    ood.json, ood.md and ood.png.
    """
    from unroll.benchmarks import ood

    names = model or ood.scored_models()
    with err.status("scoring digits and out-of-distribution sets") as status:
        payload = ood.run(names, digits=digits, out_dir=out, tick=lambda m: status.update(m), served=served)
    _wrote(out, ["ood"])
    err.print(ood.markdown(payload))


@handles_errors
def bench_robustness(
    model: Annotated[list[str] | None, typer.Option("--model", "-m", help="Classifier(s) to evaluate [default: "
                                                                          "every trained digit classifier]")] = None,
    corruption: Annotated[list[str] | None, typer.Option("--corruption", "-c", help="Corruption(s) [default: all "
                                                                                    "of unroll/corruptions.py]")]
    = None,
    digits: Annotated[int | None, typer.Option(help="Evaluate the first N test and validation digits only "
                                                    "(a smoke run) [default: all]")] = None,
    threads: ThreadsOpt = 2,
    onnx_dir: OnnxOpt = ONNX_DIR,
    out: OutOpt = RESULTS,
    progress: ProgressOpt = True,
) -> None:
    """Trained digit classifiers under eleven corruptions at three severities, clean accuracy beside the mean over
    corruptions; models that take λ also at the λ chosen on the validation digits per corruption and severity, with
    their λ rule, and over the whole λ grid (test accuracy vs λ, the validation choice beside the test's oracle).

    The served graphs too: the FP32 export and the FP16 and INT8 graphs `unroll serve --precision` makes (card's
    calibration data and accuracy gate; a precision the gate refuses is reported with its reason), on ONNX Runtime
    at the trained λ. Graphs are made in --onnx-dir when missing or stale and reused otherwise.

    Writes robustness.json, robustness.md, robustness.png and robustness_lam.png.
    """
    import torch

    from unroll.benchmarks import robustness
    from unroll.benchmarks.common import progress_bars
    from unroll.corruptions import CORRUPTIONS, SEVERITIES

    names = model or robustness.digit_classifiers()
    bad = [m for m in names if m not in robustness.digit_classifiers()]
    if bad:
        raise fail(f"not a trained digit classifier: {', '.join(bad)}; these are: "
                   f"{', '.join(robustness.digit_classifiers())}")
    torch.set_num_threads(threads)
    with progress_bars(progress) as bars:
        task = bars.add_task("robustness", total=len(names) * len(corruption or CORRUPTIONS) * len(SEVERITIES),
                             info="")
        try:
            robustness.run(names, corruption, digits, digits, out, tick=lambda: bars.advance(task),
                           onnx_dir=onnx_dir, threads=threads)
        except KeyError as e:
            raise fail(str(e.args[0])) from None
    _wrote(out, ["robustness"])

STAGES = ("export", "models", "quality", "serve", "gateway-profile", "soak", "memory", "png-level")


@handles_errors
def bench_all(
    only: Annotated[str, typer.Option(help="Stages to run, comma-separated: " + ", ".join(STAGES))]
    = ",".join(STAGES),
    quantize: Annotated[bool, typer.Option("--quantize/--no-quantize",
                                           help="Quantize (FP16/INT8, default gates) where the graphs are missing "
                                                "or stale, before measuring")] = True,
    compile_: Annotated[bool, typer.Option("--compile/--no-compile", help="Also time torch.compile (slow)")] = False,
    duration: Annotated[float, typer.Option(help="serve: measured seconds per concurrency level")] = 5.0,
    quick: Annotated[bool, typer.Option(help="Smoke run of every stage")] = False,
    threads: ThreadsOpt = 2,
    onnx_dir: OnnxOpt = ONNX_DIR,
    out: OutOpt = RESULTS,
    progress: ProgressOpt = True,
) -> None:
    """Every benchmark with its defaults (what `make bench` runs): export, models, quality, serve,
    gateway-profile (py-spy), soak, memory.

    Rewrites the result files in --out (a fresh clone also exports and quantizes first); bench_all.json records
    each stage's time.
    """
    from unroll.benchmarks.common import machine_info

    stages = [s.strip() for s in only.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise fail(f"unknown stage(s) {', '.join(bad)}; choose from {', '.join(STAGES)}")
    out.mkdir(parents=True, exist_ok=True)
    timing: dict[str, float] = {}
    t_all = time.perf_counter()
    if quantize and ({"models", "quality"} & set(stages)):
        from unroll.benchmarks.models_inputs import ensure_quantized

        t0 = time.perf_counter()
        failed = ensure_quantized(Path(onnx_dir), log=lambda m: err.print(m))
        timing["quantize"] = time.perf_counter() - t0
        for k, v in failed.items():
            err.print(f"[yellow]warning:[/] {k} not quantized: {v}")
    for stage in stages:
        t0 = time.perf_counter()
        err.rule(f"bench {stage}")
        if stage == "export":
            from unroll.benchmarks import export_speed

            rows = export_speed.default_rows(quick)
            with err.status("benchmarking exports") as status:
                export_speed.run(threads, rows=rows, with_compile=not quick, budget_s=0.3 if quick else 2.0,
                                 progress=lambda m: status.update(m), out_dir=out)
            _wrote(out, ["export_speed"])
        elif stage == "models":
            bench_models(model=None, device="cpu", budget=1.0, compile_=compile_, scaling=True, quick=quick,
                         threads=threads, onnx_dir=onnx_dir, out=out, progress=progress)
        elif stage == "quality":
            bench_quality(task="all", bm3d=True, quick=quick, threads=threads, onnx_dir=onnx_dir, out=out,
                          progress=progress)
        elif stage == "gateway-profile":
            bench_gateway_profile(duration=10.0, concurrency="1,32", rate=250, workers=None, throughput_concurrency=32,
                                  onnx_dir=onnx_dir, out=out)
        elif stage == "soak":
            bench_soak(requests=1_000 if quick else 10_000, concurrency=32, out=out)
        elif stage == "memory":
            bench_memory(requests=4 if quick else 20, out=out)
        elif stage == "png-level":
            bench_png_level(out=out)
        else:
            bench_serve(duration=duration, warmup=0.5, concurrency="1,2,4,8,16,32", denoise_concurrency="1,4",
                        denoise_sizes="256,512", batching_concurrency=16, batching_rounds=3,
                        paths="onnxruntime,triton-http,triton-grpc,triton-grpc-image,gateway", url=None,
                        triton_url=None, triton_grpc_url=None, quick=quick, threads=threads, onnx_dir=onnx_dir, out=out,
                        progress=progress)
        timing[stage] = time.perf_counter() - t0
        err.print(f"bench {stage}: {timing[stage]:.0f} s")
    total = time.perf_counter() - t_all
    (out / "bench_all.json").write_text(json.dumps(
        {"stages_s": {k: round(v, 1) for k, v in timing.items()}, "total_s": round(total, 1), "quick": quick,
         "machine": machine_info(threads)}, indent=2) + "\n")
    err.print(f"[green]✓[/] all benchmarks in {total / 60:.1f} min → {out}")


@handles_errors
def bench_iters(
    model: Annotated[list[str] | None, typer.Option("--model", "-m", help="Classifier(s) to measure [default: every "
                                                                          "trained digit classifier whose card serves "
                                                                          "several iteration counts]")] = None,
    corruption: Annotated[list[str] | None, typer.Option("--corruption", "-c", help="Corruption(s) of the mean "
                                                                                    "[default: all]")] = None,
    digits: Annotated[int | None, typer.Option(help="Evaluate the first N test digits only (a smoke run) "
                                                    "[default: all]")] = None,
    duration: Annotated[float, typer.Option(help="Seconds of load per iteration count")] = 3.0,
    out: OutOpt = RESULTS,
    progress: ProgressOpt = True,
) -> None:
    """The iteration dial: per served iteration count (`iters=K`), clean and mean-corrupted accuracy beside latency
    and CPU per request through the real gateway and tritonserver (exports and a repository as `unroll serve`
    makes them), driven by the project's load engine.

    Writes iterations.json, iterations.md and iterations.png.
    """
    from unroll.benchmarks import iterations
    from unroll.benchmarks.common import progress_bars

    names = model or iterations.dial_models()
    bad = [m for m in names if m not in iterations.dial_models()]
    if bad or not names:
        raise fail(f"not a trained digit classifier serving several iteration counts: {', '.join(bad) or 'none'}; "
                   f"these are: {', '.join(iterations.dial_models()) or 'none'}")
    with progress_bars(progress) as bars:
        total = sum(2 * len(iterations.counts_of(n)[1]) for n in names)
        task = bars.add_task("iteration counts (latency, then accuracy)", total=total, info="")
        try:
            iterations.run(names, corruption, digits, duration, out_dir=out, tick=lambda: bars.advance(task))
        except KeyError as e:
            raise fail(str(e.args[0])) from None
    _wrote(out, ["iterations"])
