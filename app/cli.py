"""The ``unroll`` command line (Typer): models, training, evaluation, export and serving.

The serving image (no PyTorch) runs this CLI, and every ``unroll`` command starts by importing it, so the stage
code that needs torch or onnxruntime (export, quantize, fuse, the benchmarks) is imported inside its command.
Errors are mapped once (:mod:`unroll.app.errors`)."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

import unroll
from unroll import artifacts, tasks
from unroll.app.bench_cli import (
    bench_all,
    bench_gateway_profile,
    bench_ham_draws,
    bench_iters,
    bench_memory,
    bench_models,
    bench_ood,
    bench_png_level,
    bench_quality,
    bench_robustness,
    bench_serve,
    bench_soak,
    bench_stress,
)
from unroll.app.deploy_cli import deploy
from unroll.app.doctor import doctor_command
from unroll.app.errors import fail, handles_errors, report
from unroll.app.optimize_cli import optimize
from unroll.app.profile_cli import profile_app
from unroll.app.serve import serve_command
from unroll.app.triton_cli import repo, triton
from unroll.app.trt_cli import build
from unroll.errors import ExportError, QuantizeError, UnrollError
from unroll.registry import REGISTRY, get_spec, list_models, training_record, weights_file
from unroll.train import SLICE_KEY, TrainRun, parse_options, recipe_module, record_evaluation

app = typer.Typer(help="Deploy and serve vision models whose layers are fixed-iteration optimization solvers.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
console = Console()
err = Console(stderr=True)


@contextmanager
def progress_bar(description: str, total: int):
    """A rich progress bar; yields ``update(done, total, loss)`` for the training loops."""
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                  console=err) as bar:
        task = bar.add_task(description, total=total, info="")

        def update(done: int, total_: int, loss: float = float("nan")) -> None:
            info = f"loss {loss:.4f}" if loss == loss else None
            bar.update(task, completed=done, total=total_, **({"info": info} if info else {}))

        yield update


def _spec(name: str):
    return get_spec(name)


def _card_facts(spec) -> tuple[str, str, str]:
    """(input, labels, λ/σ inputs) as ``unroll models`` shows them, from the model's card."""
    card = spec.card
    shape = "×".join("H" if d < 0 and i == len(card.input.shape) - 2 else "W" if d < 0 else str(d)
                     for i, d in enumerate(card.input.shape))
    inp = f"{card.input.name} {shape}" + (f" {card.input.colour}" if card.input.colour else "")
    labels = str(len(card.labels)) if card.labels else "-"
    extra = []
    if card.lam is not None:
        extra.append(f"{card.lam.input} (λ" + (f", auto: {card.lam.auto}" if card.lam.auto else "") + ")")
    if card.sigma is not None:
        extra.append(f"{card.sigma.input} (σ/{card.sigma.scale:g})")
    return inp, labels, ", ".join(extra) or "-"


@app.command()
@handles_errors
def models() -> None:
    """List the registered models with their card's facts: task, input, labels, λ/σ inputs, the CPU runtime
    that serves them, weights, recipe."""
    list_models()
    table = Table("name", "task", "input", "labels", "λ / σ inputs", "CPU runtime", "weights", "recipe", "description")
    for spec in REGISTRY.values():
        table.add_row(spec.name, spec.task, *_card_facts(spec), spec.card.cpu_runtime,
                      "yes" if spec.has_weights else "-", "yes" if spec.recipe else "-", spec.description)
    console.print(table)


def _recipe(name: str, args: list[str], which: str):
    """The model's recipe module and its options parsed from the extra command-line tokens."""
    _spec(name)
    module = recipe_module(name)
    options = getattr(module, which)
    return module, parse_options(options, args, f"{name}'s recipe")


_EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}


