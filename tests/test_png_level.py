"""The PNG level the denoisers answer at is the one ``unroll bench png-level`` chose (its committed results)."""

from __future__ import annotations

import json

from unroll.benchmarks.common import RESULTS
from unroll.serving.imaging.images import PNG_LEVEL


def test_png_level_is_the_measured_choice() -> None:
    chosen = json.loads((RESULTS / "png_level.json").read_text())["chosen"]
    assert PNG_LEVEL == chosen, f"serving/imaging/images.py:PNG_LEVEL is {PNG_LEVEL}; png_level.json chose {chosen}"


def test_the_choice_follows_from_the_table() -> None:
    """The recorded choice is the least-regret row of the recorded table (the rule in benchmarks/png_level.py)."""
    from unroll.benchmarks import png_level

    payload = json.loads((RESULTS / "png_level.json").read_text())
    assert [r["level"] for r in payload["rows"]] == list(png_level.LEVELS)
    assert payload["chosen"] == min(payload["rows"], key=lambda r: r["regret"])["level"]
    assert "**(chosen)**" in png_level.markdown(payload)
