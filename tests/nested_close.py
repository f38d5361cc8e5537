"""Nested dicts/lists of recorded numbers compared within a tolerance (a recomputed record against a committed one)."""

from __future__ import annotations


def close(a, b, tol: float = 2e-3, rel: float = 0.0) -> bool:
    """Equal structure; numbers within ``tol`` absolute or ``rel`` relative; anything else equal."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(close(a[k], b[k], tol, rel) for k in a)
    if isinstance(a, list | tuple):
        return (isinstance(b, list | tuple) and len(a) == len(b)
                and all(close(x, y, tol, rel) for x, y in zip(a, b, strict=True)))
    if isinstance(a, int | float) and isinstance(b, int | float):
        return abs(a - b) <= max(tol, rel * max(abs(a), abs(b)))
    return a == b