@app.command(context_settings=_EXTRA)
@handles_errors
def train(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="A registered model with a training recipe (see `unroll models`)")],
    out: Annotated[Path, typer.Option(help="Where NAME.pt and NAME.json are written")] = Path("unroll/weights"),
    steps: Annotated[int | None, typer.Option(help="Stop after this many steps (smoke runs)")] = None,
    seed: Annotated[int, typer.Option(help="Random seed")] = 0,
    skip_metrics: Annotated[bool, typer.Option(help="Skip the evaluation after training")] = False,
    recipe_help: Annotated[bool, typer.Option("--recipe-help", help="List NAME's recipe options and exit")] = False,
) -> None:
    """Train a model from data shipped in packages (seeded) with the recipe its registry entry names; save it.

    The recipe's own options follow NAME (e.g. `--epochs 10`); `--recipe-help` lists them. Writes
    OUT/NAME.pt (weights) and OUT/NAME.json (recipe, builder options, measured metrics).
    """
    import torch  # local: the serving image runs this CLI without PyTorch

    module, options = _recipe(name, [] if recipe_help else ctx.args, "TRAIN_OPTIONS")
    if recipe_help:
        _print_options(name, module.TRAIN_OPTIONS)
        return
    out.mkdir(parents=True, exist_ok=True)
    run = TrainRun(name=name, seed=seed, steps=steps, metrics=not skip_metrics, progress=progress_bar)
    model, record = module.train(run, **options)
    weights, info = weights_file(name, out), training_record(name, out)
    torch.save(model.state_dict(), weights)
    info.write_text(json.dumps(record, indent=2) + "\n")
    console.print(f"wrote {weights} and {info}")


def _print_options(name: str, options) -> None:
    console.print(f"{name}'s recipe options:" if options else f"{name}'s recipe has no options of its own")
    for o in options:
        console.print(f"  {escape(o.describe())}")


@app.command("eval", context_settings=_EXTRA)
@handles_errors
def evaluate(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="A registered model with committed weights and a recipe")],
    write: Annotated[bool, typer.Option("--write", help="Write the recomputed metrics into the weights' NAME.json")]
    = False,
    recipe_help: Annotated[bool, typer.Option("--recipe-help", help="List NAME's evaluation options and exit")]
    = False,
) -> None:
    """Recompute a model's metrics from its committed weights with its recipe and print them.

    The recipe's evaluation options follow NAME (`--recipe-help` lists them). With --write, the fields it
    recomputed replace those in the committed record's `metrics`, so every number there comes from code; with
    `--slice` (the recipe's fixed slice), its numbers replace the record's `slice_metrics` instead.
    """
    module, options = _recipe(name, [] if recipe_help else ctx.args, "EVAL_OPTIONS")
    if recipe_help:
        _print_options(name, module.EVAL_OPTIONS)
        return
    spec = _spec(name)
    if not spec.has_weights:
        raise fail(f"{name!r} has no committed weights to evaluate (expected {spec.weights_path})")
    record = spec.info()
    result = module.evaluate(name, unroll.load(name), record, progress_bar, **options)
    for t in result.tables:
        table = Table(*t.columns, title=t.title)
        for row in t.rows:
            table.add_row(*row)
        console.print(table)
    for line in result.lines:
        console.print(escape(line))
    if write:
        spec.info_path.write_text(json.dumps(record_evaluation(record, result), indent=2) + "\n")
        where = f"{SLICE_KEY} ({result.slice})" if result.slice is not None else "metrics"
        console.print(f"wrote {', '.join(result.metrics)} into {spec.info_path}'s {where}")


def _print_export(result, prefix: str = "") -> None:
    r = result.report
    worst = max(c["max_abs_err"] for c in r["parity"]["cases"])
    naive = (r.get("naive_export") or {}).get("node_count")
    name = result.onnx_path.stem
    console.print(f"[green]✓[/] {prefix}{name}: {r['node_count']} nodes" + (f" (naive {naive})" if naive else "")
                  + f", max |ONNX − PyTorch| {worst:.1e}, TensorRT lint ok → {result.onnx_path}")


