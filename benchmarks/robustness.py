"""``unroll bench robustness``: trained digit classifiers under corruptions, per precision and per λ.

Every trained classifier whose card's test set is the MNIST test digits is evaluated on those digits clean and under
each corruption of :mod:`unroll.corruptions` at severities 1–3:

* **PyTorch, FP32** at the trained λ; models that take λ (a CSC front end) also at the λ chosen on the *validation*
  digits under the same corruption and severity (a grid, ties to the trained λ) and with the card's ``lam=auto``
  rule.
* **The served graphs**: the FP32 export and the FP16 and INT8 graphs exactly as ``unroll serve --precision`` makes
  them (the pipeline's export and quantize stages: calibration on the card's training data, the card's accuracy gate
  on validation + stress), run with ONNX Runtime on the CPU at the trained λ. A precision the gate refuses is
  reported as refused with the gate's reason. The graphs are cached in ``onnx_dir`` (``build/onnx``, shared with
  the other benchmarks and ``unroll serve``) and re-made only when the pipeline finds them stale.
* **Accuracy vs λ** (models that take λ): every λ of :data:`unroll.evaluation.LAM_GRID` on the test digits, clean,
  under each corruption and severity, and their mean; beside it the same curve on the validation digits, which is
  where λ is chosen. The test curve's best λ (the *oracle*) is reported only, to show what the choice leaves.

Writes ``robustness.{json,md,png}`` and ``robustness_lam.png``.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

import unroll
from unroll import artifacts, data
from unroll.benchmarks.common import (
    RESULTS,
    machine_info,
    ort_session,
    trained_models,
    write_docs_blocks,
    write_results,
)
from unroll.benchmarks.plots import robustness_lam_plot, robustness_plot
from unroll.card import ModelCard, from_onnx
from unroll.corruptions import CORRUPTIONS, SEVERITIES, corrupt
from unroll.errors import UnknownName, UnrollError
from unroll.evaluation import EVAL_BATCH, LAM_GRID, accuracy, auto_lam
from unroll.export.onnx_export import resolve_card
from unroll.pipeline import export_stage, quantize_stage
from unroll.registry import get_spec

#: Seeds of the corrupted test and validation digits (different draws, so a choice never sees the test noise).
TEST_SEED, VALIDATION_SEED = 0, 1
#: The graphs evaluated: the FP32 export and the quantize stage's two precisions.
PRECISIONS = ("fp32", "fp16", "int8")
QUANTIZED = PRECISIONS[1:]
#: The corruption whose severities get a curve of their own in the λ table and plot (the others are in the mean).
LAM_CURVE_CORRUPTION = "gaussian_noise"
MEAN = "mean over corruptions"


def digit_classifiers() -> list[str]:
    """Trained classifiers tested on the MNIST test digits (the models this benchmark can compare)."""
    return [n for n in trained_models("classification") if get_spec(n).card.data.test == "mnist-test"]


def run(models: Sequence[str] | None = None, corruptions: Sequence[str] | None = None, n_test: int | None = None,
        n_validation: int | None = None, out_dir: Path | None = RESULTS, tick=lambda: None,
        onnx_dir: Path = artifacts.ONNX_DIR, threads: int | None = None,
        gates: dict[str, dict[str, float]] | None = None) -> dict:
    """Evaluate ``models`` (default: :func:`digit_classifiers`) on ``corruptions`` (default: all); the first
    ``n_test`` / ``n_validation`` digits when given. ``tick()`` after each (corruption, severity).

    ``onnx_dir``: where the served graphs are exported and quantized (reused when up to date); ``threads``: ONNX
    Runtime's (default: PyTorch's). ``gates``: ``{precision: {metric: tolerance}}`` overriding the card's gate, as
    ``unroll quantize`` takes them; ``None`` (what ``unroll serve`` uses) for the committed results.
    """
    names = list(models or digit_classifiers())
    chosen = list(corruptions or CORRUPTIONS)
    unknown = [c for c in chosen if c not in CORRUPTIONS]
    if unknown:
        raise UnknownName(f"unknown corruption(s) {', '.join(unknown)}; known: {', '.join(CORRUPTIONS)}")
    threads = threads or torch.get_num_threads()
    payload = {"benchmark": "robustness", "machine": machine_info(threads),
               "severities": list(SEVERITIES), "lam_grid": list(LAM_GRID), "precisions": list(PRECISIONS),
               "corruptions": {c: {"description": CORRUPTIONS[c].description, "levels": list(CORRUPTIONS[c].levels)}
                               for c in chosen},
               "seeds": {"test": TEST_SEED, "validation": VALIDATION_SEED},
               "models": {n: _evaluate(n, chosen, n_test, n_validation, tick, Path(onnx_dir), threads, gates or {})
                          for n in names}}
    if out_dir is not None:
        write_results("robustness", payload, markdown(payload), Path(out_dir))
        robustness_plot(payload, Path(out_dir))
        robustness_lam_plot(payload, Path(out_dir))
        if Path(out_dir).resolve() == RESULTS.resolve():
            write_docs_blocks(RESULTS.parent.parent, README_BEGIN, README_END, readme_block(payload))
    return payload


#: The README's robustness table sits between these markers; :func:`run` rewrites it from robustness.json.
README_BEGIN = "<!-- robustness: generated from benchmarks/results/robustness.json -->"
README_END = "<!-- /robustness -->"


def readme_block(p: dict) -> str:
    """The README's table: the summary of ``robustness.md`` (numbers from the results, never typed by hand)."""
    return "\n".join([*_summary(p)[2:], "Per corruption and severity, the λ curves and the precision deltas: "
                       "[`robustness.md`](benchmarks/results/robustness.md) (`unroll bench robustness`)."])


