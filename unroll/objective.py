"""A latency objective as text, ``"p99<=20ms,errors<=1%"``: one grammar for ``unroll profile --slo`` (which measures a
deployment against it) and ``unroll serve --slo`` (which holds a deadline with fewer solver iterations).

Limits are joined by commas: ``p50``/``p90``/``p95``/``p99``/``max``/``mean`` latency (``20ms``, ``0.5s``,
``800us``; ms without a unit) and ``errors`` (``1%`` or ``0.01``), each with ``<=`` or ``<``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from unroll.errors import UsageError

PERCENTILES = {"p50": 50.0, "p90": 90.0, "p95": 95.0, "p99": 99.0, "max": 100.0}
_UNITS = {"us": 1e-3, "µs": 1e-3, "ms": 1.0, "s": 1e3}
_LIMIT = re.compile(r"^\s*(p50|p90|p95|p99|max|mean|errors?)\s*(<=|<)\s*([0-9.]+(?:e-?[0-9]+)?)\s*(us|µs|ms|s|%)?\s*$")


@dataclass(frozen=True)
class Bound:
    """One limit of an objective: a latency statistic in ms, or the error rate as a fraction."""

    metric: str  #: ``p50`` … ``max``, ``mean``, or ``errors``
    value: float  #: ms for latencies, a fraction for ``errors``
    strict: bool = False  #: ``<`` rather than ``<=``

    def __str__(self) -> str:
        op = "<" if self.strict else "<="
        return f"errors{op}{100 * self.value:g}%" if self.metric == "errors" else f"{self.metric}{op}{self.value:g}ms"


def parse_bounds(text: str, what: str = "--slo") -> tuple[Bound, ...]:
    """``"p99<=20ms, p50<5ms,errors<=1%"`` → its bounds; an unreadable part is a :class:`UsageError` naming
    ``what`` (the option or setting it came from)."""
    out = []
    for part in text.split(","):
        m = _LIMIT.match(part)
        if m is None:
            raise UsageError(f"{what}: cannot read {part.strip()!r}: write e.g. p99<=20ms, p50<5ms or errors<=1%")
        metric, op, number, unit = m.groups()
        try:
            value = float(number)
        except ValueError:
            raise UsageError(f"{what}: {part.strip()!r}: {number!r} is not a number") from None
        if metric.startswith("error"):
            metric = "errors"
            if unit not in (None, "%"):
                raise UsageError(f"{what}: {part.strip()!r}: an error rate is a percentage (1%) or a fraction (0.01)")
            value = value / 100 if unit == "%" else value
        else:
            if unit == "%":
                raise UsageError(f"{what}: {part.strip()!r}: a latency needs a time unit (ms, s, us)")
            value *= _UNITS[unit or "ms"]
        out.append(Bound(metric, value, op == "<"))
    return tuple(out)


def good_ms(bounds: tuple[Bound, ...]) -> float | None:
    """The latency a request must meet to count as good: the bound on the highest percentile limited (``None``:
    the objective limits no percentile)."""
    lat = [b for b in bounds if b.metric in PERCENTILES]
    return max(lat, key=lambda b: PERCENTILES[b.metric]).value if lat else None
