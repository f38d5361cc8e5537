"""``unroll build``: the Typer command function for the TensorRT engine builder.

A plain function (no Typer app here) so ``unroll/cli.py`` can register it with
``app.command("build")(build)``; ``python -m unroll.export.trt_cli NAME ...`` runs it on its own. Nothing heavy
is imported until the command runs, so registering it costs the main CLI nothing. Errors print one
sentence to stderr: exit 2 when this machine cannot build engines at all (no TensorRT or no CUDA GPU) or
an option is malformed, exit 1 for everything else (missing ONNX, parser or builder errors, a failed
parity gate).
"""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

console = Console()
err = Console(stderr=True, soft_wrap=True)


class Precision(StrEnum):
    fp32 = "fp32"
    fp16 = "fp16"
    int8 = "int8"


def _fail(message: str, code: int = 1) -> typer.Exit:
    """Print one clear sentence (no traceback) and return the exit to raise."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    return typer.Exit(code)


def parse_size(text: str, option: str) -> tuple[int, int]:
    """``"256x192"`` → (256, 192) as (H, W); ``"256"`` → (256, 256)."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:[x×,]\s*(\d+))?\s*", text)
    if not m:
        raise typer.BadParameter(f"{text!r} is not a size like 256x256 (height x width)", param_hint=option)
    h = int(m.group(1))
    return h, int(m.group(2) or h)


def build(
    name: Annotated[str, typer.Argument(help="Registered model name, e.g. sdnet-mnist or csc-denoiser.")],
    precision: Annotated[Precision, typer.Option(
        help="fp32 builds build/onnx/NAME.onnx (from `unroll export`); fp16/int8 build NAME.fp16.onnx / "
             "NAME.int8.onnx (from `unroll quantize`). Precision lives in the graph: the network is strongly "
             "typed and no FP16/INT8 builder flag is set.")] = Precision.fp32,
    out: Annotated[Path, typer.Option(help="Folder for NAME.PRECISION.plan and its .json.")] = Path("build/trt"),
    onnx_dir: Annotated[Path, typer.Option(help="Folder holding the exported/quantized ONNX.")] = Path("build/onnx"),
    batch_min: Annotated[int, typer.Option(help="Smallest batch the engine accepts.", min=1)] = 1,
    batch_opt: Annotated[int, typer.Option(help="Batch TensorRT tunes kernels for.", min=1)] = 8,
    batch_max: Annotated[int, typer.Option(help="Largest batch (Triton's max_batch_size must not exceed it).",
                                           min=1)] = 32,
    min_size: Annotated[str, typer.Option(help="Denoiser: smallest image, HxW (≥ 16x16). Ignored by "
                                               "fixed-resolution models.")] = "16x16",
    opt_size: Annotated[str, typer.Option(help="Denoiser: image size TensorRT tunes for, HxW.")] = "256x256",
    max_size: Annotated[str, typer.Option(help="Denoiser: largest image, HxW. GPU memory grows with "
                                               "batch-max x max-size.")] = "1024x1024",
    workspace_gib: Annotated[float, typer.Option(help="Workspace memory pool limit for tactics, in GiB.",
                                                 min=0.001)] = 4.0,
    opt_level: Annotated[int, typer.Option(help="Builder optimization level 0-5: higher searches more "
                                                "kernels (slower build, possibly faster engine).",
                                           min=0, max=5)] = 3,
    timing_cache: Annotated[Path, typer.Option(help="Timing cache loaded before and saved after the build "
                                                    "(speeds up rebuilds on the same GPU and TensorRT).")]
    = Path("build/trt/timing.cache"),
    no_timing_cache: Annotated[bool, typer.Option("--no-timing-cache", help="Neither load nor save a "
                                                                             "timing cache.")] = False,
    verify: Annotated[bool, typer.Option("--verify/--no-verify", help="Check the engine against ONNX Runtime "
                                                                      "FP32 on the gate data; the plan is kept "
                                                                      "only if it passes.")] = True,
    tf32: Annotated[bool, typer.Option("--tf32/--no-tf32", help="Let FP32 layers use TF32 tensor cores "
                                                                "(off: IEEE FP32, as the gate assumes).")] = False,
) -> None:
    """Build a TensorRT engine (strongly typed) with one optimization profile, then check it.

    Writes OUT/NAME.PRECISION.plan and OUT/NAME.PRECISION.json (TensorRT version, GPU and compute
    capability, CUDA, profile, build time, plan size, parity against ONNX Runtime FP32: top-1 agreement
    for classifiers, PSNR loss at σ 15/25/50 for the denoiser, max |Δ|). A plan that fails its gate is
    not kept; the JSON says which metric failed and by how much. Needs an NVIDIA GPU and TensorRT 10/11.
    """
    sizes = (parse_size(min_size, "--min-size"), parse_size(opt_size, "--opt-size"),
             parse_size(max_size, "--max-size"))
    if not batch_min <= batch_opt <= batch_max:
        raise typer.BadParameter(f"need batch-min ≤ batch-opt ≤ batch-max, got {batch_min}/{batch_opt}/{batch_max}",
                                 param_hint="--batch-min/--batch-opt/--batch-max")
    for axis, label in ((0, "height"), (1, "width")):
        lo, mid, hi = (s[axis] for s in sizes)
        if not 16 <= lo <= mid <= hi:
            raise typer.BadParameter(f"need 16 ≤ min ≤ opt ≤ max image {label}, got {lo}/{mid}/{hi}",
                                     param_hint="--min-size/--opt-size/--max-size")

    from unroll.export import trt_build as tb

    from unroll.registry import get_spec

    try:
        get_spec(name)
    except KeyError as e:
        raise _fail(f"{e.args[0]} (see `unroll models`).") from None
    prec = Precision(precision).value
    src = tb.onnx_path_for(name, prec, onnx_dir)
    ok, why = tb.tensorrt_available()
    if not ok:
        raise _fail(why, 2)
    try:
        with err.status(f"building {name} ({prec}) from {src}") as status:
            report = tb.build_engine(
                name, prec, onnx_dir=onnx_dir, out_dir=out, batch=(batch_min, batch_opt, batch_max),
                image_sizes=sizes, workspace_gib=workspace_gib, opt_level=opt_level,
                timing_cache=None if no_timing_cache else timing_cache, verify=verify, tf32=tf32,
                progress=lambda msg: status.update(f"{name} ({prec}): {msg}"))
    except tb.TrtUnavailableError as e:
        raise _fail(str(e), 2) from None
    except tb.TrtBuildError as e:
        first, _, details = str(e).partition("\n")
        if details:
            err.print(escape(details), highlight=False)
        raise _fail(first) from None
    except (ValueError, RuntimeError, OSError) as e:  # TensorRT raises RuntimeError from its bindings
        raise _fail(f"building {name} ({prec}) failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}.") \
            from None
    _print_summary(report)


