"""Which NMF bases policy Hamburger serves with: the spread of the official random draws, and each candidate's distance.

The official ``NMF2D`` (``RAND_INIT=True``) starts its multiplicative updates from fresh random bases per sample at
every call, so its output is a random variable; what a user of the official model gets "on average" is the draws'
mean. A deterministic serving policy (``unroll/solvers/nmf.py``) is judged by its distance to that mean, next to
the distance of one official draw to it (the baseline: the official model itself is that far off on any one call).

On the golden fixture's input (the recipe in ``tests/fixtures/ham_nmf_golden.npz``'s meta, regenerated here and
checked equal by a test), in eval mode (the official 7 steps), all distances relative L2 per sample over the draws'
mean's norm:

(a) between two official draws (every pair): mean and max;
(b) from each deterministic candidate to the draws' mean: ``seeded`` (the seeded constant buffer), ``per-sample``
    (a seeded draw per batch position), and the official ``RAND_INIT=False`` warm start (bases moved by the
    official online update over calibration inputs: independent inputs of the same recipe, and, as an in-sample
    bound no server could use, the evaluated input itself);
(c) from one official draw to the mean of the other draws (leave-one-out, so a draw is not compared with itself).

The serving default is the exportable, out-of-sample candidate nearest the mean (``nmf.DEFAULT_BASES``; a test
keeps the two equal). ``unroll bench ham-draws`` writes ``ham_draws.{json,md}``.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from unroll.benchmarks.common import RESULTS, machine_info, write_docs_blocks, write_results
from unroll.solvers.nmf import ETA, NMFHam, draw_bases

#: The golden fixture's recipe (tests/fixtures/ham_nmf_golden.npz, meta ``x_recipe``): seed, shape, latent rank.
GOLDEN_SEED = 1234
GOLDEN_SHAPE = (2, 512, 16, 16)
GOLDEN_LATENT_RANK = 16
#: NMF rank of the official defaults (``MD_R``).
RANK = 64
#: Seeds of the deterministic candidates, apart from the official draws' generator seed.
SEEDED_SEED, PER_SAMPLE_SEED = 0, 1
#: Calibration inputs of the warm start: the recipe at seeds ``GOLDEN_SEED + 1000 + i``, one official call each.
CALIBRATION_OFFSET = 1000


def golden_input(seed: int = GOLDEN_SEED, shape: tuple[int, int, int, int] = GOLDEN_SHAPE,
                 latent_rank: int = GOLDEN_LATENT_RANK) -> torch.Tensor:
    """The fixture's input recipe: non-negative low rank plus noise, ``[B, C, H, W]`` (global RNG seeded, then
    restored, exactly as the fixture was made)."""
    b, c, h, w = shape
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        x = torch.relu(torch.randn(b, c, latent_rank) @ torch.randn(b, latent_rank, h * w) / 4
                       + 0.5 * torch.randn(b, c, h * w))
    return x.reshape(b, c, h, w)


def _rel(a: torch.Tensor, ref_norm: torch.Tensor) -> torch.Tensor:
    """Per-sample ‖a‖ / ‖ref‖ (``a`` a difference ``[B, ...]``, ``ref_norm`` ``[B]``)."""
    return a.flatten(1).norm(dim=1) / ref_norm


def _stats(v: torch.Tensor) -> dict[str, list[float]]:
    """Mean and max over the first axis, per sample."""
    return {"mean": [float(t) for t in v.mean(0)], "max": [float(t) for t in v.max(0).values]}


def run(n_draws: int = 32, seed: int = 100, calibration_inputs: int = 8, out_dir: Path | None = RESULTS) -> dict:
    """Measure (a), (b), (c) of the module docstring over ``n_draws`` official draws from a generator seeded with
    ``seed``; choose the default; write ``ham_draws.{json,md}`` in ``out_dir`` unless it is ``None``."""
    if n_draws < 3:
        raise ValueError("n_draws: at least 3 (pairs and a leave-one-out mean need them)")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one summation order, so the numbers repeat from machine to machine
    try:
        payload = _measure(n_draws, seed, calibration_inputs)
    finally:
        torch.set_num_threads(threads)
    if out_dir is not None:
        write_results("ham_draws", payload, markdown(payload), Path(out_dir))
        if Path(out_dir).resolve() == RESULTS.resolve():
            write_docs_blocks(RESULTS.parent.parent, README_BEGIN, README_END, readme_block(payload))
    return payload


def _measure(n_draws: int, seed: int, calibration_inputs: int) -> dict:
    x = golden_input()
    b, d = x.shape[:2]
    ham = NMFHam(d, rank=RANK, seed=SEEDED_SEED).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        draws = torch.stack([ham(x, bases=draw_bases(b, d, RANK, gen)) for _ in range(n_draws)]).double()
    mean = draws.mean(0)
    ref = mean.flatten(1).norm(dim=1)
    pairs = torch.stack([_rel(draws[i] - draws[j], ref) for i, j in itertools.combinations(range(n_draws), 2)])
    total = draws.sum(0)
    single = torch.stack([_rel(draws[k] - (total - draws[k]) / (n_draws - 1), ref) for k in range(n_draws)])
    baseline = [float(t) for t in single.mean(0)]

    warm_recipe = NMFHam(d, rank=RANK, seed=SEEDED_SEED).eval()
    warm_recipe.warm_up([golden_input(GOLDEN_SEED + CALIBRATION_OFFSET + i) for i in range(calibration_inputs)])
    warm_self = NMFHam(d, rank=RANK, seed=SEEDED_SEED).eval()
    warm_self.warm_up([x] * calibration_inputs)
    candidates = [
        ("seeded", "seeded constant buffer [D, R] (seed 0), shared by every sample", ham, True, False),
        ("per-sample", "seeded draw per batch position (seed 1); depends on the sample's place in the batch",
         NMFHam(d, rank=RANK, bases="per-sample", seed=PER_SAMPLE_SEED).eval(), False, False),
        ("warm (recipe inputs)", f"official RAND_INIT=False online update (η = {ETA}) over {calibration_inputs} "
         "independent inputs of the recipe, then frozen", warm_recipe, True, False),
        ("warm (the input itself)", f"the same over {calibration_inputs} calls on the evaluated input: an in-sample "
         "bound, not servable", warm_self, True, True),
    ]
    rows = []
    with torch.no_grad():
        for name, what, module, exportable, in_sample in candidates:
            dist = _rel(module(x).double() - mean, ref)
            rows.append({"candidate": name, "what": what, "exportable": exportable, "in_sample": in_sample,
                         "rel_to_official_mean": [float(t) for t in dist],
                         "ratio_to_single_draw": [float(t) / base for t, base in zip(dist, baseline, strict=True)]})
    eligible = [r for r in rows if r["exportable"] and not r["in_sample"]]
    best = min(eligible, key=lambda r: max(r["rel_to_official_mean"]))
    return {
        "benchmark": "ham_draws", "machine": machine_info(torch.get_num_threads()),
        "input": {"recipe_seed": GOLDEN_SEED, "shape": list(x.shape), "latent_rank": GOLDEN_LATENT_RANK},
        "nmf": {"rank": RANK, "eval_steps": ham.eval_steps, "mode": "eval"},
        "n_draws": n_draws, "draw_seed": seed, "calibration_inputs": calibration_inputs,
        "metric": "relative L2 per sample: ‖a − b‖ / ‖mean of the official draws‖",
        "draw_pairs": _stats(pairs), "single_draw_to_mean": _stats(single), "candidates": rows,
        "rule": "exportable, out-of-sample candidate with the least (worst-sample) distance to the official mean",
        "chosen": best["candidate"],
        "chosen_within_single_draw_spread": max(best["ratio_to_single_draw"]) <= max(
            float(m) / base for m, base in zip(single.max(0).values, baseline, strict=True)),
    }


def _pct(v: list[float]) -> str:
    return " / ".join(f"{100 * t:.1f}%" for t in v)


def _table(p: dict) -> list[str]:
    lines = [
        "| what | distance (per sample) |", "|---|---|",
        f"| (a) two official draws, mean over pairs | {_pct(p['draw_pairs']['mean'])} |",
        f"| (a) two official draws, max over pairs | {_pct(p['draw_pairs']['max'])} |",
        f"| (c) one official draw → mean of the others, mean | {_pct(p['single_draw_to_mean']['mean'])} |",
        f"| (c) one official draw → mean of the others, max | {_pct(p['single_draw_to_mean']['max'])} |",
    ]
    for r in p["candidates"]:
        tag = " (exportable)" if r["exportable"] else " (not exportable)"
        tag += " (in-sample)" if r["in_sample"] else ""
        lines.append(f"| (b) {r['candidate']}{tag} → official mean | {_pct(r['rel_to_official_mean'])} "
                     f"(× {' / '.join(f'{t:.2f}' for t in r['ratio_to_single_draw'])} of (c)) |")
    return lines


def markdown(p: dict) -> str:
    """A short table: the spread, each candidate's distance, and the chosen default with the reason."""
    b = len(p["draw_pairs"]["mean"])
    lines = [
        f"# Hamburger NMF: official random bases vs deterministic serving ({p['machine']['cpu']})", "",
        f"Golden fixture input {p['input']['shape']} (recipe seed {p['input']['recipe_seed']}), NMF rank "
        f"{p['nmf']['rank']}, {p['nmf']['eval_steps']} eval steps; {p['n_draws']} official draws (generator seed "
        f"{p['draw_seed']}). Distances: {p['metric']}; one value per sample ({b} samples).", "",
        *_table(p),
    ]
    within = "within" if p["chosen_within_single_draw_spread"] else "outside"
    lines += ["", f"Chosen serving default: **{p['chosen']}** — {p['rule']}; it is {within} the spread of a single "
              "official draw (the (c) max), i.e. no further from what the official model returns on average than "
              "the official model itself is on any one call. Candidates: "
              + "; ".join(f"{r['candidate']}: {r['what']}" for r in p["candidates"]) + "."]
    return "\n".join(lines) + "\n"


#: The README's draw-spread table sits between these markers; :func:`run` rewrites it from ham_draws.json.
README_BEGIN = "<!-- ham-draws: generated from benchmarks/results/ham_draws.json -->"
README_END = "<!-- /ham-draws -->"


def readme_block(p: dict) -> str:
    """The README's draw-spread table and the default it picked (numbers from the results, never typed by hand)."""
    return "\n".join([*_table(p), "", f"Served: **{p['chosen']}** ({p['n_draws']} official draws on the golden input "
                      f"{p['input']['shape']}; [`ham_draws.md`](benchmarks/results/ham_draws.md), "
                      "`unroll bench ham-draws`)."])
