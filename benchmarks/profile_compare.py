"""``unroll profile compare A.json B.json``: two ``unroll profile`` results side by side, level by level.

Levels are matched by what was offered: an open-loop level by its offered rate (to 4 significant digits), a trace
level with a trace level, a closed-loop level by its concurrency (and pacing rate); a level one run has and the
other lacks keeps its row, with a dash on the other side. Per matched level: p50 / p95 / p99, the answered rate,
the error rate and the attainment of each run's own objective, as ``A → B (change)``; above the levels, each run's
deployment, objective and the search's capacity (highest rate met, first failed and why).

Repeated runs: a level that holds ``runs`` (a list of rows of the same fields, one per repetition; the level's own
fields their aggregate) gets a 95 % confidence interval of the mean (Student's t) for p99 and the answered rate, in
columns shown only when some level has at least two runs (``unroll profile --runs N``); without them the comparison
says so instead of showing intervals it does not have.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unroll.benchmarks.profile import SCHEMA_VERSION, mean_interval
from unroll.benchmarks.profile_plots import pace
from unroll.errors import BenchError

KIND = "unroll-profile"
#: (field, header, kind): ``ms`` and ``rps`` cells show the relative change, ``share`` cells the change in points.
METRICS = (("p50_ms", "p50 ms", "ms"), ("p95_ms", "p95 ms", "ms"), ("p99_ms", "p99 ms", "ms"),
           ("throughput_rps", "answered/s", "rps"), ("error_rate", "errors", "share"),
           ("attainment", "attainment", "share"))
CI_METRICS = (("p99_ms", "p99 ms 95% CI"), ("throughput_rps", "answered/s 95% CI"))
NO_RUNS_NOTE = ("Each level was measured once in both runs: no confidence intervals (they need repeated runs of "
                "each level). Differences of a few percent between two single runs can be noise.")


def read_result(path: Path) -> dict[str, Any]:
    """The results JSON at ``path``, checked to be an ``unroll profile`` result of :data:`SCHEMA_VERSION`; anything
    else is one :class:`~unroll.errors.BenchError` line that says what is wrong with which file."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise BenchError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise BenchError(f"{path} is a folder: give the results JSON (MODEL-profile.json) inside it") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BenchError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        payload = json.loads(text)
    except ValueError as e:
        raise BenchError(f"{path} is not JSON ({e}): give the MODEL-profile.json `unroll profile` wrote") from None
    if not isinstance(payload, dict) or payload.get("kind") != KIND:
        raise BenchError(f"{path} is not an `unroll profile` result (no \"kind\": \"{KIND}\")")
    version = payload.get("schema_version")
    if version != SCHEMA_VERSION:
        raise BenchError(f"{path} has schema_version {version!r}; this unroll reads schema_version {SCHEMA_VERSION} "
                         "(profile again with this version, or compare with the version that wrote it)")
    if not isinstance(payload.get("levels"), list) or not all(isinstance(lv, dict) for lv in payload["levels"]):
        raise BenchError(f"{path}: an `unroll profile` result without its list of levels")
    return payload


def level_key(level: dict) -> tuple:
    """What a level offered: ``("open", rate)``, ``("trace",)`` or ``("closed", pacing rate or 0, concurrency)``."""
    if level.get("mode") == "open":
        if level.get("arrivals") == "trace":
            return ("trace",)
        return ("open", float(f"{float(level['offered_rps']):.4g}"))
    return ("closed", pace(level) or 0.0, int(level.get("concurrency") or 0))


def _sort_key(key: tuple) -> tuple:
    return ({"open": 0, "trace": 1, "closed": 2}[key[0]], *key[1:])


@dataclass
class Row:
    """One matched level: its name and each run's level (``None`` where that run lacks it)."""

    key: tuple
    level: str
    sides: list[dict | None]


@dataclass
class Comparison:
    """Two results, their names (``A``, ``B``), paths and matched levels."""

    paths: list[Path]
    payloads: list[dict]
    rows: list[Row]
    names: list[str] = field(default_factory=lambda: ["A", "B"])

    @property
    def has_runs(self) -> bool:
        return any(len(s.get("runs") or []) >= 2 for r in self.rows for s in r.sides if s)


def compare(paths: list[Path]) -> Comparison:
    """Read both results and match their levels (see the module's text)."""
    payloads = [read_result(p) for p in paths]
    keyed: dict[tuple, list[dict | None]] = {}
    labels: dict[tuple, str] = {}
    for i, payload in enumerate(payloads):
        seen: dict[tuple, int] = {}
        for lv in payload["levels"]:
            base = level_key(lv)
            n = seen[base] = seen.get(base, -1) + 1  # a level offered twice in one run: the k-th meets the k-th
            key = (*base, n)
            keyed.setdefault(key, [None] * len(payloads))[i] = lv
            labels.setdefault(key, _label(base, lv) + (f" (#{n + 1})" if n else ""))
    rows = [Row(k, labels[k], keyed[k]) for k in sorted(keyed, key=lambda k: _sort_key(k[:-1]) + (k[-1],))]
    for r in rows:  # where the runs' arrivals differ at the same rate, say so in the level's name
        arr = [s.get("arrivals") for s in r.sides if s]
        if r.key[0] == "open" and len(set(arr)) > 1:
            r.level = f"{r.key[1]:g} req/s ({' | '.join(map(str, arr))})"
    return Comparison(list(paths), payloads, rows)


