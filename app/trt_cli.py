"""``unroll build``: the Typer command function for the TensorRT engine builder.

A plain function (no Typer app here) so ``app/cli.py`` can register it with
``app.command("build")(build)``; ``python -m unroll.app.trt_cli NAME ...`` runs it on its own. TensorRT itself
is imported only when an engine is built (:mod:`unroll.export.trt_build`). Errors print one sentence to stderr
(:mod:`unroll.app.errors`): exit 2 when this machine cannot build engines at all (no TensorRT or no CUDA GPU) or
an option is malformed, exit 1 for everything else (missing ONNX, a graph the TensorRT lint rejects, a
profile whose estimated memory exceeds the GPU's or ``--max-memory-gib``, parser or builder errors, a
failed parity gate). The profile and its memory estimate are printed before anything is built, on any
machine: the lint and the estimate need no GPU.
"""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import onnx
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from unroll import artifacts
from unroll.app.errors import fail, handles_errors
from unroll.errors import BuildError, CardError, UnrollError
from unroll.export import trt_build as tb
from unroll.export.card_attach import NO_CARD_HINT, attach_card_where_present
from unroll.gates import METRICS

console = Console()
err = Console(stderr=True, soft_wrap=True)


class Precision(StrEnum):
    fp32 = "fp32"
    fp16 = "fp16"
    int8 = "int8"


def parse_size(text: str, option: str) -> tuple[int, int]:
    """``"256x192"`` → (256, 192) as (H, W); ``"256"`` → (256, 256)."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:[x×,]\s*(\d+))?\s*", text)
    if not m:
        raise typer.BadParameter(f"{text!r} is not a size like 256x256 (height x width)", param_hint=option)
    h = int(m.group(1))
    return h, int(m.group(2) or h)


Sizes = tuple[tuple[int, int], tuple[int, int], tuple[int, int]]


def _merge(given: tuple, defaults: tuple | None, what: str, hint: str) -> tuple:
    """Options given on the command line, the card's values for the rest."""
    if all(g is None for g in given):
        return tuple(defaults) if defaults is not None else None
    if defaults is None and any(g is None for g in given):
        raise typer.BadParameter(f"the model card has no {what}; give all three", param_hint=hint)
    return tuple(d if g is None else g for g, d in zip(given, defaults or given, strict=True))


def _ordered(values: tuple, what: str, hint: str, floor: int = 1) -> None:
    given = [v for v in values if v is not None]
    if given != sorted(given) or (given and given[0] < floor):
        raise typer.BadParameter(f"need {floor} ≤ min ≤ opt ≤ max {what}, got "
                                 f"{'/'.join('-' if v is None else str(v) for v in values)}", param_hint=hint)


#: ``NAME=MIN:OPT:MAX``.
_DIM_RANGE = re.compile(r"\s*(?P<name>[^=\s][^=]*?)\s*=\s*(?P<lo>\d+)\s*:\s*(?P<mid>\d+)\s*:\s*(?P<hi>\d+)\s*")
DIM_RANGE_HELP = (
    "Range of one dynamic axis, NAME=MIN:OPT:MAX; repeatable. NAME is the ONNX dim_param of the axis (e.g. "
    "tokens, height; every input axis carrying it) or INPUT[AXIS] with the axis counted from the batch axis 0 "
    "(e.g. x[1]); the batch has --batch-*. \\[default: the model card's trt_profile.dims]")


def parse_dim_range(text: str) -> tuple[str, tuple[int, int, int]]:
    """``"tokens=16:64:256"`` → ``("tokens", (16, 64, 256))``."""
    m = _DIM_RANGE.fullmatch(text)
    if not m:
        raise typer.BadParameter(f"{text!r} is not NAME=MIN:OPT:MAX (e.g. tokens=16:64:1024 or x[1]=16:64:1024)",
                                 param_hint="--dim-range")
    return m.group("name"), (int(m.group("lo")), int(m.group("mid")), int(m.group("hi")))