def _print_summary(report: dict) -> None:
    rows = [("plan", f"{report['plan']} ({report['plan_bytes'] / 1e6:.1f} MB)"),
            ("TensorRT", f"{report['tensorrt']}, {report['network']}"),
            ("GPU", f"{report['gpu']['name']} (compute {report['gpu']['compute_capability']}), CUDA {report['cuda']}"),
            ("build", f"{report['build_seconds']:.1f} s, timing cache {report['builder']['timing_cache']['status']}")]
    rows += [(f"profile {n}", f"min {p['min']}  opt {p['opt']}  max {p['max']}")
             for n, p in report["profiles"][0].items()]
    parity = report.get("parity")
    if parity:
        rows.append(("max |engine − ORT|", f"{parity['max_abs_diff']:.2e}"))
        if "top1_agreement" in parity:
            rows.append(("top-1 agreement", f"{parity['top1_agreement']:.2%} of {parity['samples']}"))
        if "accuracy_loss_points" in parity:
            rows.append(("accuracy", f"{parity['accuracy_engine']:.2%} (ORT FP32 {parity['accuracy_reference']:.2%})"))
        rows += [(f"PSNR σ={s}", f"{r['engine_db']:.3f} dB (ORT FP32 {r['reference_db']:.3f}, "
                                 f"loss {r['loss_db']:+.4f})") for s, r in parity.get("psnr", {}).items()]
    table = Table(show_header=False, box=None)
    for key, value in rows:
        table.add_row(escape(key), escape(value))
    console.print(table)
    what = f"{report['model']} {report['precision']} engine"
    console.print(f"[green]✓[/] {escape(what)} passed its gate → {escape(report['plan'])}" if parity
                  else f"[yellow]![/] {escape(what)} written without a parity check → {escape(report['plan'])}")


def main() -> None:
    """``python -m unroll.export.trt_cli``: the command on its own."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(build)
    app()


if __name__ == "__main__":
    main()
