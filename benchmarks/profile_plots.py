"""PNG plots of ``unroll profile`` results (matplotlib ``Figure`` on Agg, as :mod:`.plots`: nothing global touched).

From one results JSON (:func:`write_plots`), each only where the run has its data:

- ``STEM-latency.png``: p50 / p95 / p99 against the offered rate (open-loop levels), the objective's latency limits
  and the search's highest rate met marked, levels that missed the objective crossed; beside it the answered rate
  and the goodput against the offered one.
- ``STEM-throughput.png``: answered requests/s and p50 / p95 / p99 against the concurrency (closed-loop levels).
- ``STEM-split.png``: per level, Triton's own time per request (queue, compute input / infer / output, the rest of
  its request time) stacked, and what the client measured beyond it (gateway, client, network), from the statistics
  deltas (levels profiled with ``--triton-url`` or ``--target triton``).

And for ``unroll profile compare`` (:func:`overlay_plot`): two runs' latency curves on the same axes.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from unroll.benchmarks.plots import DPI, LAYERS, _levels_axis

PCTS = (("p50_ms", "p50", "-", "o"), ("p95_ms", "p95", ":", "^"), ("p99_ms", "p99", "--", "s"))
_PACED = re.compile(r" paced at ([0-9.e+-]+) req/s")


def _save(fig: Figure, path: Path) -> Path:
    """``fig`` as PNG at ``path``, written whole (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=DPI, format="png")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _num(v: object) -> float:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else float("nan")


def open_levels(levels: Sequence[dict]) -> list[dict]:
    """The open-loop levels with an offered rate, by rate."""
    return sorted((lv for lv in levels if lv.get("mode") == "open" and lv.get("offered_rps") is not None),
                  key=lambda lv: lv["offered_rps"])


def pace(level: dict) -> float | None:
    """A closed-loop level's pacing rate (``concurrency N paced at R req/s``), ``None`` when unpaced."""
    m = _PACED.search(level.get("load") or "")
    return float(m.group(1)) if m else None


def closed_series(levels: Sequence[dict]) -> dict[str, list[dict]]:
    """The closed-loop levels by pacing (``""``: unpaced; ``"paced at R req/s"``), each by concurrency."""
    series: dict[str, list[dict]] = {}
    for lv in levels:
        if lv.get("mode") == "closed" and lv.get("concurrency"):
            p = pace(lv)
            series.setdefault("" if p is None else f"paced at {p:g} req/s", []).append(lv)
    return {k: sorted(v, key=lambda lv: lv["concurrency"]) for k, v in sorted(series.items())}


def _latency_limits(slo: str | None) -> list[tuple[str, float]]:
    from unroll.benchmarks.profile import parse_slo

    try:
        parsed = parse_slo(slo)
    except Exception:  # an objective this version cannot read: draw none rather than fail the plot
        return []
    return [(str(lim), lim.value) for lim in (parsed.limits if parsed else ()) if lim.metric != "errors"]


def _log_if_wide(ax, values: Sequence[float]) -> None:
    v = [x for x in values if x == x and x > 0]
    if v and max(v) / min(v) > 30:
        ax.set_yscale("log")


def _title(payload: dict) -> str:
    d = payload.get("deployment") or {}
    return f"{d.get('model', '?')} via {d.get('target', '?')} at {d.get('url', '?')}"


# ------------------------------------------------------------------------------------------------- one run


