"""A classification's out-of-distribution fields, from the model's solver residual (``card.ood``).

The graph of a model whose card declares ``ood`` has one more output, its first solver layer's relative residual and
its code's size per image; the card carries the rule ``unroll bench ood`` chose on validation data
(:class:`unroll.card.OodCard`), a sum of terms over those signals and, where validation chose it, the softmax's
maximum. The rule holds at the trained λ and iteration count only, so a request run at another λ (a number, or
``lam=auto``'s pick) or another ``iters`` gets no score, with the reason; so does a model without the outputs.
Nothing is invented.
"""

from __future__ import annotations

import math

import numpy as np

from unroll.card import SOLVER_SIGNALS, ModelCard

#: The answer's header: ``true``, ``false`` or ``unknown`` (no verdict; the JSON's ``ood_note`` says why).
HEADER = "X-In-Distribution"


def outputs(card: ModelCard, served_outputs: dict) -> list[str]:
    """The solver output to ask Triton for besides the logits (none where the served graph has none)."""
    return [card.ood.output] if card.ood is not None and card.ood.output in served_outputs else []


def fields(model: ModelCard, graph: ModelCard, lam: float | None, result: dict[str, np.ndarray],
           msp: float) -> dict:
    """``ood_score``, ``in_distribution`` and, without a verdict, ``ood_note``: ``model`` is the card the client
    named, ``graph`` the one that ran (``iters=K``'s sibling graph), ``lam`` the λ used, ``msp`` one minus the
    softmax's maximum."""
    ood, why = model.ood, None
    if ood is None:
        why = f"{model.name} has no solver residual on its card (card.ood), so no out-of-distribution score"
    elif not ood.calibrated:
        why = f"{model.name}'s card has no rule for its residual yet (`unroll bench ood` chooses one)"
    elif graph.ood is None or ood.output not in result:
        trained = model.iters.default if model.iters is not None else None
        why = f"the score is calibrated at the trained iteration count ({trained}); this request ran {graph.name}"
    elif model.lam is not None and lam is not None and not math.isclose(lam, model.lam.default, rel_tol=1e-6):
        why = f"the score is calibrated at the trained λ ({model.lam.default:g}); this request ran λ = {lam:g}"
    if why is not None:
        return {"ood_score": None, "in_distribution": None, "ood_note": why}
    fit = np.asarray(result[ood.output], np.float64).reshape(-1)
    score = float(ood.score({**dict(zip(SOLVER_SIGNALS, fit.tolist(), strict=True)), "msp": msp}))
    if not math.isfinite(score):
        return {"ood_score": None, "in_distribution": None, "ood_note": "the solver's residual is not a finite number"}
    return {"ood_score": round(score, 6), "in_distribution": bool(score <= ood.threshold)}


def header(body: dict) -> str:
    """The header's value for an answer with :func:`fields`."""
    verdict = body.get("in_distribution")
    return "unknown" if verdict is None else str(verdict).lower()
