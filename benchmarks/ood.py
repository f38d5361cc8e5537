"""What the solver knows: an out-of-distribution score from the first solver layer's reconstruction residual.

For each trained digit classifier with a solver layer (:func:`unroll.solvers.residual.first_solver`), in PyTorch
(in-process, FP32): the relative residual ``‖target − D·z‖ / ‖target‖`` per image, beside the two scores a user
would try first, the maximum softmax probability (MSP) and the energy (``−logsumexp`` of the logits).

Chosen on validation data only (validation digits and :func:`unroll.ood_sets.ood_sets` ``validation``): whether the
residual is read one-sided (high = out of distribution) or two-sided (far from the typical residual either way,
``|r − median| / MAD`` of the validation digits), by the mean AUROC over the validation sets; and the threshold,
the :data:`FLAG_QUANTILE` quantile of the validation digits' scores. Reported on test data only: AUROC and FPR95
(the share of out-of-distribution images taken for digits at the threshold that keeps 95 % of the test digits)
per test set for every score; the share of clean test digits flagged; the three whole photos; the corrupted test
digits of the robustness benchmark by severity; and the added work (the reconstruction and its norms, batch 1,
against the model's forward).

Served (:mod:`unroll.benchmarks.ood_served`): for each model whose card declares ``ood``, the served graph with its
residual output beside the same graph without it, through Triton and the gateway at concurrency 1: the added
latency and CPU per request. The denoiser: its residual as a noise estimate (:mod:`~unroll.benchmarks.denoise_residual`)
and as an out-of-distribution score (:mod:`~unroll.benchmarks.denoise_ood`). ``unroll bench ood`` writes
``ood.{json,md,png}`` and the docs' table.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from unroll import artifacts, data, ood_sets, registry
from unroll.benchmarks import denoise_ood, denoise_residual, ood_precisions, ood_served
from unroll.benchmarks.common import RESULTS, machine_info, time_call, trained_models, write_docs_blocks, write_results
from unroll.benchmarks.ood_scores import auroc, fpr95
from unroll.card import SOLVER_SIGNALS, OodCard, OodTerm
from unroll.corruptions import CORRUPTIONS, SEVERITIES, corrupt
from unroll.solvers.residual import WithResidual, first_solver

STEM = "ood"
#: Threshold: this quantile of the validation digits' residual scores (≈1 % of in-distribution images flagged).
FLAG_QUANTILE = 0.99
#: Scores reported per test set: the chosen rule, the solver's signals alone, and the two baselines.
SCORES = ("rule", "solver", "msp", "energy")
BATCH = 256
#: The issue's targets, for the CSC (SDNet) classifiers: the model the score was built for first.
TARGET_AUROC, TARGET_CLEAN_FLAGGED, TARGET_ADDED = 0.95, 0.02, 0.05
#: Corrupted test digits per corruption and severity (the robustness benchmark's corruptions, seed 0).
CORRUPTED_DIGITS = 200


def scored_models() -> list[str]:
    """The trained digit classifiers (28×28 grey input, like :mod:`unroll.ood_sets`) that have a solver layer, in
    registry order; the others have no residual to score by."""
    side = (1, ood_sets.SIDE, ood_sets.SIDE)
    return [n for n in trained_models("classification") if tuple(registry.get_spec(n).card.input.shape) == side
            and first_solver(registry.load(n, pretrained=False)) is not None]


#: Candidate weights of the softmax term beside the solver's (the softmax's spread on digits is far narrower).
SOFTMAX_WEIGHTS = (0.05, 0.1, 0.2, 0.3, 0.5, 1.0)


def term(signal: str, sided: str, inside: np.ndarray, weight: float = 1.0) -> OodTerm:
    """A term centred on the validation digits' median and scaled by their MAD."""
    return OodTerm(signal=signal, sided=sided, weight=weight).fitted(inside)


