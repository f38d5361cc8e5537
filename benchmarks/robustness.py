"""``unroll bench robustness``: trained digit classifiers under corruptions, with SDNet's λ tuned per corruption.

Every trained classifier whose card's test set is the MNIST test digits is evaluated on those digits clean and under
each corruption of :mod:`unroll.corruptions` at severities 1–3. Models that take λ (a CSC front end) are also run at
the λ chosen on the *validation* digits under the same corruption and severity (a grid, ties to the trained λ) and
with the card's ``lam=auto`` rule; the test digits only report. Writes ``robustness.{json,md,png}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

import unroll
from unroll import data
from unroll.benchmarks.common import RESULTS, machine_info, trained_models, write_results
from unroll.benchmarks.plots import robustness_plot
from unroll.corruptions import CORRUPTIONS, SEVERITIES, corrupt
from unroll.evaluation import LAM_GRID, accuracy, auto_lam
from unroll.export.onnx_export import resolve_card
from unroll.registry import get_spec

#: Seeds of the corrupted test and validation digits (different draws, so a choice never sees the test noise).
TEST_SEED, VALIDATION_SEED = 0, 1


def digit_classifiers() -> list[str]:
    """Trained classifiers tested on the MNIST test digits (the models this benchmark can compare)."""
    return [n for n in trained_models("classification") if get_spec(n).card.data.test == "mnist-test"]


def run(models: Sequence[str] | None = None, corruptions: Sequence[str] | None = None, n_test: int | None = None,
        n_validation: int | None = None, out_dir: Path | None = RESULTS, tick=lambda: None) -> dict:
    """Evaluate ``models`` (default: :func:`digit_classifiers`) on ``corruptions`` (default: all); the first
    ``n_test`` / ``n_validation`` digits when given. ``tick()`` after each (corruption, severity)."""
    names = list(models or digit_classifiers())
    chosen = list(corruptions or CORRUPTIONS)
    unknown = [c for c in chosen if c not in CORRUPTIONS]
    if unknown:
        raise KeyError(f"unknown corruption(s) {', '.join(unknown)}; known: {', '.join(CORRUPTIONS)}")
    payload = {"benchmark": "robustness", "machine": machine_info(torch.get_num_threads()),
               "severities": list(SEVERITIES), "lam_grid": list(LAM_GRID),
               "corruptions": {c: {"description": CORRUPTIONS[c].description, "levels": list(CORRUPTIONS[c].levels)}
                               for c in chosen},
               "seeds": {"test": TEST_SEED, "validation": VALIDATION_SEED},
               "models": {n: _evaluate(n, chosen, n_test, n_validation, tick) for n in names}}
    if out_dir is not None:
        write_results("robustness", payload, markdown(payload), Path(out_dir))
        robustness_plot(payload, Path(out_dir))
    return payload


def _digits(dataset_id: str, n: int | None) -> tuple[np.ndarray, np.ndarray]:
    x, y = data.dataset(dataset_id).load()
    return np.asarray(x[:n], np.float32), np.asarray(y[:n])


def _evaluate(name: str, corruptions: list[str], n_test: int | None, n_validation: int | None, tick) -> dict:
    model = unroll.load(name).eval()
    card = resolve_card(get_spec(name).card, model, lam_input=True)  # λ's default: the trained one, as exported
    xte, yte = _digits(card.data.test, n_test)
    xva, yva = _digits(card.data.validation, n_validation)
    takes_lam = card.lam is not None
    trained_lam = card.lam.default if takes_lam else None
    has_rule = takes_lam and card.lam.auto is not None
    out: dict = {"test": f"{card.data.test} ({len(yte)} digits)", "validation": f"{card.data.validation} "
                 f"({len(yva)} digits)", "clean": accuracy(model, torch.from_numpy(xte), yte),
                 "trained_lam": trained_lam, "rows": []}
    for c in corruptions:
        for s in SEVERITIES:
            xt = torch.from_numpy(corrupt(xte, c, s, TEST_SEED))
            row = {"corruption": c, "severity": s, "trained": accuracy(model, xt, yte)}
            if takes_lam:
                xv = torch.from_numpy(corrupt(xva, c, s, VALIDATION_SEED))
                accs = {lam: accuracy(model, xv, yva, lam) for lam in LAM_GRID}
                best = max(LAM_GRID, key=lambda lam: (accs[lam], -abs(lam - trained_lam)))
                row.update(chosen_lam=best, chosen=accuracy(model, xt, yte, float(best)))
                if has_rule:
                    row["auto"] = accuracy(model, xt, yte, auto_lam(model, xt))
            out["rows"].append(row)
            tick()
    for key in ("trained", "chosen", "auto"):
        vals = [r[key] for r in out["rows"] if key in r]
        if vals:
            out[f"mean_corrupted_{key}"] = float(np.mean(vals))
    return out


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}"


def markdown(p: dict) -> str:
    """Per model: clean beside mean corrupted accuracy, then the table per corruption and severity."""
    lines = [f"# Robustness of the digit classifiers ({p['machine']['cpu']})", "", "![accuracy vs severity per "
             "corruption](robustness.png)", "",
             "Top-1 accuracy (%) on the MNIST test digits, clean and under each corruption (`unroll/corruptions.py`) "
             "at severity 1/2/3. λ columns (models that take λ): *chosen* is the λ picked on the validation digits "
             "under the same corruption and severity (grid " + ", ".join(f"{v:g}" for v in p["lam_grid"]) +
             "), *auto* the card's λ rule per image. Test digits are reported only.", ""]
    for name, m in p["models"].items():
        lines += [f"## {name}", "", f"Test: {m['test']}; λ chosen on {m['validation']}.", "",
                  "| | trained λ | chosen λ | auto λ |", "|---|---|---|---|",
                  f"| clean | {_pct(m['clean'])} | | |",
                  f"| mean over corruptions | {_pct(m.get('mean_corrupted_trained'))} | "
                  f"{_pct(m.get('mean_corrupted_chosen'))} | {_pct(m.get('mean_corrupted_auto'))} |", "",
                  "| corruption | severity | trained λ | chosen λ (value) | auto λ |", "|---|---|---|---|---|"]
        for r in m["rows"]:
            ch = f"{_pct(r['chosen'])} ({r['chosen_lam']:g})" if "chosen" in r else "–"
            lines.append(f"| {r['corruption']} | {r['severity']} | {_pct(r['trained'])} | {ch} | "
                         f"{_pct(r.get('auto'))} |")
        lines.append("")
    return "\n".join(lines)