def latency_plot(payload: dict, path: Path) -> Path | None:
    """Open-loop levels: latency percentiles and answered rate / goodput against the offered rate (``None``: none)."""
    lv = open_levels(payload.get("levels") or [])
    if not lv:
        return None
    fig = Figure(figsize=(11, 4.2))
    a1, a2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    x = np.array([v["offered_rps"] for v in lv], dtype=float)
    for field, name, ls, marker in PCTS:
        a1.plot(x, [_num(v.get(field)) for v in lv], ls, marker=marker, label=name)
    failed = [v for v in lv if v.get("slo_met") is False]
    if failed:
        a1.plot([v["offered_rps"] for v in failed], [_num(v.get("p99_ms")) for v in failed], "x", color="tab:red",
                ms=10, mew=2, label="objective missed")
    for k, (name, value) in enumerate(_latency_limits(payload.get("slo"))):
        a1.axhline(value, color="tab:red", ls="-.", lw=1, alpha=0.6 + 0.2 * (k == 0), label=f"objective {name}")
    search = payload.get("search") or {}
    best = search.get("highest_rate_met_rps")
    for ax in (a1, a2):
        if best is not None:
            ax.axvline(best, color="tab:green", ls=":", lw=1.5,
                       label=f"highest rate met: {best:.4g} req/s" if ax is a1 else None)
    _log_if_wide(a1, [_num(v.get(f)) for v in lv for f, *_ in PCTS])
    a1.set_xlabel("offered load (req/s)")
    a1.set_ylabel("latency from scheduled send (ms)")
    a1.set_title("latency against offered load (open loop)", fontsize=9)
    a1.grid(True, which="both", alpha=0.3)
    a1.legend(fontsize=7)
    a2.plot(x, x, "k--", lw=1, alpha=0.4, label="offered")
    a2.plot(x, [_num(v.get("throughput_rps")) for v in lv], "o-", color="tab:blue", label="answered")
    if any(v.get("goodput_rps") is not None for v in lv):
        a2.plot(x, [_num(v.get("goodput_rps")) for v in lv], "s--", color="tab:green", label="goodput (met objective)")
    a2.set_xlabel("offered load (req/s)")
    a2.set_ylabel("requests / s")
    a2.set_title("answered rate against offered load", fontsize=9)
    a2.set_xlim(left=0)
    a2.set_ylim(bottom=0)
    a2.grid(True, alpha=0.3)
    a2.legend(fontsize=7)
    arrivals = sorted({v.get("arrivals") for v in lv if v.get("arrivals")})
    fig.suptitle(f"{_title(payload)}: {', '.join(arrivals)} arrivals", fontsize=10)
    return _save(fig, path)


def throughput_plot(payload: dict, path: Path) -> Path | None:
    """Closed-loop levels: answered rate and latency percentiles against the concurrency (``None``: none)."""
    series = closed_series(payload.get("levels") or [])
    if not series:
        return None
    fig = Figure(figsize=(11, 4.2))
    a1, a2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    conc: list[int] = []
    for k, (name, lv) in enumerate(series.items()):
        c = [v["concurrency"] for v in lv]
        conc += c
        color = f"C{k}"
        a1.plot(c, [_num(v.get("throughput_rps")) for v in lv], "o-", color=color, label=name or "unpaced")
        for field, pname, ls, marker in PCTS:
            a2.plot(c, [_num(v.get(field)) for v in lv], ls, marker=marker, color=color,
                    label=f"{pname}" + (f", {name}" if name else ""))
    _levels_axis(a1, conc)
    _levels_axis(a2, conc)
    _log_if_wide(a2, [_num(v.get(f)) for lv in series.values() for v in lv for f, *_ in PCTS])
    a1.set_ylim(bottom=0)
    a1.set_ylabel("answered requests / s")
    a1.set_title("throughput against concurrency (closed loop)", fontsize=9)
    a2.set_ylabel("latency (ms)")
    a2.set_title("latency against concurrency", fontsize=9)
    for ax in (a1, a2):
        ax.set_xlabel("requests in flight")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(_title(payload), fontsize=10)
    return _save(fig, path)


def _short(level: dict) -> str:
    if level.get("mode") == "open":
        return "trace" if level.get("arrivals") == "trace" else f"{level['offered_rps']:.4g}/s"
    p = pace(level)
    return f"c={level.get('concurrency')}" + (f"\n@{p:g}/s" if p else "")