@torch.no_grad()
def scores(model: torch.nn.Module, x: np.ndarray) -> dict[str, np.ndarray]:
    """Per image: the solver's signals (the relative residual and the code's size, as the graph outputs them), the
    MSP score (``1 − max softmax``, in float64 as the gateway reads it), the energy score (``−logsumexp``) and the
    top label (``label``, integers)."""
    out: dict[str, list[np.ndarray]] = {"residual": [], "code_l1": [], "msp": [], "energy": [], "label": []}
    both = WithResidual(model)
    for i in range(0, len(x), BATCH):
        logits, fit = both(torch.from_numpy(np.ascontiguousarray(x[i:i + BATCH])))
        for k, column in zip(SOLVER_SIGNALS, fit.unbind(1), strict=True):
            out[k].append(column.numpy())
        out["msp"].append(1.0 - torch.softmax(logits.double(), 1).amax(1).numpy())
        out["energy"].append(-torch.logsumexp(logits, 1).numpy())
        out["label"].append(logits.argmax(1).numpy())
    return {k: np.concatenate(v) if k == "label" else np.concatenate(v).astype(np.float64) for k, v in out.items()}


def candidates(inside: dict[str, np.ndarray]) -> dict[str, tuple[OodTerm, ...]]:
    """The rules validation chooses among, simplest first: the residual one- or two-sided, with the code's size
    beside it, then each with the softmax's maximum at :data:`SOFTMAX_WEIGHTS`."""
    high, both = term("residual", "high", inside["residual"]), term("residual", "both", inside["residual"])
    solver = {"residual, one-sided": (high,), "residual, two-sided": (both,),
              "residual + code size": (both, term("code_l1", "both", inside["code_l1"]))}
    fused = {f"{name} + softmax × {w:g}": (*terms, term("msp", "high", inside["msp"], w))
             for name, terms in solver.items() for w in SOFTMAX_WEIGHTS}
    return solver | fused


def choose_rule(inside: dict[str, np.ndarray], outside: dict[str, dict[str, np.ndarray]]
                ) -> tuple[OodCard, str, dict[str, float]]:
    """The candidate (:func:`candidates`) with the best mean AUROC over the validation sets (the simpler one on a
    tie), its threshold at :data:`FLAG_QUANTILE` of the validation digits' scores: the rule, its name and every
    candidate's validation mean AUROC."""
    options = candidates(inside)
    mean_auroc = {}
    for name, terms in options.items():
        probe = OodCard(terms=terms)
        mean_auroc[name] = float(np.mean([auroc(probe.score(inside), probe.score(s)) for s in outside.values()]))
    best = max(mean_auroc, key=mean_auroc.get)  # the first of equals: the simplest
    return OodCard(terms=options[best], quantile=FLAG_QUANTILE).refit(inside), best, mean_auroc


def added_cost(model: torch.nn.Module, x: np.ndarray) -> dict[str, float]:
    """Batch 1, in-process: the model's forward, and its forward with the residual as the exported graph computes
    it (:class:`~unroll.solvers.residual.WithResidual`: what a served residual output adds), median ms of rounds
    that alternate the two; the difference and the ratio."""
    one = torch.from_numpy(np.ascontiguousarray(x[:1]))
    both = WithResidual(model)
    plain, with_residual = [], []
    with torch.no_grad():
        for _ in range(5):
            plain.append(time_call(lambda: model(one), budget_s=0.4)["median_ms"])
            with_residual.append(time_call(lambda: both(one), budget_s=0.4)["median_ms"])
    forward, total = float(np.median(plain)), float(np.median(with_residual))
    return {"forward_ms": forward, "residual_ms": total - forward, "added": total / forward - 1}


def images() -> dict[str, dict[str, np.ndarray]]:
    """The out-of-distribution images every model is scored on: ``validation`` and ``test`` sets by kind, and the
    whole ``photos`` (built once per run)."""
    return {"validation": ood_sets.ood_sets("validation"), "test": ood_sets.ood_sets("test"),
            "photos": ood_sets.photos()}


