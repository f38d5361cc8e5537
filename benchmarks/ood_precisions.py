"""The out-of-distribution score of the quantized graphs: each FP16 and INT8 graph ``unroll quantize`` makes, judged
by the rule it carries (the FP32 rule's signals, sides and weights, its centres, scales and threshold measured again
on its own outputs for the validation digits: :mod:`unroll.export.ood_calibration`), beside the FP32 export judged by
its own, on the same test data as the PyTorch results: AUROC per test set, the share of clean test digits flagged,
and how often its verdict on those digits agrees with the FP32 graph's. ONNX Runtime on the CPU, as served.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from unroll import artifacts, data
from unroll.benchmarks.models_inputs import ensure_quantized
from unroll.benchmarks.ood_scores import auroc
from unroll.card import ModelCard, from_onnx
from unroll.export.ood_calibration import solver_signals
from unroll.gates import array_cases

PRECISIONS = ("fp16", "int8")


def judged(graph: Path, images: dict[str, np.ndarray]) -> tuple[ModelCard, dict[str, np.ndarray]]:
    """``graph``'s card and, per set of ``images``, its verdict's score of each image under the rule it carries."""
    import onnx

    model = onnx.load(graph)
    card = from_onnx(model)
    assert card.ood is not None and card.ood.calibrated
    return card, {k: card.ood.score(solver_signals(model, card, array_cases(card, x, k))) for k, x in images.items()}


def measure(names: Sequence[str], ood: dict, onnx_dir: Path, digits: int | None = None,
            precisions: Sequence[str] = PRECISIONS, tick: Callable[[str], None] = lambda m: None) -> dict:
    """Per model and precision (``fp32`` first): the rule's measured precision and threshold, test AUROC per set,
    the clean test digits flagged and the verdict agreement with FP32 on them; a graph that could not be made is
    listed with the reason."""
    test_x = data.mnist_roles()["test"][0][:digits]
    images = {"digits": test_x, **ood["test"]}
    out: dict[str, dict] = {}
    for name in names:
        tick(f"{name}: FP16/INT8 graphs")
        failed = ensure_quantized(onnx_dir, [name], log=lambda m: None)
        rows: dict[str, dict] = {}
        fp32_flags = None
        for precision in ("fp32", *precisions):
            if f"{name}.{precision}" in failed:
                rows[precision] = {"missing": failed[f"{name}.{precision}"]}
                continue
            card, scores = judged(artifacts.graph(name, precision, onnx_dir), images)
            flags = scores["digits"] > card.ood.threshold
            fp32_flags = flags if precision == "fp32" else fp32_flags
            rows[precision] = {
                "measured_on": card.ood.measured_on, "threshold": card.ood.threshold,
                "clean_flagged": float(flags.mean()),
                "verdict_agreement": float((flags == fp32_flags).mean()),
                "sets": {k: auroc(scores["digits"], s) for k, s in scores.items() if k != "digits"}}
        out[name] = rows
    return out


def markdown(p: dict) -> list[str]:
    """The section of ``ood.md``."""
    if not p:
        return []
    kinds = list(next(r for rows in p.values() for r in rows.values() if "sets" in r)["sets"])
    lines = ["## Quantized graphs: each judged by the rule measured on its own outputs", "",
             "`unroll quantize` keeps the FP32 rule's signals, sides and weights and measures its centres, scales and "
             "threshold again on the quantized graph's outputs for the validation digits (a quantized solver's "
             "residual moves); `unroll repo --precision` serves that rule. ONNX Runtime, CPU; test data.", "",
             f"| model | graph | threshold | clean test digits flagged | verdicts as FP32's | "
             f"{' | '.join(f'AUROC {k}' for k in kinds)} |", "|---|---|---|---|---|" + "---|" * len(kinds)]
    for name, rows in p.items():
        for precision, r in rows.items():
            if "missing" in r:
                lines.append(f"| {name} | {precision} | not made: {r['missing'][:120]} |" + " |" * (len(kinds) + 2))
                continue
            lines.append(f"| {name} | {precision} | {r['threshold']:.3f} | {r['clean_flagged']:.1%} | "
                         f"{r['verdict_agreement']:.1%} | " + " | ".join(f"{r['sets'][k]:.3f}" for k in kinds) + " |")
    return [*lines, ""]
