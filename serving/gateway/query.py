"""Whole-number query parameters: ASCII digits only, as written in a URL by a client that means a count.

Python's ``int()`` and pydantic's lax mode take ``"2 "``, ``"+2"``, ``"2_0"`` (20) or Arabic-Indic ``"٢"``; a count
that a cache key, a log line or another service would read differently is refused (422) instead.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator


def ascii_digits(raw: Any) -> Any:
    """``raw`` unchanged when it is a string of ASCII digits (or not a string); ``ValueError`` otherwise."""
    if isinstance(raw, str) and not (raw.isascii() and raw.isdigit()):
        raise ValueError(f"expected a whole number written with the digits 0-9 only (got {raw!r})")
    return raw


#: An ``int`` query parameter written with ASCII digits only (FastAPI answers any other form 422).
WholeNumber = Annotated[int, BeforeValidator(ascii_digits)]