@app.command("export")
@handles_errors
def export_cmd(
    name: Annotated[str | None, typer.Argument(help="Registered model name (see `unroll models`)")] = None,
    all_models: Annotated[bool, typer.Option("--all", help="Export every registered model")] = False,
    iters: Annotated[int | None, typer.Option(help="Unroll K solver iterations instead of the model's own")] = None,
    opset: Annotated[int, typer.Option(help="ONNX opset (17 or newer)")] = 17,
    out: Annotated[Path, typer.Option(help="Output folder")] = artifacts.ONNX_DIR,
    lam: Annotated[bool | None, typer.Option("--lam/--no-lam",
                                             help="Models whose card declares a λ input: λ as a graph input "
                                                  "[B] (default) or baked in")] = None,
    checkpoint: Annotated[Path | None, typer.Option(
        help="NAME: a checkpoint for the architecture's own loader (official SDNet model_best.pth.tar / "
             "checkpoint.pth.tar, official VARS/RVT {'model': …} files; with or without `module.`); --model: a "
             "state_dict file for the module")] = None,
    model: Annotated[str | None, typer.Option(
        "--model", help="Your own nn.Module instead of NAME: path/to/file.py:factory or package.module:factory "
                        "(factory() returns the module)")] = None,
    export_name: Annotated[str | None, typer.Option(
        "--name", help="Name of the graph (OUT/NAME.onnx) and of the served model; --model: default the factory's")]
    = None,
    input_shape: Annotated[str | None, typer.Option(
        help="--model: one sample's shape C,H,W (or TOKENS,DIM); -1 marks a dynamic axis, e.g. 1,-1,-1")] = None,
    task: Annotated[str, typer.Option(help="--model: classification, denoising or block")] = tasks.CLASSIFICATION,
    labels: Annotated[Path | None, typer.Option(help="Class names, one per line; as many as the logits")] = None,
    mean: Annotated[str | None, typer.Option(help="Per-channel mean the client subtracts, e.g. 0.49,0.48,0.45")]
    = None,
    std: Annotated[str | None, typer.Option(help="Per-channel std the client divides by, e.g. 0.25,0.24,0.26")]
    = None,
    colour: Annotated[str | None, typer.Option(help="gray or rgb (channel order of C)")] = None,
    resize: Annotated[str | None, typer.Option(
        help="How a classifier's image is fitted: pad-square, stretch, shorter-side-crop, none")]
    = None,
    min_size: Annotated[int | None, typer.Option(help="Smallest size of a dynamic H/W axis")] = None,
    lam_input: Annotated[str | None, typer.Option(help="Graph input name of a per-sample λ (forward(x, lam))")]
    = None,
    lam_default: Annotated[float | None, typer.Option(help="λ used when a request gives none")] = None,
    sigma_input: Annotated[str | None, typer.Option(help="Graph input name of the noise level σ (denoisers)")]
    = None,
    sigma_scale: Annotated[float | None, typer.Option(help="The graph takes σ/scale (255: σ on the [0,1] scale)")]
    = None,
    input_name: Annotated[str | None, typer.Option(help="Graph input name of the image/tensor")] = None,
    output_name: Annotated[str | None, typer.Option(help="Graph output name")] = None,
    data_train: Annotated[str | None, typer.Option(help="Dataset id of the training data (INT8 calibration)")]
    = None,
    data_test: Annotated[str | None, typer.Option(help="Dataset id of the test data (export inputs, gates)")]
    = None,
    description: Annotated[str | None, typer.Option(help="One line describing the model (on the card)")] = None,
) -> None:
    """Unroll a model's solvers into a static, fused ONNX graph; verify it against PyTorch.

    NAME exports a registered model (committed weights, or --checkpoint); --model exports your own
    nn.Module with a card built from the options. Writes OUT/NAME.onnx and OUT/NAME.report.json (op
    histogram, parity errors on real inputs, solver settings, TensorRT lint, the checkpoint's sha256).
    Nothing is written when a check fails.
    """
    from unroll.export.user_model import card_updates, parse_numbers, read_labels  # local: torch (module docstring)

    if sum([all_models, name is not None, model is not None]) != 1:
        raise fail("give one model NAME, --model FILE.py:FACTORY, or --all")
    updates = card_updates(
        labels=read_labels(labels) if labels is not None else None, mean=parse_numbers(mean, float, "--mean"),
        std=parse_numbers(std, float, "--std"), colour=colour, resize=resize, input_name=input_name,
        output_name=output_name, lam_input=lam_input, lam_default=lam_default, sigma_input=sigma_input,
        sigma_scale=sigma_scale, data_train=data_train, data_test=data_test, min_size=min_size,
        description=description)
    if all_models and (updates or checkpoint or export_name):
        raise fail("card options, --checkpoint and --name apply to one model: give NAME, not --all")
    if model is not None:
        _export_user_model(model, export_name, task, input_shape, iters, checkpoint, updates, out, opset, lam)
        return
    if name is not None and (input_shape is not None or task != tasks.CLASSIFICATION):
        raise fail("--input-shape and --task describe a --model; a registered model's are fixed by its architecture")
    _export_registered(name, all_models, out, dict(iters=iters, opset=opset, lam_input=lam, checkpoint=checkpoint,
                                                 card_updates=updates, export_name=export_name))


