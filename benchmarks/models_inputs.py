"""What ``unroll bench models`` runs each model on: real inputs from its card's data (a batch of samples, a noisy
image of a given side), the cases per model, and the graphs it needs (exported, quantized) with their reports."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

from unroll import artifacts, data, pipeline, tasks
from unroll.benchmarks.common import exported_card, quantizable, trained_models
from unroll.errors import GateFailed
from unroll.export import inputs as ex
from unroll.pipeline import quantize_stage
from unroll.registry import get_spec, list_models

ENGINES = ("pytorch eager", "torch.compile", "onnxruntime fp32", "openvino fp32", "onnxruntime fp16",
           "onnxruntime int8")
#: The FP32 graph on OpenVINO (serving/cpu_runtime.py), the other CPU runtime a card can pick.
OPENVINO = "openvino fp32"
QUANTIZED = ("fp16", "int8")
CUDA_PRECISIONS = ("fp32", "fp16")
QUICK = {"batches": (1, 4), "denoise_sizes": (64,), "scaling_sides": (64, 96, 128), "throughput_batches": (1, 8),
         "budget_s": 0.2}
#: Image inputs: batch 1 and a "full batch" — the largest power of two in [8, 64] with at most
#: FULL_BATCH_ELEMENTS input values; token/feature blocks: batch 1 and 8.
FULL_BATCH_ELEMENTS = 2**17
DEFAULT_BLOCK_BATCHES = (1, 8)
DENOISE_SIZES = (256, 512)
DENOISE_SIGMA = 25.0


def prepare_run(models: list[str] | None, threads: int, onnx_dir: Path, budget_s: float, quick_budget_s: float | None
                ) -> tuple[Path, list[str], float]:
    """The common start of a models run (CPU and CUDA): PyTorch's thread count, the graph folder made, the models
    (default: every registered one) and the per-case budget (capped at ``quick_budget_s`` when given)."""
    torch.set_num_threads(threads)
    onnx_dir = Path(onnx_dir)
    onnx_dir.mkdir(parents=True, exist_ok=True)
    names = models or list_models()
    if quick_budget_s is not None:
        budget_s = min(budget_s, quick_budget_s)
    return onnx_dir, names, budget_s


def lam_default(name: str, onnx_dir: Path) -> float | None:
    """The λ a served request gets by default: the exported card's (the first solver layer's trained λ)."""
    path = artifacts.graph(name, onnx_dir=onnx_dir)
    if not path.exists():
        return None
    card = exported_card(name, onnx_dir)
    return card.lam.default if card.lam is not None else None


def noisy_image(name: str, side: int, sigma255: float = DENOISE_SIGMA) -> dict[str, torch.Tensor]:
    """A denoiser's graph inputs: its card's first test image resized to ``side``², seeded σ noise."""
    from skimage.transform import resize

    card = get_spec(name).card
    image_name, img = next(iter(data.dataset(card.data.test or card.data.train).load().items()))
    img = resize(img, (side, side), anti_aliasing=True).astype(np.float32)
    noisy = torch.from_numpy(data.add_noise(img, sigma255, data.noise_seed(image_name, sigma255)))
    channels = card.input.shape[0]
    return {card.input.name: noisy[None, None].expand(1, channels, -1, -1).contiguous(),
            card.sigma.input: torch.tensor([sigma255 / card.sigma.scale])}


def case_inputs(name: str, case: int, lam: float | None = None) -> dict[str, torch.Tensor]:
    """Graph-named inputs from the card: ``case`` is the batch size, or the image side for a denoiser.

    Classifiers get samples of their card's test data at their input size (and ``lam`` when given),
    blocks the export's real example inputs, cycled to the batch size.
    """
    spec = get_spec(name)
    card = spec.card
    task = tasks.get(spec.task)
    if task.data == "noisy":
        return noisy_image(name, case)
    if task.logits:
        feeds = {card.input.name: ex.image_batch(spec, case)}
        if card.lam is not None and lam is not None:
            feeds[card.lam.input] = torch.full((case,), lam)
        return feeds
    real = max((c for c in ex.cases(spec, lam_input=False) if c.label.startswith("real")),
               key=lambda c: len(c.inputs[card.input.name]))
    x = real.inputs[card.input.name]
    return {card.input.name: x[[i % len(x) for i in range(case)]]}


def full_batch(name: str) -> int:
    """The "full batch" of an image model: larger for small inputs (see FULL_BATCH_ELEMENTS)."""
    elements = int(np.prod(get_spec(name).input_shape))
    b = 64
    while b > 8 and b * elements > FULL_BATCH_ELEMENTS:
        b //= 2
    return b


def cases_for(name: str, quick: bool = False) -> list[tuple[str, int]]:
    """(label, case) pairs: ``batch N`` or ``S×S``."""
    spec = get_spec(name)
    if tasks.get(spec.task).data == "noisy":
        return [(f"{s}×{s}", s) for s in (QUICK["denoise_sizes"] if quick else DENOISE_SIZES)]
    if quick:
        batches = QUICK["batches"]
    elif spec.card.input.colour is not None:
        batches = (1, full_batch(name))
    else:
        batches = DEFAULT_BLOCK_BATCHES
    return [(f"batch {b}", b) for b in batches]


def torch_call(model: torch.nn.Module, name: str, feeds: dict[str, torch.Tensor]) -> Callable[[], object]:
    """The PyTorch call on the graph's inputs, in the card's order (λ ``None``: the model's own)."""
    card = get_spec(name).card
    x = feeds[card.input.name]
    if tasks.get(card.task).logits and card.lam is not None:
        return partial(model, x, feeds.get(card.lam.input))
    if card.sigma is not None:
        return partial(model, x, feeds[card.sigma.input])
    return partial(model, x)


def ensure_export(name: str, onnx_dir: Path) -> Path:
    """``onnx_dir/NAME.onnx``, exported (fused, verified) first when the pipeline finds it missing or stale."""
    pipeline.run(pipeline.plan([name], onnx_dir=onnx_dir), progress=None)
    return artifacts.graph(name, onnx_dir=onnx_dir)


def quantized_graphs(name: str, onnx_dir: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """FP16/INT8 graphs usable for ``name`` and, for the others, why not (missing or stale: the quantize stage's
    rule, :mod:`unroll.pipeline.quantize_stage`)."""
    ok, why = {}, {}
    for p in QUANTIZED:
        reason = quantize_stage.stale_reason(name, p, onnx_dir)
        if reason is None:
            ok[p] = artifacts.graph(name, p, onnx_dir)
        else:
            why[p] = reason
    return ok, why


def quantizable_models() -> list[str]:
    """The trained models whose cards let ``unroll quantize`` calibrate and gate them."""
    return [n for n in trained_models() if quantizable(n)]


def ensure_quantized(onnx_dir: Path, models: list[str] | None = None,
                     log: Callable[[str], None] = print) -> dict[str, str]:
    """Run ``unroll quantize`` (card gates) for each missing or stale FP16/INT8 graph; returns failures.

    ``models`` defaults to the trained, quantizable ones (:func:`quantizable_models`).
    """
    failed = {}
    for name in quantizable_models() if models is None else models:
        ensure_export(name, onnx_dir)
        _, why = quantized_graphs(name, onnx_dir)
        for p in why:
            log(f"quantizing {name} to {p} ({why[p]})")
            try:
                pipeline.run(pipeline.plan_graph(name, onnx_dir=onnx_dir, precision=p), progress=None)
            except (GateFailed, ValueError, FileNotFoundError) as e:
                failed[f"{name}.{p}"] = str(e)
                log(f"  {name} {p}: {e}")
    return failed


def quant_report(name: str, precision: str, onnx_dir: Path) -> dict | None:
    return artifacts.read_json(artifacts.graph_report(name, precision, onnx_dir))