def split_plot(payload: dict, path: Path) -> Path | None:
    """Triton's statistics deltas per level, stacked, and the client's mean beyond them (``None``: no level has
    them)."""
    levels = payload.get("levels") or []
    with_stats = [v for v in open_levels(levels) if v.get("triton")]
    with_stats += [v for s in closed_series(levels).values() for v in s if v.get("triton")]
    with_stats += [v for v in levels if v.get("triton") and v not in with_stats]  # trace levels without a rate
    if not with_stats:
        return None
    fig = Figure(figsize=(max(6.0, 0.75 * len(with_stats) + 3), 4.4))
    ax = fig.add_subplot(1, 1, 1)
    x = np.arange(len(with_stats))
    bottom = np.zeros(len(with_stats))
    for field, name, color in LAYERS:
        v = np.array([_num(s["triton"].get(field)) for s in with_stats])
        v = np.nan_to_num(v)
        ax.bar(x, v, bottom=bottom, color=color, label=name)
        bottom += v
    client = np.array([_num(s.get("mean_ms")) for s in with_stats])
    beyond = np.clip(np.nan_to_num(client) - bottom, 0, None)
    via_gateway = (payload.get("deployment") or {}).get("target") in ("v1", "v2")
    ax.bar(x, beyond, bottom=bottom, color="tab:red" if via_gateway else "tab:pink", alpha=0.8,
           label="gateway + client + network" if via_gateway else "client + network")
    ax.plot(x, client, "k_", ms=18, mew=2, label="client mean")
    for xi, s, top in zip(x, with_stats, np.maximum(bottom + beyond, np.nan_to_num(client)), strict=True):
        b = s["triton"].get("avg_batch")
        if b:
            ax.annotate(f"batch {b:.2g}", (xi, top), ha="center", va="bottom", fontsize=6, xytext=(0, 2),
                        textcoords="offset points")
    ax.set_xticks(x, [_short(s) for s in with_stats], fontsize=7)
    ax.set_xlabel("level (offered rate, or c = requests in flight)")
    ax.set_ylabel("mean time per request (ms)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=6, loc="upper left")
    ax.margins(y=0.12)
    fig.suptitle(f"Where the time goes ({_title(payload)}): Triton's statistics per level, the client's mean beyond",
                 fontsize=9)
    return _save(fig, path)


def write_plots(payload: dict, out_dir: Path, stem: str) -> list[Path]:
    """``out_dir/STEM-latency.png``, ``-throughput.png`` and ``-split.png``, each only where the run has its data;
    returns those written."""
    plots = ((latency_plot, "latency"), (throughput_plot, "throughput"), (split_plot, "split"))
    return [p for fn, name in plots if (p := fn(payload, out_dir / f"{stem}-{name}.png")) is not None]


# ------------------------------------------------------------------------------------------------- compare


def overlay_plot(payloads: Sequence[dict], names: Sequence[str], path: Path) -> Path | None:
    """The runs' latency curves on the same axes: p50 (solid) and p99 (dashed) against the offered rate for
    open-loop levels, against the concurrency for closed-loop ones (a panel each, where any run has them);
    ``None`` when no run has a level to draw."""
    opens = [open_levels(p.get("levels") or []) for p in payloads]
    closed = [closed_series(p.get("levels") or []) for p in payloads]
    panels = [k for k, has in (("open", any(opens)), ("closed", any(closed))) if has]
    if not panels:
        return None
    fig = Figure(figsize=(5.6 * len(panels), 4.2))
    values: dict[str, list[float]] = {k: [] for k in panels}
    for i, kind in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        conc: list[int] = []
        for k, name in enumerate(names):
            color = f"C{k}"
            if kind == "open":
                curves = {"": opens[k]} if opens[k] else {}
            else:
                curves = closed[k]
            for suffix, lv in curves.items():
                x = [v["offered_rps"] if kind == "open" else v["concurrency"] for v in lv]
                if kind == "closed":
                    conc += x
                for field, pname, ls, marker in (PCTS[0], PCTS[2]):
                    y = [_num(v.get(field)) for v in lv]
                    values[kind] += y
                    ax.plot(x, y, ls, marker=marker, color=color, ms=4,
                            label=f"{name} {pname}" + (f" ({suffix})" if suffix else ""))
            best = (payloads[k].get("search") or {}).get("highest_rate_met_rps")
            if kind == "open" and best is not None:
                ax.axvline(best, color=color, ls=":", lw=1.2, label=f"{name}: highest rate met {best:.4g}/s")
        if kind == "closed":
            _levels_axis(ax, conc)
            ax.set_xlabel("requests in flight")
            ax.set_title("closed loop: latency against concurrency", fontsize=9)
        else:
            ax.set_xlabel("offered load (req/s)")
            ax.set_title("open loop: latency against offered load", fontsize=9)
        _log_if_wide(ax, values[kind])
        ax.set_ylabel("latency (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle("unroll profile compare: " + " vs ".join(names) + " (p50 solid, p99 dashed)", fontsize=10)
    return _save(fig, path)
