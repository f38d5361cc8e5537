"""Overlapping tiles: a large image through a graph in fixed-size windows, stitched back exactly.

A convolutional solver's output at a pixel depends only on its receptive radius, so a window that extends
``margin`` ≥ that radius past the part it keeps computes that part as the whole image would, and memory is bounded
by the window. The card's ``tiling`` (:class:`unroll.card.TileCard`) gives the window ``size``, ``margin``, offset
grid ``align`` and ``mean_centred``: a graph that removes its input's mean gets, in each window, a strip of filler
pixels outside every kept output's view whose value makes the window's mean the whole image's. :func:`run_tiled` is
the synchronous driver; the gateway streams :meth:`Tiler.cut` / :meth:`Tiler.paste` itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from unroll.card import TileCard


@dataclass(frozen=True)
class Span:
    """One window along one axis: it reads ``[start, stop)`` and writes its outputs ``[keep_lo, keep_hi)``."""

    start: int
    stop: int
    keep_lo: int
    keep_hi: int


def spans(length: int, size: int, margin: int, align: int = 1) -> list[Span]:
    """Windows covering ``[0, length)``: one if it fits in ``size``, else equal-length windows on the ``align``
    grid whose kept parts (``margin`` in from every side that is not an image border) tile the axis exactly."""
    if length <= size:
        return [Span(0, length, 0, length)]
    window = size - (size - length) % align  # so that the last window, ending at `length`, starts on the grid
    starts = _starts(length, window, margin, align)
    # The fewest windows `size` allows, each as small as that count permits: a 512-pixel side cut for a 448 window
    # becomes two windows of 280, not two of 448 (the graph would compute the overlap, 1.6× the pixels, twice over).
    while window - align - 2 * margin >= align:
        smaller = _starts(length, window - align, margin, align)
        if len(smaller) > len(starts):
            break
        window, starts = window - align, smaller
    out, kept = [], 0
    for s in starts:
        hi = length if s + window >= length else s + window - margin
        out.append(Span(s, s + window, kept, hi))
        kept = hi
    return out


def _starts(length: int, window: int, margin: int, align: int) -> list[int]:
    """Start of each ``window``-long span covering ``[0, length)`` with kept parts ``margin`` in from inner sides."""
    step = (window - 2 * margin) // align * align
    if step < align:
        raise ValueError(f"tile size {window} leaves no room inside two margins of {margin} (align {align})")
    return [*range(0, length - window, step), length - window]


@dataclass(frozen=True)
class Window:
    rows: Span
    cols: Span


#: One window of one item of a batch: ``(item index, window)``.
Job = tuple[int, Window]


class Tiler:
    """The windows of one ``H×W`` image for a graph with ``tiling``; ``needed`` is false when it fits in one.

    ``max_side`` caps the window (with its filler) below the graph's largest accepted side, e.g. a TensorRT
    profile's maximum H or W.
    """

    def __init__(self, height: int, width: int, tiling: TileCard, max_side: int | None = None) -> None:
        self.height, self.width, self.tiling = height, width, tiling
        align = tiling.align
        filler = -(-tiling.margin // align) * align if tiling.mean_centred else 0
        size = tiling.size if max_side is None else min(tiling.size, max_side - filler)
        self.rows = spans(height, size, tiling.margin, align)
        self.cols = spans(width, size, tiling.margin, align)
        self.needed = len(self.rows) > 1 or len(self.cols) > 1
        #: Axis (1 rows, 2 columns of [C, H, W]) that carries the filler strip: one with ≥ 2 windows, so every
        #: window has a side inside the image there.
        self.filler_axis = 0 if not (self.needed and filler) else (1 if len(self.rows) > 1 else 2)
        self.filler = filler if self.filler_axis else 0
        h, w = self.rows[0].stop - self.rows[0].start, self.cols[0].stop - self.cols[0].start
        self.window_hw = (h + self.filler, w) if self.filler_axis == 1 else (h, w + self.filler)

    def windows(self) -> list[Window]:
        return [Window(r, c) for r in self.rows for c in self.cols]

    def _filler_before(self, win: Window) -> bool:
        """Filler goes on the window's side that lies inside the image: before it unless it starts at 0."""
        span = win.rows if self.filler_axis == 1 else win.cols
        return span.start > 0

    def cut(self, x: np.ndarray, win: Window, mean: float | None = None) -> np.ndarray:
        """Window ``win`` of ``x`` ``[C, H, W]`` as ``[C, h, w]`` float32, with its filler strip when the graph is
        mean-centred (``mean``: the whole image's mean, as the graph computes it over ``[C, H, W]``)."""
        part = x[:, win.rows.start:win.rows.stop, win.cols.start:win.cols.stop]
        if not self.filler:
            return np.ascontiguousarray(part, dtype=np.float32)
        if mean is None:
            raise ValueError("a mean-centred graph's windows need the whole image's mean")
        out = np.empty((x.shape[0], *self.window_hw), np.float32)
        k, axis = self.filler, self.filler_axis
        body = [slice(None)] * 3
        strip = [slice(None)] * 3
        if self._filler_before(win):
            body[axis], strip[axis] = slice(k, None), slice(0, k)
        else:
            n = part.shape[axis]
            body[axis], strip[axis] = slice(0, n), slice(n, None)
        out[tuple(body)] = part
        n_strip = out[tuple(strip)].size
        value = (mean * out.size - float(part.sum(dtype=np.float64))) / n_strip
        out[tuple(strip)] = np.float32(value)
        return out

    def paste(self, out: np.ndarray, win: Window, y: np.ndarray) -> None:
        """Write the kept part of window output ``y`` (shaped like :meth:`cut`'s) into ``out`` ``[C, H, W]``."""
        r0, c0 = 0, 0
        if self.filler and self._filler_before(win):
            r0, c0 = (self.filler, 0) if self.filler_axis == 1 else (0, self.filler)
        r, c = win.rows, win.cols
        out[:, r.keep_lo:r.keep_hi, c.keep_lo:c.keep_hi] = y[
            :, r0 + r.keep_lo - r.start:r0 + r.keep_hi - r.start, c0 + c.keep_lo - c.start:c0 + c.keep_hi - c.start]


    # -- several windows per graph execution: (item, window) jobs over a batch [N, C, H, W]

    def jobs(self, items: int) -> list[Job]:
        """Every (item, window) of ``items`` images, item by item."""
        return [(n, w) for n in range(items) for w in self.windows()]

    def means(self, x: np.ndarray) -> list[float | None]:
        """Per item of ``x`` ``[N, C, H, W]``: the mean a mean-centred graph removes (``None`` otherwise)."""
        return [image_mean(item) if self.tiling.mean_centred else None for item in x]

    def cut_batch(self, x: np.ndarray, jobs: list[Job], means: list[float | None]) -> np.ndarray:
        """The windows of ``jobs`` stacked as one graph input ``[len(jobs), C, h, w]``."""
        return np.stack([self.cut(x[n], w, means[n]) for n, w in jobs])

    def paste_batch(self, out: np.ndarray, jobs: list[Job], y: np.ndarray) -> None:
        """The graph's outputs for ``jobs`` written into ``out`` ``[N, C, H, W]``."""
        for (n, w), yi in zip(jobs, y, strict=True):
            self.paste(out[n], w, yi)


def image_mean(x: np.ndarray) -> float:
    """The mean a mean-centred graph removes from one item ``[C, H, W]`` (accumulated in float64)."""
    return float(x.mean(dtype=np.float64))


def run_tiled(x: np.ndarray, extra: dict[str, np.ndarray], run: Callable[[np.ndarray, dict], np.ndarray],
              tiling: TileCard, batch: int = 4, max_side: int | None = None) -> np.ndarray:
    """``run`` (a graph taking ``[n, C, h, w]`` windows and per-item ``extra`` inputs such as σ, returning the same
    shape) over ``x`` ``[N, C, H, W]`` window by window, at most ``batch`` windows per call; the stitched output."""
    out = np.empty_like(x, dtype=np.float32)
    tiler = Tiler(x.shape[2], x.shape[3], tiling, max_side)
    jobs, means = tiler.jobs(len(x)), tiler.means(x)
    for i in range(0, len(jobs), batch):
        chunk = jobs[i:i + batch]
        y = run(tiler.cut_batch(x, chunk, means), {k: v[[n for n, _ in chunk]] for k, v in extra.items()})
        tiler.paste_batch(out, chunk, y)
    return out