def _digits(dataset_id: str, n: int | None) -> tuple[np.ndarray, np.ndarray]:
    x, y = data.dataset(dataset_id).load()
    return np.asarray(x[:n], np.float32), np.asarray(y[:n])


# ----------------------------------------------------------------------------------------------- served graphs


def _served_graphs(name: str, onnx_dir: Path, gates: dict[str, dict[str, float]]) -> dict[str, dict]:
    """The FP32 export and its FP16/INT8 graphs as ``unroll serve --precision`` makes them (the pipeline's export
    and quantize stages, re-run only when stale), each ``{"status": "served", "graph", ...}`` or
    ``{"status": "refused" | "not exported", "reason"}``."""
    from unroll.export.quantize import quantize  # onnxruntime: only when a benchmark runs

    try:
        step = export_stage.plan_model(name, onnx_dir)
        if step is not None:
            onnx_dir.mkdir(parents=True, exist_ok=True)
            step.action()
    except UnrollError as e:
        return {p: {"status": "not exported", "reason": str(e)} for p in PRECISIONS}
    out = {"fp32": _graph_info(name, "fp32", onnx_dir)}
    for p in QUANTIZED:
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # ONNX Runtime's calibrators print their progress
                if p in gates:  # the card's gate overridden: always re-made (its options differ from the cache's)
                    quantize(name, p, onnx_dir, gates=gates[p])
                elif quantize_stage.stale_reason(name, p, onnx_dir) is not None:
                    quantize_stage.run(name, p, onnx_dir)
        except (UnrollError, ValueError) as e:  # the gate (GateFailed), the TensorRT lint, a card it cannot use
            out[p] = {"status": "refused", "reason": str(e)}
            continue
        out[p] = _graph_info(name, p, onnx_dir)
    return out


def _graph_info(name: str, precision: str, onnx_dir: Path) -> dict:
    path = artifacts.graph(name, precision, onnx_dir)
    info: dict = {"status": "served", "graph": str(path), "sha256": artifacts.sha256(path)[:16]}
    report = artifacts.read_json(artifacts.report_of(path)) or {}
    if precision != "fp32":
        gate_metrics = report.get("metrics") or {}
        info.update(config=report.get("chosen"), gate=report.get("gate"), gate_data=report.get("gate_data"),
                    gate_metrics={k: gate_metrics.get(k) for k in report.get("gate") or {}},
                    notes=report.get("notes") or [])
    return info


