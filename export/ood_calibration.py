"""A quantized graph's own out-of-distribution calibration.

The card's rule (:class:`unroll.card.OodCard`) was measured on the FP32 graph's solver signals; an FP16 or INT8
graph computes the residual and the code's size from rounded tensors, so the same image gives other numbers. The
quantized graph keeps the rule as chosen (which signals, which sides, which weights) and measures its centres,
scales and threshold again on its own outputs for the same validation data, as the FP32 calibration did; the report
says how far the threshold moved and how often the two graphs' verdicts agree on that data.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx

from unroll.card import SOLVER_SIGNALS, ModelCard
from unroll.gates import GateCase


def solver_signals(model: onnx.ModelProto, card: ModelCard, cases: Sequence[GateCase]) -> dict[str, np.ndarray]:
    """Per sample of ``cases``, as ``model`` (ONNX Runtime, CPU) gives them: the solver's signals and one minus the
    softmax's maximum (in float64, as the gateway reads it)."""
    import onnxruntime as ort

    assert card.ood is not None
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    fits, msps = [], []
    for c in cases:
        logits, fit = sess.run([card.output, card.ood.output], c.feeds)
        z = logits.astype(np.float64)
        p = np.exp(z - z.max(axis=1, keepdims=True))
        msps.append(1.0 - p.max(axis=1) / p.sum(axis=1))
        fits.append(np.asarray(fit, np.float64).reshape(len(z), len(SOLVER_SIGNALS)))
    fit = np.concatenate(fits)
    return {**{k: fit[:, i] for i, k in enumerate(SOLVER_SIGNALS)}, "msp": np.concatenate(msps)}


def recalibrate(card: ModelCard, fp32: onnx.ModelProto, candidate: onnx.ModelProto, cases: Sequence[GateCase],
                precision: str) -> tuple[ModelCard, dict | None]:
    """``card`` with its rule measured again on ``candidate``'s signals for the validation cases, and what changed;
    a card without a calibrated rule comes back as it is (``None``)."""
    if card.ood is None or not card.ood.calibrated:
        return card, None
    validation = [c for c in cases if c.role == "validation"] or list(cases)
    before, after = solver_signals(fp32, card, validation), solver_signals(candidate, card, validation)
    rule = card.ood.refit(after, precision)
    fp32_verdict = card.ood.score(before) > card.ood.threshold
    verdict = rule.score(after) > rule.threshold
    report = {"samples": int(len(verdict)), "threshold_fp32": card.ood.threshold, "threshold": rule.threshold,
              "flagged_fp32": float(fp32_verdict.mean()), "flagged": float(verdict.mean()),
              "verdict_agreement": float((fp32_verdict == verdict).mean()),
              "fp32_rule_on_this_graph_flagged": float((card.ood.score(after) > card.ood.threshold).mean())}
    return card.model_copy(update={"ood": rule}), report