def evaluate(name: str, digits: int | None = None, tick: Callable[[str], None] = lambda m: None,
             ood: dict[str, dict[str, np.ndarray]] | None = None) -> dict:
    """One model's rule (chosen on validation) and its test results (module docstring); ``ood``: :func:`images`.
    Beside the chosen rule, the best rule of the solver's signals alone (no softmax term), also chosen on
    validation, is reported on the same test data."""
    ood = ood if ood is not None else images()
    model = registry.load(name).eval()
    layer = first_solver(model)
    roles = data.mnist_roles()
    (val_x, val_y), (test_x, test_y) = ((x[:digits], y[:digits]) for x, y in (roles["validation"], roles["test"]))
    tick(f"{name}: validation")
    val_in = scores(model, val_x)
    val_ood = {k: scores(model, v) for k, v in ood["validation"].items()}
    rule, chosen, val_auroc = choose_rule(val_in, val_ood)
    options = candidates(val_in)
    solver_only = max((n for n, terms in options.items() if "msp" not in {t.signal for t in terms}),
                      key=val_auroc.get)
    as_score = {"rule": rule.score, "solver": OodCard(terms=options[solver_only]).score,
                "msp": lambda s: s["msp"], "energy": lambda s: s["energy"]}

    def flags(s: dict[str, np.ndarray]) -> np.ndarray:
        return rule.score(s) > rule.threshold

    tick(f"{name}: test")
    test_in = scores(model, test_x)
    sets = {}
    for kind, imgs in ood["test"].items():
        s = scores(model, imgs)
        sets[kind] = {"n": len(imgs), "flagged": float(flags(s).mean()),
                      **{k: {"auroc": auroc(f(test_in), f(s)), "fpr95": fpr95(f(test_in), f(s))}
                         for k, f in as_score.items()}}
    photos = {}
    for photo, img in ood["photos"].items():
        s = scores(model, img)
        photos[photo] = {"residual": float(s["residual"][0]), "code_l1": float(s["code_l1"][0]),
                         "score": float(rule.score(s)[0]), "flagged": bool(flags(s)[0]),
                         "top_label": int(s["label"][0]), "max_softmax": float(1.0 - s["msp"][0])}
    tick(f"{name}: corrupted digits")
    corrupted = {}
    base = test_x[:CORRUPTED_DIGITS]
    for sev in SEVERITIES:
        per = {c: float(flags(scores(model, corrupt(base, c, sev))).mean()) for c in CORRUPTIONS}
        corrupted[str(sev)] = {"mean_flagged": float(np.mean(list(per.values()))), "per_corruption": per}
    wrong = test_in["label"] != test_y
    return {"layer": type(layer).__name__, "rule": {"name": chosen, **rule.model_dump(include=set(RULE_FIELDS))},
            "solver_only": solver_only, "validation_mean_auroc": val_auroc,
            "digits": {"validation": len(val_x), "test": len(test_x)},
            "accuracy": {"validation": float((val_in["label"] == val_y).mean()), "test": float(1 - wrong.mean())},
            "clean_flagged": float(flags(test_in).mean()),
            "misclassified": {"test": int(wrong.sum()), "flagged": int((wrong & flags(test_in)).sum())},
            "test_residual_median": float(np.median(test_in["residual"])),
            "sets": sets, "photos": photos, "corrupted": corrupted, "cost": added_cost(model, test_x)}


def verdicts(p: dict) -> list[dict]:
    """The issue's targets for each CSC classifier (first solver layer a ``DictBlock``), and the served added
    latency of every model served with its residual, with what was measured and whether it holds."""
    out = [v for name, m in p["models"].items() if m["layer"] == "DictBlock" for v in _verdicts(name, m)]
    for name, m in (p.get("served") or {}).items():
        for path in ood_served.PATHS:
            row = m[path]
            out.append({"target": f"{name}: served added latency ≤ {TARGET_ADDED:.0%} at concurrency 1 "
                                  f"({ood_served.PATH_LABELS[path]}; the 95% interval's upper end, A/A clean)",
                        "measured": f"{_served(row)}; {row['verdict']['why']}",
                        "met": row["verdict"]["met"]})
    return out


def _verdicts(name: str, m: dict) -> list[dict]:
    aurocs = {k: v["rule"]["auroc"] for k, v in m["sets"].items()}
    above = {k: v["rule"]["auroc"] > v["msp"]["auroc"] for k, v in m["sets"].items()}
    return [
        {"target": f"{name}: AUROC ≥ {TARGET_AUROC} on every test set ({m['rule']['name']})",
         "measured": ", ".join(f"{k} {a:.3f}" for k, a in aurocs.items()),
         "met": all(a >= TARGET_AUROC for a in aurocs.values())},
        {"target": f"{name}: above the maximum-softmax baseline on every test set ({m['rule']['name']})",
         "measured": ", ".join(f"{k} {'above' if ok else 'not above'}" for k, ok in above.items()),
         "met": all(above.values())},
        {"target": f"{name}: the three photos come back out of distribution",
         "measured": ", ".join(f"{k} {'flagged' if v['flagged'] else 'not flagged'}" for k, v in m["photos"].items()),
         "met": all(v["flagged"] for v in m["photos"].values())},
        {"target": f"{name}: ≤ {TARGET_CLEAN_FLAGGED:.0%} of the clean test digits flagged",
         "measured": f"{m['clean_flagged']:.1%}", "met": m["clean_flagged"] <= TARGET_CLEAN_FLAGGED},
    ]