def _export_user_model(model: str, export_name: str | None, task: str, input_shape: str | None, iters: int | None,
                       checkpoint: Path | None, updates: dict, out: Path, opset: int, lam: bool | None) -> None:
    """``unroll export --model FILE.py:FACTORY``: your own module, with a card built from the options."""
    from unroll.export.onnx_export import export  # local, as every export stage import here: torch
    from unroll.export.user_model import build_module, card_from_options, parse_numbers

    if input_shape is None:
        raise fail("--model needs --input-shape (one sample, e.g. 1,28,28; -1 for a dynamic axis)")
    if iters is not None:
        raise fail("--iters changes unroll's own solver layers; set your module's iteration count in its factory")
    try:
        shape = tuple(parse_numbers(input_shape, int, "--input-shape"))
        card = card_from_options(export_name or model.rpartition(":")[2].replace("_", "-"), task, shape, updates)
        module = build_module(model)
        extra = {"source": model}
        if checkpoint is not None:
            from unroll.models.sdnet import load_official_checkpoint  # strict, `module.` stripped, keys named

            if not checkpoint.is_file():
                raise ExportError(f"checkpoint {checkpoint} does not exist")
            try:
                load_official_checkpoint(module, checkpoint)
            except ValueError as e:
                raise ExportError(str(e).splitlines()[0]) from None
            except Exception as e:
                raise ExportError(f"{checkpoint}: not a readable PyTorch checkpoint ({type(e).__name__})"
                                  ) from None
            extra.update(weights=f"checkpoint {checkpoint}", checkpoint={
                "path": str(checkpoint.resolve()), "sha256": artifacts.sha256(checkpoint)})
        with console.status(f"exporting {card.name}"):
            result = export(module, card, None, out, opset=opset, lam_input=lam, extra_report=extra)
    except UnrollError as e:  # the model it was: the line names it
        raise ExportError(f"{model}: export failed — {e}") from None
    _print_export(result)
    _print_checkpoint(result)