def short_label(key: tuple) -> str:
    """A level's name in a few characters (the console's table): ``40/s``, ``trace``, ``c=4``, ``c=4 @50/s``."""
    base = key[:-1]
    n = f" #{key[-1] + 1}" if key[-1] else ""
    if base[0] == "open":
        return f"{base[1]:g}/s{n}"
    if base[0] == "trace":
        return f"trace{n}"
    return f"c={base[2]}" + (f" @{base[1]:g}/s" if base[1] else "") + n


def _label(key: tuple, level: dict) -> str:
    if key[0] == "open":
        return f"{key[1]:g} req/s {level.get('arrivals', '')}".strip()
    if key[0] == "trace":
        return "trace"
    return f"concurrency {key[2]}" + (f" paced at {key[1]:g} req/s" if key[1] else "")


# --------------------------------------------------------------------------------------------------- cells


def _val(level: dict | None, name: str) -> float | None:
    v = None if level is None else level.get(name)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None


def fmt(v: float | None, kind: str) -> str:
    """One value as the tables show it: ms and req/s to 3–4 significant digits, shares as percentages."""
    if v is None:
        return "-"
    if kind == "share":
        return f"{100 * v:.2f}%"
    return f"{v:.1f}" if abs(v) >= 100 else f"{v:.3g}" if abs(v) >= 1 else f"{v:.3f}"


def change(a: float | None, b: float | None, kind: str) -> str:
    """B against A: a relative change for ms and req/s (``+12%``), a change in points for shares (``+1.5 pt``)."""
    if a is None or b is None:
        return ""
    if kind == "share":
        return f"{100 * (b - a):+.1f} pt"
    if a == 0:
        return ""
    return f"{100 * (b - a) / a:+.0f}%"


def cell(row: Row, name: str, kind: str) -> str:
    """``A → B (change)`` for one metric of one matched level."""
    a, b = (_val(s, name) for s in row.sides)
    c = change(a, b, kind)
    return f"{fmt(a, kind)} → {fmt(b, kind)}" + (f" ({c})" if c else "")


def confidence_interval(level: dict | None, name: str, level_pct: float = 95.0) -> tuple[float, float] | None:
    """The mean of ``name`` over the level's repeated ``runs`` and the half-width of its confidence interval
    (Student's t); ``None`` with fewer than two runs holding it."""
    if level is None:
        return None
    return mean_interval([v for r in level.get("runs") or [] if (v := _val(r, name)) is not None], level_pct)


def _ci_text(level: dict | None, name: str) -> str:
    ci = confidence_interval(level, name)
    return "-" if ci is None or level is None else f"{fmt(ci[0], 'ms')} ± {fmt(ci[1], 'ms')} (n={len(level['runs'])})"


def ci_cell(row: Row, name: str) -> str:
    """Each run's mean ± half-width (and the number of runs) of ``name``, ``A | B``."""
    return " | ".join(_ci_text(s, name) for s in row.sides)


def headers(cmp: Comparison) -> list[str]:
    cols = ["level", *(h for _, h, _ in METRICS)]
    return cols + [h for _, h in CI_METRICS] if cmp.has_runs else cols


def cells(cmp: Comparison) -> list[list[str]]:
    """The levels table's rows, as text (the console and the Markdown show the same)."""
    out = []
    for r in cmp.rows:
        row = [r.level, *(cell(r, name, kind) for name, _, kind in METRICS)]
        if cmp.has_runs:
            row += [ci_cell(r, name) for name, _ in CI_METRICS]
        out.append(row)
    return out


def capacity(payload: dict) -> str:
    """The search's answer in words (``no search`` where the run did not search)."""
    s = payload.get("search")
    if not s:
        return "no search"
    best = s.get("highest_rate_met_rps")
    if best is None:
        return "no rate met the objective"
    if s.get("reached_max_rate"):
        return f"≥ {best:.4g} req/s (every level met, up to --max-rate)"
    failed, why = s.get("first_failed_rps"), "; ".join(s.get("first_failed_why") or [])
    return f"{best:.4g} req/s" + (f" (first failed: {failed:.4g} req/s: {why})" if failed is not None else "")