def _dim_ranges(graph, card, given_sizes: tuple, dim_range: list[str] | None, hints: tuple[str, ...]) -> dict:
    """The profile's non-batch ranges as ``{"INPUT[AXIS]": (min, opt, max)}``: the card's, then --min/opt/max-size
    for H and W of an image input, then --dim-range; each checked (exit 2 naming the option)."""
    ranges = dict(tb.card_dim_ranges(graph, card))
    dynamic = tb.dynamic_axes(graph)
    image_axes = [k for k in (tb.axis_key(card.input.name, 2), tb.axis_key(card.input.name, 3)) if k in dynamic]
    size_keys: set[str] = set()
    if len(image_axes) == 2 and any(g is not None for g in given_sizes):
        card_sizes = tuple(zip(ranges.get(image_axes[0], (None,) * 3), ranges.get(image_axes[1], (None,) * 3),
                               strict=True))
        defaults = None if any(h is None for h, _ in card_sizes) else card_sizes
        sizes = _merge(given_sizes, defaults, "trt_profile.dims for H and W", "/".join(hints))
        for i, key in enumerate(image_axes):
            ranges[key] = tuple(s[i] for s in sizes)
            size_keys.add(key)
    named: dict[str, tuple[int, int, int]] = {}
    for text in dim_range or []:
        dim, rng = parse_dim_range(text)
        if dim in named and named[dim] != rng:
            raise typer.BadParameter(f"{dim} is given twice ({named[dim]} and {rng})", param_hint="--dim-range")
        named[dim] = rng
    try:
        resolved = tb.resolve_dim_ranges(graph, named)
    except ValueError as e:  # UnknownDimError names the valid axes
        raise typer.BadParameter(str(e), param_hint="--dim-range") from None
    clash = sorted(size_keys & set(resolved))
    if clash:
        raise typer.BadParameter(f"{', '.join(clash)} has both a --dim-range and an image size option; give one",
                                 param_hint="--dim-range")
    ranges.update(resolved)
    for key, rng in ranges.items():
        main = key.startswith(f"{card.input.name}[")
        label = dynamic.get(key) or key
        hint = "/".join(hints) if key in size_keys else "--dim-range"
        what = f"{label} ({key})" if label != key else key
        _ordered(rng, what, hint, card.input.min_size if main else 1)
    return ranges


def _print_preflight(name: str, checked) -> None:
    """The profile and the memory estimate, before anything is built (stdout)."""
    console.print(f"[bold]{escape(name)}[/]: optimization profile (min / opt / max)")
    for n, (lo, mid, hi) in checked.profile.items():
        console.print(f"  {escape(n)}  {list(lo)} / {list(mid)} / {list(hi)}", highlight=False)
    console.print(escape(checked.memory.summary()), highlight=False)
    if checked.budget is not None:
        console.print(f"within {escape(checked.budget[1])}", highlight=False)