def _export_registered(name: str | None, all_models: bool, out: Path, options: dict) -> None:
    """``unroll export NAME`` or ``--all``: registered models; with --all a failure is reported and the rest go on."""
    from unroll.export.onnx_export import export_model  # local: torch

    names = list_models() if all_models else [name]
    for n in names:
        _spec(n)
    failed = []
    with progress_bar("exporting", len(names)) as upd:
        for i, n in enumerate(names):
            try:
                result = export_model(n, out, **options)
            except UnrollError as e:
                if not all_models:  # one model: its error is the one line
                    raise ExportError(f"{n}: export failed — {e}") from None
                err.print(f"[bold red]{escape(n)}: export failed[/] — {escape(str(e))}")
                failed.append(n)
                continue
            _print_export(result)
            _print_checkpoint(result)
            for companion in result.companions:  # graphs its card names (its λ rule for lam=auto)
                _print_export(companion, f"  companion of {n}: ")
            upd(i + 1, len(names))
    if failed:
        raise ExportError(f"{len(failed)} of {len(names)} exports failed: {', '.join(failed)}")


def _print_checkpoint(result) -> None:
    ck = result.report.get("checkpoint")
    if ck:
        console.print(f"  weights: checkpoint {escape(ck['path'])} (sha256 {ck['sha256']})")


#: ``unroll quantize`` option → card gate metric (defaults: ``unroll.tasks.get(task).gates``, units in
#: ``unroll.gates``).
GATE_OPTIONS = {"min_agreement": "top1_agreement", "max_accuracy_loss": "accuracy_loss",
                "max_psnr_loss": "psnr_loss_db", "max_rel_err": "rel_err"}


@app.command()
@handles_errors
def quantize(
    name: Annotated[str, typer.Argument(help="A registered model whose card names calibration and gate data")],
    precision: Annotated[str, typer.Option(help="fp16 or int8")] = "int8",
    calib: Annotated[int, typer.Option(help="INT8: calibration samples from the card's training data")] = 256,
    out: Annotated[Path, typer.Option(help="Folder holding NAME.onnx; NAME.<precision>.onnx is written there")]
    = artifacts.ONNX_DIR,
    min_agreement: Annotated[float | None, typer.Option(help="Classifiers: top-1 agreement gate (0–1)")] = None,
    max_accuracy_loss: Annotated[float | None, typer.Option(help="Classifiers: accuracy-loss gate, as a fraction")]
    = None,
    max_psnr_loss: Annotated[float | None, typer.Option(help="Denoisers: PSNR-loss gate in dB")] = None,
    max_rel_err: Annotated[float | None, typer.Option(help="Blocks, λ rules: norm-wise relative error gate")] = None,
    safety: Annotated[float, typer.Option(help="INT8: fraction of each gate tolerance a layer placement must leave "
                                               "unused to be taken (0: the first that passes at all)")] = 0.2,
    card: Annotated[Path | None, typer.Option(help="JSON of an unroll ModelCard to attach to OUT/NAME.onnx first "
                                                   "(a third-party graph, e.g. from `unroll fuse`)")] = None,
) -> None:
    """FP16 or INT8 (explicit Q/DQ) ONNX behind the accuracy gate its card declares, evaluated with ONNX Runtime.

    Gate tolerances are the card's (`card.gate(precision)`: the task's defaults and the card's overrides);
    the options override them metric by metric. INT8 tries layer placements from all-INT8 towards more
    FP32 and keeps the first that passes with the --safety margin. A model that fails is not written;
    the command exits non-zero naming the metric and the shortfall.
    """
    from unroll.export.onnx_export import export_model  # local: torch (export_model) and onnxruntime
    from unroll.export.quantize import quantize as run_quantize

    if precision not in ("fp16", "int8"):
        raise fail(f"--precision must be fp16 or int8, not {precision!r}")
    if card is None and not artifacts.graph(name, onnx_dir=out).exists():
        _spec(name)  # not exported yet: a registered model is exported first
    given = {"min_agreement": min_agreement, "max_accuracy_loss": max_accuracy_loss, "max_psnr_loss": max_psnr_loss,
             "max_rel_err": max_rel_err}
    gates = {GATE_OPTIONS[k]: v for k, v in given.items() if v is not None}
    if not artifacts.graph(name, onnx_dir=out).exists():
        with console.status(f"exporting {name} first"):
            export_model(name, out)
    try:
        with console.status(f"quantizing {name} to {precision}") as status:
            r = run_quantize(name, precision, out, calib=calib, gates=gates or None,
                             progress=lambda m: status.update(m), safety=safety, card=card)
    except UnrollError:
        raise
    except (ValueError, FileNotFoundError) as e:  # quantize's own checks of its options and files
        raise QuantizeError(str(e)) from None
    console.print(f"[green]✓[/] {name} {precision}: gate passed ({_gate_summary(r['metrics'])}); {r['chosen']} → "
                  f"{artifacts.graph(name, precision, out)}")
    for line in _per_image_lines(r):
        console.print(line)
    if r.get("ood"):
        o = r["ood"]
        console.print(f"  out-of-distribution rule measured again on this graph: threshold {o['threshold_fp32']:.3f} "
                      f"(FP32) → {o['threshold']:.3f}; verdicts as the FP32 graph's on {o['verdict_agreement']:.1%} "
                      f"of {o['samples']} validation samples")
    for note in r.get("notes", []):
        console.print(f"[yellow]note:[/] {note}")