def run(models: list[str] | None = None, digits: int | None = None, out_dir: Path | None = RESULTS,
        tick: Callable[[str], None] = lambda m: None, served: bool = True, onnx_dir: Path = artifacts.ONNX_DIR,
        served_cycles: int = 8, served_run_s: float = 1.5, served_handover_s: float = 4.0,
        quantized: tuple[str, ...] = ood_precisions.PRECISIONS) -> dict:
    """Evaluate ``models`` (default :func:`scored_models`); judge the ``quantized`` graphs of those whose card declares
    ``ood`` by the rules measured on them (:mod:`~unroll.benchmarks.ood_precisions`); with ``served``, measure what
    the residual costs their served requests (:mod:`~unroll.benchmarks.ood_served`; graphs exported and quantized
    into ``onnx_dir`` where missing or stale); write the results (and the docs' table when writing into the
    committed results folder)."""
    names = list(models or scored_models())
    ood = images()
    payload = {"benchmark": STEM, "machine": machine_info(torch.get_num_threads()),
               "flag_quantile": FLAG_QUANTILE, "ood_sets": _describe_sets(),
               "models": {n: evaluate(n, digits, tick, ood) for n in names}}
    tick("the denoiser's residual as a noise estimate")
    payload["denoiser"] = denoise_residual.measure()
    payload["denoiser_ood"] = denoise_ood.evaluate(tick=tick, crops=denoise_ood.CROPS if digits is None else 1)
    committed = out_dir is not None and Path(out_dir).resolve() == RESULTS.resolve()
    if committed and digits is None:  # the whole validation split: the rules the served graphs carry
        record_rules(payload)
    if quantized:  # after the rules are recorded: the graphs are exported and quantized with them
        payload["quantized"] = ood_precisions.measure(ood_served.declaring_ood(names), ood, onnx_dir, digits,
                                                      quantized, tick)
    if served:
        payload["served"] = ood_served.measure(names, onnx_dir, served_cycles, served_run_s, tick,
                                               served_handover_s)
    payload["targets"] = verdicts(payload)
    if out_dir is not None:
        write_results(STEM, payload, markdown(payload), Path(out_dir))
        plot(payload, Path(out_dir))
        if committed:
            write_docs_blocks(RESULTS.parent.parent, README_BEGIN, README_END, readme_block(payload))
    return payload


#: The rule's fields a card's ``ood`` takes (:class:`unroll.card.OodCard`).
RULE_FIELDS = ("terms", "threshold", "quantile")


def record_rules(payload: dict) -> list[Path]:
    """Each model's rule, chosen on validation data, into its committed training record (``"ood"``) where its card
    declares ``ood``: ``unroll export`` puts it on the exported card, and the gateway judges by it. Returns the
    records written."""
    written = []
    for name, m in payload["models"].items():
        spec = registry.get_spec(name)
        if spec.card.ood is None or not spec.info_path.exists():
            continue
        record = spec.info()
        record["ood"] = {k: m["rule"][k] for k in RULE_FIELDS}
        spec.info_path.write_text(json.dumps(record, indent=2) + "\n")
        written.append(spec.info_path)
    return written


def _describe_sets() -> dict:
    return {"validation": {"photos": list(ood_sets.VALIDATION_PHOTOS), "fonts": list(ood_sets.VALIDATION_FONTS),
                           "characters": ood_sets.VALIDATION_CHARS, "noise": "uniform", "blank": "flat levels",
                           "seed": ood_sets.SEEDS["validation"]},
            "test": {"photos": list(ood_sets.TEST_PHOTOS), "fonts": list(ood_sets.TEST_FONTS),
                     "characters": ood_sets.TEST_CHARS, "noise": "Gaussian and salt-and-pepper",
                     "blank": "linear gradients", "seed": ood_sets.SEEDS["test"]},
            "whole_photos": list(ood_sets.WHOLE_PHOTOS)}


# ------------------------------------------------------------------------------------------------- reports