def run_rows(cmp: Comparison) -> list[tuple[str, list[str]]]:
    """Per run: where it ran and what it found (one line of each a field)."""

    def one(payload: dict, path: Path) -> dict[str, str]:
        d, m, st = payload.get("deployment") or {}, payload.get("machine") or {}, payload.get("settings") or {}
        arrivals = str(st.get("arrivals", "-")) + (f" (cv {st['cv']:g})" if st.get("cv") else "")
        per_level = (f"{st['requests']} requests" if st.get("requests") else f"{st.get('duration_s', '?')} s") \
            + f" after {st.get('warmup_s', '?')} s warm-up"
        return {"file": str(path), "model": str(d.get("model")), "target": f"{d.get('target')} at {d.get('url')}",
                "inputs": str(d.get("inputs") or "-"), "open-loop arrivals": arrivals, "per level": per_level,
                "date (UTC)": str(m.get("date_utc", "-")),
                "machine": f"{m.get('cpu', '?')}, {m.get('logical_cores', '?')} cores",
                "objective": payload.get("slo") or "none", "capacity": capacity(payload)}

    sides = [one(p, path) for p, path in zip(cmp.payloads, cmp.paths, strict=True)]
    return [(k, [s[k] for s in sides]) for k in sides[0]]


def notes(cmp: Comparison) -> list[str]:
    out = [] if cmp.has_runs else [NO_RUNS_NOTE]
    slos = [p.get("slo") for p in cmp.payloads]
    if slos[0] != slos[1]:
        out.append(f"The objectives differ ({slos[0] or 'none'} | {slos[1] or 'none'}): each run's attainment is "
                   "against its own.")
    one_sided = [r.level for r in cmp.rows if None in r.sides]
    if one_sided:
        out.append(f"{len(one_sided)} level(s) measured in one run only (a dash on the other side).")
    return out


# --------------------------------------------------------------------------------------------------- output


def table(cmp: Comparison):
    """The comparison as rich tables: the runs, then the levels."""
    from rich import box
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    runs = Table(title="unroll profile compare", title_justify="left")
    runs.add_column("")
    for name in cmp.names:
        runs.add_column(name, overflow="fold")
    for k, vals in run_rows(cmp):
        runs.add_row(k, *map(escape, vals))
    levels = Table(title="per level (ms, req/s; Δ: B against A)", title_justify="left", box=box.SIMPLE_HEAD,
                   pad_edge=False)
    levels.add_column("level")
    levels.add_column("")
    for _, h, _ in METRICS:
        levels.add_column(h.removesuffix(" ms"), justify="right")
    for h in (h for _, h in CI_METRICS if cmp.has_runs):
        levels.add_column(h, justify="right")
    for r in cmp.rows:  # a line per run and one for the change, so that the numbers fit a terminal's width
        for k, (name, side) in enumerate(zip(cmp.names, r.sides, strict=True)):
            ci = [_ci_text(side, f) for f, _ in CI_METRICS] if cmp.has_runs else []
            levels.add_row(escape(short_label(r.key)) if k == 0 else "", name,
                           *(fmt(_val(side, f), kind) for f, _, kind in METRICS), *ci)
        levels.add_row("", "[dim]Δ[/]", *(f"[dim]{change(*(_val(s, f) for s in r.sides), kind)}[/]"
                                         for f, _, kind in METRICS), *([""] * len(CI_METRICS) * cmp.has_runs),
                       end_section=True)
    return Group(runs, levels, *(f"[dim]note:[/] {escape(n)}" for n in notes(cmp)))


def _md_row(values: list[str]) -> str:
    return "| " + " | ".join(v.replace("|", "\\|") for v in values) + " |"


def markdown(cmp: Comparison, plot: str | None = None) -> str:
    """The comparison as a Markdown page (the runs, the levels, the notes, the overlay plot)."""
    lines = ["# unroll profile compare", "", _md_row(["", *cmp.names]), _md_row(["---"] * (1 + len(cmp.names)))]
    lines += [_md_row([k, *vals]) for k, vals in run_rows(cmp)]
    lines += ["", "## Per level: A → B (change)", "", _md_row(headers(cmp)),
              _md_row(["---"] + ["--:"] * (len(headers(cmp)) - 1))]
    lines += [_md_row(row) for row in cells(cmp)]
    lines += [""] + [f"Note: {n}" for n in notes(cmp)]
    if plot:
        lines += ["", f"![latency curves, A and B]({plot})"]
    return "\n".join(lines).rstrip() + "\n"


def write(cmp: Comparison, out_dir: Path) -> list[Path]:
    """``out_dir/profile-compare.md`` and ``profile-compare-latency.png`` (where a level can be drawn)."""
    from unroll.benchmarks.profile_plots import overlay_plot

    out_dir.mkdir(parents=True, exist_ok=True)
    png = overlay_plot(cmp.payloads, cmp.names, out_dir / "profile-compare-latency.png")
    md = out_dir / "profile-compare.md"
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{md.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(markdown(cmp, png.name if png else None))
    os.replace(tmp, md)
    return [md] + ([png] if png else [])
