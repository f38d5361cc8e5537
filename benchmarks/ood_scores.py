"""How well a score tells out-of-distribution inputs from in-distribution ones (higher score: more out): the
measures every out-of-distribution benchmark reports."""

from __future__ import annotations

import numpy as np


def auroc(inside: np.ndarray, outside: np.ndarray) -> float:
    """Probability that an out-of-distribution input scores above an in-distribution one (ties count half)."""
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(np.r_[np.zeros(len(inside)), np.ones(len(outside))], np.r_[inside, outside]))


def fpr95(inside: np.ndarray, outside: np.ndarray) -> float:
    """Share of out-of-distribution inputs taken as in-distribution at the threshold that keeps 95 % of these."""
    return float((outside <= np.quantile(inside, 0.95)).mean())