def _row(kind: str, s: dict) -> str:
    cells = " | ".join(f"{s[k]['auroc']:.3f} / {s[k]['fpr95']:.2f}" for k in SCORES)
    return f"| {kind} | {s['n']} | {cells} | {s['flagged']:.0%} |"


def markdown(p: dict) -> str:
    m0 = p["machine"]
    lines = ["# Out-of-distribution score from the solver's residual", "",
             f"{m0.get('cpu', '?')}; `unroll bench ood`, in-process PyTorch FP32 (the served graph's solver outputs "
             "are the same numbers). The signals: the first solver layer's relative residual ‖x − D·z‖ / ‖x‖, its "
             "code's size ‖z‖₁ / ‖x‖ and, as one candidate term, one minus the softmax's maximum; each term is "
             "(s − median) / MAD of the validation digits (two-sided: |s − median| / MAD), the score their "
             "weighted sum. Rule (which terms, the softmax's weight) and threshold chosen on validation data "
             "(validation digits + validation sets, best mean AUROC), reported on test data. Columns: *rule* the "
             "chosen score, *solver* the best rule of the solver's signals alone (also chosen on validation), then "
             "the two baselines. Score cells: AUROC / FPR95 (share of out-of-distribution images taken for digits "
             "at the threshold keeping 95 % of the test digits); flagged: share above the rule's threshold "
             f"(validation digits' {p['flag_quantile']:.0%} quantile).", ""]
    for name, m in p["models"].items():
        r, val = m["rule"], m["validation_mean_auroc"]
        lines += [f"## {name} ({m['layer']})", "",
                  f"- rule chosen on validation: **{r['name']}** (validation mean AUROC {val[r['name']]:.3f}; the "
                  f"solver's signals alone at best: {m['solver_only']}, {val[m['solver_only']]:.3f}); terms: "
                  + "; ".join(f"{t['signal']} {t['sided']}, median {t['center']:.4g}, MAD {t['scale']:.3g}, weight "
                              f"{t['weight']:g}" for t in r["terms"]) + f"; threshold {r['threshold']:.3f}",
                  f"- clean test digits flagged: {m['clean_flagged']:.1%} ({m['digits']['test']} digits; of the "
                  f"{m['misclassified']['test']} the classifier gets wrong, {m['misclassified']['flagged']} flagged); "
                  f"accuracy on the validation digits {m['accuracy']['validation']:.1%}, on the test digits "
                  f"{m['accuracy']['test']:.1%}",
                  "- photos: " + ", ".join(
                      f"{k} {'flagged' if v['flagged'] else 'not flagged'} (score {v['score']:.1f}, residual "
                      f"{v['residual']:.3f}; the "
                      f"classifier says {v['top_label']} at {v['max_softmax']:.3f})" for k, v in m["photos"].items()),
                  "- corrupted test digits flagged, mean over corruptions, by severity: " + ", ".join(
                      f"{s}: {v['mean_flagged']:.1%}" for s, v in m["corrupted"].items()),
                  f"- eager PyTorch, batch 1: the forward with the residual (its hook and a few small operations, "
                  f"Python's overhead included) {m['cost']['residual_ms']:.3f} ms over the forward's "
                  f"{m['cost']['forward_ms']:.3f} ms ({m['cost']['added']:+.1%}); served, the graph's cost is under "
                  "*Served* below", "",
                  "| test set | images | rule | solver | MSP | energy | flagged |", "|---|---|---|---|---|---|---|",
                  *(_row(k, s) for k, s in m["sets"].items()), ""]
    lines += ood_precisions.markdown(p.get("quantized") or {})
    if p.get("denoiser"):
        lines += denoise_residual.markdown(p["denoiser"])
    if p.get("denoiser_ood"):
        lines += denoise_ood.markdown(p["denoiser_ood"])
    if p.get("served"):
        lines += served_markdown(p["served"])
    if p.get("targets"):
        lines += ["## Targets", "", "| target | measured | met |", "|---|---|---|",
                  *(f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else '**no**'} |" for t in p["targets"]),
                  ""]
    return "\n".join(lines)


README_BEGIN = "<!-- ood: generated from benchmarks/results/ood.json -->"
README_END = "<!-- /ood -->"