def _onnx_accuracy(session, card: ModelCard, x: np.ndarray, y: np.ndarray) -> float:
    """Top-1 accuracy of a served graph at the card's λ (the trained one, fed where the graph takes λ)."""
    preds = []
    for i in range(0, len(x), EVAL_BATCH):
        xb = np.ascontiguousarray(x[i:i + EVAL_BATCH], np.float32)
        feeds = {card.input.name: xb}
        if card.lam is not None:
            feeds[card.lam.input] = np.full(len(xb), card.lam.default, np.float32)
        preds.append(session.run([card.output], feeds)[0].argmax(1))
    return float((np.concatenate(preds) == y).mean())


# ----------------------------------------------------------------------------------------------- one model


def _best(accs: Sequence[float], trained_lam: float) -> float:
    """The grid λ with the highest accuracy, ties to the one nearest the trained λ."""
    return max(LAM_GRID, key=lambda lam: (accs[LAM_GRID.index(lam)], -abs(lam - trained_lam)))


def _evaluate(name: str, corruptions: list[str], n_test: int | None, n_validation: int | None, tick,
              onnx_dir: Path, threads: int, gates: dict[str, dict[str, float]]) -> dict:
    model = unroll.load(name).eval()
    card = resolve_card(get_spec(name).card, model, lam_input=True)  # λ's default: the trained one, as exported
    xte, yte = _digits(card.data.test, n_test)
    xva, yva = _digits(card.data.validation, n_validation)
    takes_lam = card.lam is not None
    trained_lam = card.lam.default if takes_lam else None
    has_rule = takes_lam and card.lam.auto is not None
    graphs = _served_graphs(name, onnx_dir, gates)
    served = {p: g for p, g in graphs.items() if g["status"] == "served"}
    onnx_card = from_onnx(served["fp32"]["graph"]) if "fp32" in served else None
    sessions = {p: ort_session(g["graph"], threads) for p, g in served.items()}

    def curve(x: np.ndarray, y: np.ndarray) -> list[float]:
        xt = torch.from_numpy(x)
        return [accuracy(model, xt, y, float(lam)) for lam in LAM_GRID]

    def onnx(x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        return {p: _onnx_accuracy(s, onnx_card, x, y) for p, s in sessions.items()}

    out: dict = {"test": f"{card.data.test} ({len(yte)} digits)", "validation": f"{card.data.validation} "
                 f"({len(yva)} digits)", "clean": accuracy(model, torch.from_numpy(xte), yte),
                 "trained_lam": trained_lam, "onnx_lam": onnx_card.lam.default if onnx_card and onnx_card.lam else None,
                 "clean_onnx": onnx(xte, yte), "rows": []}
    if takes_lam:
        out["clean_test_curve"], out["clean_validation_curve"] = curve(xte, yte), curve(xva, yva)
    for c in corruptions:
        for s in SEVERITIES:
            xt_np = corrupt(xte, c, s, TEST_SEED)
            xt = torch.from_numpy(xt_np)
            row = {"corruption": c, "severity": s, "trained": accuracy(model, xt, yte)}
            if takes_lam:
                val, test = curve(corrupt(xva, c, s, VALIDATION_SEED), yva), curve(xt_np, yte)
                best = _best(val, trained_lam)
                row.update(chosen_lam=best, chosen=test[LAM_GRID.index(best)], validation_curve=val, test_curve=test)
                if has_rule:
                    row["auto"] = accuracy(model, xt, yte, auto_lam(model, xt))
            row["onnx"] = onnx(xt_np, yte)
            out["rows"].append(row)
            tick()
    for key in ("trained", "chosen", "auto"):
        vals = [r[key] for r in out["rows"] if key in r]
        if vals:
            out[f"mean_corrupted_{key}"] = float(np.mean(vals))
    out["precisions"] = _precisions(out, graphs)
    if takes_lam:
        out["lam_curve"] = _lam_curve(out, trained_lam)
    return out


def _precisions(m: dict, graphs: dict[str, dict]) -> dict[str, dict]:
    """Per precision: how the graph was made (or why not), its clean and mean corrupted accuracy, and its change
    from the FP32 graph per corruption (points per severity)."""
    out = {}
    for p, g in graphs.items():
        entry = dict(g)
        if g["status"] == "served":
            rows = m["rows"]
            entry["clean"] = m["clean_onnx"][p]
            entry["mean_corrupted"] = float(np.mean([r["onnx"][p] for r in rows])) if rows else None
            if p != "fp32" and "fp32" in m["clean_onnx"]:
                entry["delta_clean"] = entry["clean"] - m["clean_onnx"]["fp32"]
                by_c: dict[str, list[float]] = {}
                for r in rows:
                    by_c.setdefault(r["corruption"], []).append(r["onnx"][p] - r["onnx"]["fp32"])
                entry["delta_vs_fp32"] = by_c
                entry["delta_mean_corrupted"] = float(np.mean([d for v in by_c.values() for d in v])) if rows else None
        out[p] = entry
    if "fp32" in m["clean_onnx"]:  # the served FP32 graph against PyTorch on the same digits at the same λ
        pairs = [("clean", m["clean"], m["clean_onnx"]["fp32"])] + [
            (f"{r['corruption']} {r['severity']}", r["trained"], r["onnx"]["fp32"]) for r in m["rows"]]
        out["fp32"]["differs_from_pytorch"] = [k for k, a, b in pairs if a != b]
    return out


def _lam_curve(m: dict, trained_lam: float) -> dict:
    """Accuracy vs λ on the test digits per condition (clean, each severity of :data:`LAM_CURVE_CORRUPTION`, the
    mean over every corruption and severity), with the λ chosen on the validation curve and the test's oracle."""
    conds = [("clean", m["clean_validation_curve"], m["clean_test_curve"])]
    conds += [(f"{r['corruption']} {r['severity']}", r["validation_curve"], r["test_curve"]) for r in m["rows"]
              if r["corruption"] == LAM_CURVE_CORRUPTION]
    if m["rows"]:
        conds.append((MEAN, np.mean([r["validation_curve"] for r in m["rows"]], axis=0).tolist(),
                      np.mean([r["test_curve"] for r in m["rows"]], axis=0).tolist()))
    out = []
    for label, val, test in conds:
        chosen, oracle = _best(val, trained_lam), _best(test, trained_lam)
        out.append({"condition": label, "test": [float(v) for v in test], "validation": [float(v) for v in val],
                    "chosen_lam": chosen, "chosen": float(test[LAM_GRID.index(chosen)]),
                    "oracle_lam": oracle, "oracle": float(test[LAM_GRID.index(oracle)])})
    return {"trained_lam": trained_lam, "conditions": out}


# ----------------------------------------------------------------------------------------------- Markdown


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}"