@handles_errors
def build(
    name: Annotated[str, typer.Argument(help="A model name, see `unroll models` (the ONNX file stem).")],
    precision: Annotated[Precision, typer.Option(
        help="fp32 builds build/onnx/NAME.onnx (from `unroll export`); fp16/int8 build NAME.fp16.onnx / "
             "NAME.int8.onnx (from `unroll quantize`). Precision lives in the graph: the network is strongly "
             "typed and no FP16/INT8 builder flag is set.")] = Precision.fp32,
    out: Annotated[Path, typer.Option(help="Folder for NAME.PRECISION.plan and its .json.")] = artifacts.TRT_DIR,
    onnx_dir: Annotated[Path, typer.Option(help="Folder holding the exported/quantized ONNX.")] = artifacts.ONNX_DIR,
    batch_min: Annotated[int | None, typer.Option(help="Smallest batch the engine accepts \\[default: the model "
                                                      "card's trt_profile.batch].", min=1)] = None,
    batch_opt: Annotated[int | None, typer.Option(help="Batch TensorRT tunes kernels for \\[default: the card's].",
                                                  min=1)] = None,
    batch_max: Annotated[int | None, typer.Option(help="Largest batch (Triton's max_batch_size must not exceed "
                                                      "it) \\[default: the card's].", min=1)] = None,
    min_size: Annotated[str | None, typer.Option(help="Models with dynamic H×W: smallest image, HxW \\[default: "
                                                      "the card's trt_profile.dims]. Ignored by fixed-resolution "
                                                      "models.")] = None,
    opt_size: Annotated[str | None, typer.Option(help="Image size TensorRT tunes for, HxW \\[default: the "
                                                      "card's].")] = None,
    max_size: Annotated[str | None, typer.Option(help="Largest image, HxW \\[default: the card's]. GPU memory "
                                                      "grows with batch-max x max-size.")] = None,
    workspace_gib: Annotated[float, typer.Option(help="Workspace memory pool limit for tactics, in GiB.",
                                                 min=0.001)] = 4.0,
    opt_level: Annotated[int, typer.Option(help="Builder optimization level 0-5: higher searches more "
                                                "kernels (slower build, possibly faster engine).",
                                           min=0, max=5)] = 3,
    timing_cache: Annotated[Path, typer.Option(help="Timing cache loaded before and saved after the build "
                                                    "(speeds up rebuilds on the same GPU and TensorRT).")]
    = artifacts.TIMING_CACHE,
    no_timing_cache: Annotated[bool, typer.Option("--no-timing-cache", help="Neither load nor save a "
                                                                             "timing cache.")] = False,
    verify: Annotated[bool, typer.Option("--verify/--no-verify", help="Check the engine against ONNX Runtime "
                                                                      "FP32 on the model card's gate data; the "
                                                                      "plan is kept only if it passes.")] = True,
    card_file: Annotated[Path | None, typer.Option("--card", help="JSON of an unroll ModelCard to attach to "
                                                                  "NAME's ONNX first (a third-party graph, e.g. "
                                                                  "from `unroll fuse`).")] = None,
    tf32: Annotated[bool, typer.Option("--tf32/--no-tf32", help="Let FP32 layers use TF32 tensor cores "
                                                                "(off: IEEE FP32, as the gate assumes).")] = False,
    dim_range: Annotated[list[str] | None, typer.Option("--dim-range", help=DIM_RANGE_HELP,
                                                        show_default=False)] = None,
    max_memory_gib: Annotated[float | None, typer.Option(
        help="Refuse to build when the profile's estimated GPU memory (activations at the max shapes + weights, "
             "printed before the build) exceeds this \\[default: the GPU's total memory].", min=0.001)] = None,
) -> None:
    """Build a TensorRT engine (strongly typed) with one optimization profile, then check it.

    The profile, gate data and tolerances come from the model card in the ONNX. The profile and its
    estimated GPU memory are printed first; a graph the TensorRT lint rejects, or a profile that does not
    fit the GPU (or --max-memory-gib), stops here. Writes
    OUT/NAME.PRECISION.plan and OUT/NAME.PRECISION.json (TensorRT version, GPU and compute capability,
    CUDA, profile, build time, plan size, parity against ONNX Runtime FP32 with the card's gate metric:
    top-1 agreement for classifiers, PSNR loss per gate σ for denoisers, relative error for blocks; max
    |Δ|). A plan that fails its gate is not kept; the JSON says which metric failed and by how much.
    Needs an NVIDIA GPU and TensorRT 10/11.
    """
    batch_given = (batch_min, batch_opt, batch_max)
    sizes_given = _given_sizes(batch_given, (min_size, opt_size, max_size))
    prec = Precision(precision).value
    src, card = _source_and_card(name, prec, onnx_dir, verify, card_file)
    batch = _merge(batch_given, card.trt_profile.batch, "trt_profile.batch", "--batch-min/--batch-opt/--batch-max")
    _ordered(batch, "batch", "--batch-min/--batch-opt/--batch-max")
    ranges, checked = _preflight(src, card, batch, sizes_given, dim_range, max_memory_gib)
    _print_preflight(name, checked)
    ok, why = tb.tensorrt_available()
    if not ok:
        raise fail(why, 2)
    report = _build_engine(name, prec, src, dict(
        onnx_dir=onnx_dir, out_dir=out, batch=batch, dim_ranges=ranges, workspace_gib=workspace_gib,
        opt_level=opt_level, timing_cache=None if no_timing_cache else timing_cache, verify=verify, tf32=tf32,
        max_memory_gib=max_memory_gib))
    _print_summary(report)


SIZE_HINTS = ("--min-size", "--opt-size", "--max-size")