def _paired(r: dict) -> str:
    """A difference measured in request pairs, with its confidence interval, in words."""
    lo, hi = r["added_ci_ms"]
    return f"{r['added_ms'] * 1e3:+.0f} µs (95% CI {lo * 1e3:+.0f} … {hi * 1e3:+.0f}, {r['pairs']} pairs)"


def _interval(d: dict) -> str:
    """A mean difference over whole-server cycles with its 95 % interval, in µs and as a share, in words."""
    lo, hi = d["ci_ms"]
    return (f"{d['ms'] * 1e3:+.0f} µs (95% CI {lo * 1e3:+.0f} … {hi * 1e3:+.0f}), {d['share']:+.1%} "
            f"({d['ci'][0]:+.1%} … {d['ci'][1]:+.1%})")


def _served(row: dict) -> str:
    """What the score costs a client on one path, in words: the added latency on the request without it, the A/A."""
    return (f"{_interval(row['added'])} on a {row['without']['p50_ms']:.3f} ms request; A/A "
            f"{_interval(row['aa'])}")


def served_markdown(served: dict) -> list[str]:
    """``ood.md``'s section on the served cost (:mod:`~unroll.benchmarks.ood_served`)."""
    first = next(iter(served.values()))
    lines = ["## Served: what the score costs a client", "",
             "The deployment served with the score against the same deployment without it (each model's graph "
             "without its solver output, same name, card less `ood`), both written as `unroll serve` writes them "
             "(every model and its companions, the default threads, spinning and batching), each *run* a fresh "
             "tritonserver and gateway. Per model and path one test digit at concurrency 1, timed per request "
             f"on a kept-alive connection ({first['warmup_requests']} unmeasured first, then "
             f"{first['run_s']:g} s). A cycle is three runs, *without*, *with* and *without* again (the A/A arm), "
             "in an order that rotates; per cycle the added latency is the *with* run's p50 less the *without* "
             f"run's. Over {first['cycles']} cycles: the mean, its Student-t 95% interval, and the share of the "
             "*without* p50. A verdict is met when the A/A interval holds zero and the added latency's interval "
             f"ends at or below {TARGET_ADDED:.0%}. Triton direct asks for the logits and, where served, the "
             "solver output, *score not asked* for the logits alone; the gateway answers the score, the "
             "verdict and the header where the card declares `ood`. CPU ms per request by process (gateway, "
             "tritonserver, backend stubs), medians over the runs.", "",
             "| model | path | p50 ms without / with | added latency: µs (95% CI), share (CI) | A/A: µs (95% CI) | "
             "met | CPU ms/req without: gateway / triton / backends | with |",
             "|---|---|---|---|---|---|---|---|"]
    for name, m in served.items():
        for path in ood_served.PATHS:
            r = m[path]
            cpu = {arm: " / ".join(f"{r[arm]['cpu_ms_per_request'].get(k, 0.0):.3f}"
                                   for k in ("gateway", "tritonserver", "backends")) for arm in ("without", "with")}
            lo, hi = r["aa"]["ci_ms"]
            lines.append(f"| {name} | {ood_served.PATH_LABELS[path]} | {r['without']['p50_ms']:.3f} / "
                         f"{r['with']['p50_ms']:.3f} | {_interval(r['added'])} | {r['aa']['ms'] * 1e3:+.0f} "
                         f"({lo * 1e3:+.0f} … {hi * 1e3:+.0f}) | {'yes' if r['verdict']['met'] else '**no**'} | "
                         f"{cpu['without']} | {cpu['with']} |")
    lines += ["", "Where the time goes, as explanation (not judged): the graphs alone in-process (ONNX Runtime with "
              "the served threads and spinning, batch 1, alternating rounds, after the servers stopped); the extra "
              "output's hand-over, one served model asked for both outputs against asked for its logits in request "
              "pairs (order-statistics 95% CI); the gateway's own code for the score in-process.", ""]
    lines += [f"- {name}: graph {m['graph']['without_ms']:.3f} → {m['graph']['with_ms']:.3f} ms "
              f"({m['graph']['added_ms'] * 1e3:+.0f} µs, {m['graph']['threads']} threads); hand-over "
              f"{_paired(m['handover'])}; the gateway's score code "
              f"{m['graph']['gateway_score']['added_ms'] * 1e3:+.1f} µs"
              for name, m in served.items()]
    return [*lines, ""]