def _pts(v: float) -> str:
    """A change in accuracy, in percentage points with its sign."""
    s = f"{100 * v:+.1f}"
    return "±0.0" if s in ("+0.0", "-0.0") else s.replace("-", "−")


def _served_cell(g: dict) -> str:
    if g["status"] != "served":
        return g["status"]
    return f"{_pct(g['clean'])} / {_pct(g['mean_corrupted'])}"


def _fp32_note(p: dict) -> str:
    differs = [n for n, m in p["models"].items() if m["precisions"]["fp32"].get("differs_from_pytorch") != []]
    if not differs:
        return "the served FP32 graphs give the same numbers under every condition"
    return "the served FP32 graph differs, or was not made, for " + ", ".join(differs) + "; see below"


def _summary(p: dict) -> list[str]:
    lines = ["## Summary", "",
             "| model | trained λ | clean | mean corrupted | mean corrupted, λ chosen on validation | "
             "FP16 graph: clean / mean corrupted | INT8 graph: clean / mean corrupted |",
             "|---|---|---|---|---|---|---|"]
    for name, m in p["models"].items():
        prec, lam = m["precisions"], m["trained_lam"]
        lines.append(f"| {name} | {'no λ' if lam is None else f'{lam:g}'} | {_pct(m['clean'])} | "
                     f"{_pct(m.get('mean_corrupted_trained'))} | "
                     f"{'–' if lam is None else _pct(m.get('mean_corrupted_chosen'))} | "
                     f"{_served_cell(prec['fp16'])} | {_served_cell(prec['int8'])} |")
    lines += ["", "Top-1 accuracy (%) on the MNIST test digits. *clean* and *mean corrupted*: the PyTorch model (at "
              "its trained λ where it takes one), the mean over the " + f"{len(p['corruptions'])} corruptions × "
              f"{len(p['severities'])} severities ({_fp32_note(p)}). "
              "*λ chosen on validation*: per corruption and severity, the λ of the grid that does best on the "
              "corrupted *validation* digits. "
              "*FP16 / INT8*: the quantized graphs `unroll serve --precision fp16|int8` serves, on ONNX Runtime (CPU) "
              "at the trained λ; *refused* when the card's accuracy gate rejects the precision.", ""]
    return lines