def _given_sizes(batch_given: tuple, size_texts: tuple[str | None, ...]) -> tuple:
    """Check the batch options are ordered and parse the image size options (``None`` where not given)."""
    _ordered(batch_given, "batch", "--batch-min/--batch-opt/--batch-max")
    sizes_given = tuple(None if t is None else parse_size(t, o) for t, o in zip(size_texts, SIZE_HINTS, strict=True))
    for axis, label in ((0, "image height"), (1, "image width")):
        _ordered(tuple(None if s is None else s[axis] for s in sizes_given), label, "/".join(SIZE_HINTS))
    return sizes_given


def _source_and_card(name: str, prec: str, onnx_dir: Path, verify: bool, card_file: Path | None) -> tuple:
    """The ONNX to build from and its card (``--card`` attached first); a missing graph or card says what to run."""
    try:
        src, ref = tb.require_onnx(name, prec, onnx_dir, verify)
        if card_file is not None:
            attach_card_where_present([ref, src], card_file, name)
        card = tb.read_card(src)
    except tb.MissingOnnxError as e:  # the line says what NAME is
        raise tb.MissingOnnxError(f"{str(e).rstrip('.')} (NAME is a model name, see `unroll models`).") from None
    except tb.TrtBuildError as e:
        if "carries no unroll model card" not in str(e):
            raise
        raise tb.TrtBuildError(f"{e}, {NO_CARD_HINT}") from None
    except UnrollError:
        raise
    except ValueError as e:  # --card: unreadable, invalid, or not this graph's
        raise CardError(str(e)) from None
    return src, card


def _preflight(src: Path, card, batch: tuple, sizes_given: tuple, dim_range: list[str] | None,
               max_memory_gib: float | None) -> tuple:
    """The profile's ranges and the CPU checks before TensorRT (lint, memory estimate): ``(ranges, checked)``."""
    graph = onnx.load(str(src), load_external_data=False)
    ranges = _dim_ranges(graph, card, sizes_given, dim_range, SIZE_HINTS)
    del graph
    try:
        checked = tb.preflight(src, card, batch, None, ranges, max_memory_gib)
    except (tb.ProfileMemoryError, tb.LintError):
        raise  # an error line of its own (unroll.app.errors), not a malformed option
    except ValueError as e:  # a dynamic axis with no range anywhere
        raise typer.BadParameter(str(e), param_hint="--dim-range") from None
    return ranges, checked


def _build_engine(name: str, prec: str, src: Path, options: dict) -> dict:
    """:func:`unroll.export.trt_build.build_engine` under a status line; TensorRT's own exceptions become a
    :class:`BuildError` of one line."""
    try:
        with err.status(f"building {name} ({prec}) from {src}") as status:
            report = tb.build_engine(name, prec, **options,
                                     progress=lambda msg: status.update(f"{name} ({prec}): {msg}"))
    except UnrollError:
        raise
    except (ValueError, RuntimeError, OSError) as e:  # TensorRT raises RuntimeError from its bindings
        raise BuildError(f"building {name} ({prec}) failed: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}.") from None
    return report


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
        rows += [(f"{m} (gate {METRICS[m].format(t)})", METRICS[m].format(parity[m]))
                 for m, t in report.get("gate", {}).items() if m in parity]
        if "accuracy" in parity:
            rows.append(("accuracy", f"{parity['accuracy']:.2%} (ORT FP32 {parity['accuracy_fp32']:.2%}) "
                                     f"on {parity['n']}"))
        rows += [(f"PSNR σ={s}", f"{r['psnr']:.3f} dB (ORT FP32 {r['psnr_fp32']:.3f}, "
                                 f"loss {r['psnr_loss_db']:+.4f})") for s, r in parity.get("per_sigma", {}).items()]
    table = Table(show_header=False, box=None)
    for key, value in rows:
        table.add_row(escape(key), escape(value))
    console.print(table)
    what = f"{report['model']} {report['precision']} engine"
    console.print(f"[green]✓[/] {escape(what)} passed its gate → {escape(report['plan'])}" if parity
                  else f"[yellow]![/] {escape(what)} written without a parity check → {escape(report['plan'])}")


def main() -> None:
    """``python -m unroll.app.trt_cli``: the command on its own."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(build)
    app()


if __name__ == "__main__":
    main()