def _per_image_lines(r: dict) -> list[str]:
    """The worst image of the gate data (validation + stress) and of the test set (reported only)."""
    out = []
    for what, m in (("gate (" + r.get("gate_data", "").split(":")[0] + ")", r.get("metrics") or {}),
                    ("test, reported only", (r.get("test") or {}).get("metrics") or {})):
        if "worst_image" in m:
            out.append(f"  worst image, {what}: {m['worst_image']} loses {m['psnr_loss_db_worst']:.3f} dB; "
                       f"mean loss {m['psnr_loss_db']:.3f} dB at {m['worst_sigma']}")
        elif "top1_agreement" in m and what.startswith("test"):
            out.append(f"  {what}: {_gate_summary(m)}")
    if r.get("metrics", {}).get("per_image"):
        src = Path(r["source"])
        report = artifacts.graph_report(src.name.removesuffix(".onnx"), r["precision"], src.parent)
        out.append(f"  every image's loss per σ: {report} (metrics.per_image, test.metrics.per_image)")
    return out


def _gate_summary(m: dict) -> str:
    """One line from a quantization report's metrics (classification, per-σ PSNR, or other numbers)."""
    if "top1_agreement" in m and "accuracy" in m:
        return (f"top-1 agreement {m['top1_agreement']:.2%}, accuracy {m['accuracy']:.2%} "
                f"(FP32 {m['accuracy_fp32']:.2%})")
    if "per_sigma" in m:
        return ", ".join(f"σ={s}: {-v['psnr_loss_db'] + 0.0:+.3f} dB".replace("-", "−")
                         for s, v in m["per_sigma"].items())
    return ", ".join(f"{k} {v:.4g}" for k, v in m.items() if isinstance(v, int | float)) or "no metrics reported"