def _precision_section(p: dict) -> list[str]:
    lines = ["## Does precision cost robustness?", "",
             "The served graphs (`unroll export`, then `unroll quantize`'s FP16 and INT8 graphs: calibrated on the "
             "card's training digits, accepted by the card's accuracy gate on held-out digits, never the test ones) "
             "on ONNX Runtime (CPU), at the trained λ, on the same corrupted test digits. Δ: change from the FP32 "
             "graph in percentage points.", ""]
    for name, m in p["models"].items():
        prec = m["precisions"]
        lines += [f"### {name}", "", "| precision | graph | clean | mean corrupted | Δ clean | Δ mean corrupted |",
                  "|---|---|---|---|---|---|"]
        for pr in PRECISIONS:
            g = prec[pr]
            if g["status"] != "served":
                lines.append(f"| {pr.upper()} | **{g['status']}**: {g['reason']} | – | – | – | – |")
                continue
            what = "the export" if pr == "fp32" else f"{g['config']} (gate: " + ", ".join(
                f"{k} {v:g}" for k, v in (g.get("gate_metrics") or {}).items() if v is not None) + ")"
            d_clean = _pts(g["delta_clean"]) if "delta_clean" in g else ""
            d_mean = _pts(g["delta_mean_corrupted"]) if g.get("delta_mean_corrupted") is not None else ""
            lines.append(f"| {pr.upper()} | {what} | {_pct(g['clean'])} | {_pct(g['mean_corrupted'])} | {d_clean} | "
                         f"{d_mean} |")
        differs = prec["fp32"].get("differs_from_pytorch")
        if differs is not None:
            lines += ["", "FP32 graph vs PyTorch on the same digits: " + (
                "equal accuracy under every condition." if not differs else
                "accuracy differs under " + ", ".join(differs) + ".")]
        quantized = [pr for pr in QUANTIZED if "delta_vs_fp32" in prec[pr]]
        if quantized and m["rows"]:
            lines += ["", "Per corruption, severity 1 / 2 / 3:", "",
                      "| corruption | FP32 graph | " + " | ".join(f"{pr.upper()} Δ" for pr in quantized) + " |",
                      "|---|---|" + "---|" * len(quantized)]
            for c in dict.fromkeys(r["corruption"] for r in m["rows"]):
                fp32 = " / ".join(_pct(r["onnx"]["fp32"]) for r in m["rows"] if r["corruption"] == c)
                deltas = [" / ".join(_pts(d) for d in prec[pr]["delta_vs_fp32"][c]) for pr in quantized]
                lines.append(f"| {c} | {fp32} | " + " | ".join(deltas) + " |")
        lines.append("")
    return lines