def readme_block(p: dict) -> str:
    """The README's summary: per model, the mean test AUROC of each score and what the threshold flags."""
    lines = ["| model | solver layer | rule (chosen on validation) | mean test AUROC: rule / solver alone / MSP / "
             "energy | lowest set: rule / MSP | clean digits flagged | photos flagged |",
             "|---|---|---|---|---|---|---|"]
    for name, m in p["models"].items():
        mean = {k: np.mean([s[k]["auroc"] for s in m["sets"].values()]) for k in SCORES}
        low = min(m["sets"], key=lambda k: m["sets"][k]["rule"]["auroc"])
        lines.append(f"| {name} | {m['layer']} | {m['rule']['name']} | "
                     f"{mean['rule']:.3f} / {mean['solver']:.3f} / {mean['msp']:.3f} / {mean['energy']:.3f} | "
                     f"{low} {m['sets'][low]['rule']['auroc']:.3f} / {m['sets'][low]['msp']['auroc']:.3f} | "
                     f"{m['clean_flagged']:.1%} | {sum(v['flagged'] for v in m['photos'].values())} of "
                     f"{len(m['photos'])} |")
    first, m = next(iter(p["models"].items()))
    said = "; ".join(f"{k}: **{v['top_label']}** at maximum softmax {v['max_softmax']:.3f}, score "
                     f"{v['score']:.1f} ({'flagged' if v['flagged'] else 'not flagged'})"
                     for k, v in m["photos"].items())
    extra = []
    for name, m in (p.get("served") or {}).items():
        extra.append(f"What the score costs a client of {name} at concurrency 1, the deployment with it against "
                     "without it (whole-server runs; target ≤ 5% on the interval's upper end): " + "; ".join(
                         f"{ood_served.PATH_LABELS[path]} {_interval(m[path]['added'])}, "
                         f"**{'met' if m[path]['verdict']['met'] else 'not met'}**"
                         for path in ood_served.PATHS) + ".")
    if p.get("denoiser"):
        d = p["denoiser"]
        errors = "; ".join(f"σ {level}: {s['residual']['mae']:.2f} against {s['wavelet']['mae']:.2f}"
                           for level, s in d["summary"].items())
        extra.append(f"{d['model']}'s residual as a noise estimate (`X-Sigma-Residual`) against the wavelet estimate "
                     f"it is run at (`X-Sigma-Used`), mean absolute error on its test photos (0–255 scale): {errors}.")
    if p.get("denoiser_ood"):
        d = p["denoiser_ood"]
        extra.append(f"{d['model']}'s discrepancy, log(`X-Sigma-Residual` / `X-Sigma-Used`), as an out-of-distribution "
                     f"score ({d['rule']}, chosen on validation), test AUROC: " + ", ".join(
                         f"{k} {s['rule']['auroc']:.3f}" for k, s in d["sets"].items())
                     + "; the σ estimate alone: " + ", ".join(f"{k} {s['sigma']['auroc']:.3f}"
                                                                for k, s in d["sets"].items())
                     + f"; in-distribution test crops flagged {d['in_distribution']['flagged']:.1%}.")
    return "\n".join([*lines, "", f"What {first} says of the three whole photos — {said}.", "",
                      *(f"{e}\n" for e in extra),
                      "Per test set, corrupted digits by severity, the served cost, the denoiser's noise estimate and "
                      "out-of-distribution score, and the targets: [`ood.md`](benchmarks/results/ood.md) "
                      "(`unroll bench ood`)."])


def plot(p: dict, out_dir: Path) -> Path:
    """AUROC per test set and score, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(p["models"])
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False, sharey=True)
    for ax, name in zip(axes[0], names, strict=True):
        sets = p["models"][name]["sets"]
        kinds = list(sets)
        width = 0.8 / len(SCORES)
        for j, k in enumerate(SCORES):
            ax.bar(np.arange(len(kinds)) + (j - (len(SCORES) - 1) / 2) * width, [sets[s][k]["auroc"] for s in kinds],
                   width, label=k)
        ax.set_xticks(np.arange(len(kinds)), kinds, rotation=35, ha="right", fontsize=8)
        ax.set_title(name, fontsize=10)
        ax.set_ylim(0, 1.02)
        ax.axhline(0.5, color="grey", lw=0.6, ls=":")
    axes[0][0].set_ylabel("test AUROC (higher: told apart)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / f"{STEM}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