@app.command()
@handles_errors
def fuse(
    src: Annotated[Path, typer.Argument(help="An ONNX graph written by other code (e.g. plain torch.onnx.export)")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Where the fused graph goes; OUT.report.json beside it. "
                                                          "Its file stem is the model's name")],
    card: Annotated[Path | None, typer.Option(help="JSON of an unroll ModelCard to attach (its name is OUT's stem); "
                                                   "without it a card already in SRC is kept")] = None,
    input_shape: Annotated[list[str] | None, typer.Option(
        help="Sizes for the parity check's inputs, NAME=1,3,32,32 (repeatable); dynamic axes default to 1 for the "
             "batch and 16 otherwise")] = None,
) -> None:
    """Rewrite textbook shrinkage and step-size forms of a third-party graph into unroll's fused forms.

    sign(v)·relu(|v|−θ), sign(v)·max(|v|−θ, 0), where(|v|>θ, v−sign(v)·θ, 0) and relu(v−θ)−relu(−v−θ) become
    v − clip(v, −θ, θ) (or v − min(max(v, −θ), θ) for a tensor θ); max(v−θ, 0) becomes relu(v−θ); constant
    η·W is folded. Verified with ONNX Runtime against SRC on random inputs (max abs 1e-4, rel 1e-5) before
    anything is written; forms no rule knows are left alone and listed in the report.
    """
    from unroll.export.fuse import fuse as run_fuse  # local: onnxruntime and onnxscript
    from unroll.export.fuse import parse_input_shapes

    with console.status(f"fusing {src}"):
        result = run_fuse(src, out, card=card, input_shapes=parse_input_shapes(input_shape))
    r = result.report
    for row in r["rewrites"]:
        if row["count"]:
            console.print(f"  {escape(row['form'])} → {escape(row['into'])}: {row['count']}")
    for row in r["kept"]:
        if row["count"]:
            console.print(f"  {escape(row['form'])}: {row['count']} (already fused, kept)")
    if r["left_alone"]:
        left = ", ".join(f"{n['op']} {n['node']}" for n in r["left_alone"])
        console.print(f"[yellow]note:[/] left alone (no rule matched): {escape(left)}")
    console.print(f"[green]✓[/] {r['nodes_before']} → {r['nodes_after']} nodes, max |fused − input| "
                  f"{r['parity']['max_abs_err']:.1e}" + (f", card {r['card']['name']!r}" if r["card"] else "")
                  + f" → {result.onnx_path} (report {result.report_path})")


bench_app = typer.Typer(help="Measure speed and quality; results go to benchmarks/results/ (JSON, Markdown, PNG).",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@bench_app.command("export")
@handles_errors
def bench_export(
    threads: Annotated[int, typer.Option(help="Threads for every engine")] = 2,
    no_compile: Annotated[bool, typer.Option("--no-compile", help="Skip torch.compile (slow to compile)")] = False,
    budget: Annotated[float, typer.Option(help="Seconds of timed repeats per engine and row")] = 3.0,
    out: Annotated[Path, typer.Option(help="Results folder")] = artifacts.RESULTS_DIR,
) -> None:
    """PyTorch eager vs torch.compile vs ONNX Runtime (naive and fused export), same inputs and threads."""
    from unroll.benchmarks import export_speed  # local: torch

    with console.status("benchmarking") as status:
        payload = export_speed.run(threads, with_compile=not no_compile, budget_s=budget,
                                   progress=lambda msg: status.update(msg), out_dir=out)
    console.print(export_speed.markdown(payload))


def _register_subsystem_commands() -> None:
    """Commands whose code lives in modules of their own (serving, TensorRT, benchmarks, the machine check)."""
    app.command("build")(build)
    app.command("repo")(repo)
    app.command("optimize")(optimize)
    app.add_typer(profile_app, name="profile")
    app.command("triton")(triton)
    app.command("serve")(serve_command)
    app.command("deploy")(deploy)
    app.command("doctor")(doctor_command)
    bench_app.command("serve")(bench_serve)
    bench_app.command("models")(bench_models)
    bench_app.command("quality")(bench_quality)
    bench_app.command("soak")(bench_soak)
    bench_app.command("memory")(bench_memory)
    bench_app.command("png-level")(bench_png_level)
    bench_app.command("stress")(bench_stress)
    bench_app.command("ham-draws")(bench_ham_draws)
    bench_app.command("robustness")(bench_robustness)
    bench_app.command("ood")(bench_ood)
    bench_app.command("iters")(bench_iters)
    bench_app.command("gateway-profile")(bench_gateway_profile)
    bench_app.command("all")(bench_all)


_register_subsystem_commands()


def main() -> None:
    """The ``unroll`` entry point: the app, with the one error mapping also around what runs outside a command."""
    try:
        app()
    except UnrollError as e:
        raise SystemExit(report(e).exit_code) from None


if __name__ == "__main__":
    main()