def _lam_section(p: dict) -> list[str]:
    lam_models = {n: m for n, m in p["models"].items() if "lam_curve" in m}
    lines = ["## Accuracy vs λ", ""]
    if not lam_models:
        return lines + ["No model here takes λ.", ""]
    lines += ["![accuracy vs λ on the test digits](robustness_lam.png)", "",
              "PyTorch, one λ for every digit, over the grid. The curves are measured on the **test** digits and are "
              "for reporting only: a λ is *chosen* on the **validation** digits (the same corruption, another noise "
              "draw) and then read off the test curve. *Oracle*: the best λ on the test curve itself, which no "
              "deployment could know; the gap is what choosing on validation costs. *mean over corruptions*: one "
              "λ for all corruptions and severities.", ""]
    for name, m in lam_models.items():
        lc = m["lam_curve"]
        conds = lc["conditions"]
        lines += [f"### {name}", "", "| λ | " + " | ".join(c["condition"] for c in conds) + " |",
                  "|---|" + "---|" * len(conds)]
        for i, lam in enumerate(p["lam_grid"]):
            label = f"{lam:g}" + (" (trained)" if abs(lam - lc["trained_lam"]) < 1e-6 else "")
            cells = []
            for c in conds:
                mark = ("✓" if lam == c["chosen_lam"] else "") + ("†" if lam == c["oracle_lam"] else "")
                cells.append(f"{_pct(c['test'][i])}{mark}")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines += ["", f"Test accuracy (%); ✓ the λ chosen on validation, † the oracle on test. Trained λ "
                  f"{lc['trained_lam']:g}.", "",
                  "| condition | λ chosen on validation | test accuracy at it | oracle λ (test) | test accuracy at "
                  "it | gap |", "|---|---|---|---|---|---|"]
        for c in conds:
            lines.append(f"| {c['condition']} | {c['chosen_lam']:g} | {_pct(c['chosen'])} | {c['oracle_lam']:g} | "
                         f"{_pct(c['oracle'])} | {_pts(c['chosen'] - c['oracle'])} |")
        lines.append("")
    return lines


def _details(p: dict) -> list[str]:
    lines = ["## Per corruption and severity", "", "![accuracy vs severity per corruption](robustness.png)", "",
             "PyTorch. λ columns (models that take λ): *chosen* is the λ picked on the validation digits under the "
             "same corruption and severity (grid " + ", ".join(f"{v:g}" for v in p["lam_grid"]) + "), *auto* the "
             "card's λ rule per image. Test digits are reported only. The corruptions: " + "; ".join(
                 f"`{c}` {v['description']}" for c, v in p["corruptions"].items()) + ".", ""]
    for name, m in p["models"].items():
        if m["trained_lam"] is None:
            lines += [f"### {name}", "", f"Test: {m['test']}. This model takes no λ.", "",
                      "| corruption | severity | accuracy |", "|---|---|---|"]
            lines += [f"| {r['corruption']} | {r['severity']} | {_pct(r['trained'])} |" for r in m["rows"]]
            lines.append("")
            continue
        lines += [f"### {name}", "", f"Test: {m['test']}; λ chosen on {m['validation']}.", "",
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
    return lines


def markdown(p: dict) -> str:
    """A summary table (one row per model), then precision, λ and per-corruption details."""
    mach = p["machine"]
    lines = [f"# Robustness of the digit classifiers ({mach['cpu']})", "",
             f"Generated by `unroll bench robustness` on {mach.get('date_utc', '?')} UTC, "
             f"{mach.get('threads_used')} threads. Seeds: test corruptions {p['seeds']['test']}, validation "
             f"{p['seeds']['validation']}.", ""]
    lines += _summary(p) + _precision_section(p) + _lam_section(p) + _details(p)
    return "\n".join(lines)
