"""Several callers' rows as one batch and back: group equal per-row shapes, join them, run once, split the outputs.

The Python-backend model (the requests Triton's dynamic batcher hands it, and the pictures of its encoded-image
path) and the gateway's HTTP-tier batcher (concurrent calls) each run a group of equal shapes once and give every
member its own rows back; this module is the one place that says how. Rows are NumPy arrays, or PyTorch tensors (the
``torch`` runtime's DLPack path: joined on the device they are on, a group's host rows moved to its device).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence

import numpy as np

Feed = Mapping[str, np.ndarray]


def shape_key(feed: Feed) -> tuple:
    """What must be equal for feeds to join: each input's name, per-row shape and dtype."""
    return tuple((name, tuple(a.shape[1:]), str(a.dtype)) for name, a in sorted(feed.items()))


def join(feeds: Sequence[Feed]) -> tuple[dict[str, np.ndarray], list[int]]:
    """The feeds' rows concatenated input by input, and how many rows each feed gave."""
    sizes = [len(next(iter(f.values()))) for f in feeds]
    return {name: _concatenate([f[name] for f in feeds]) for name in feeds[0]}, sizes


def split(outputs: Mapping[str, np.ndarray] | Sequence[np.ndarray], sizes: Sequence[int]) -> list:
    """A joined run's outputs cut back into each feed's rows (``sizes`` from :func:`join`): a dict of outputs gives a
    dict per feed, a list gives a list per feed."""
    if isinstance(outputs, Mapping):
        parts = {name: _split(a, sizes) for name, a in outputs.items()}
        return [{name: p[i] for name, p in parts.items()} for i in range(len(sizes))]
    pieces = [_split(a, sizes) for a in outputs]
    return [[p[i] for p in pieces] for i in range(len(sizes))]


def _concatenate(parts: list) -> np.ndarray:
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts)
    import torch  # (tensors only come from the torch runtime's path: PyTorch is there)

    tensors = [torch.as_tensor(p) for p in parts]
    device = next((t.device for t in tensors if t.device.type != "cpu"), tensors[0].device)
    return torch.cat([t.to(device) for t in tensors])


def _split(a, sizes: Sequence[int]) -> list:
    return np.split(a, np.cumsum(sizes)[:-1]) if isinstance(a, np.ndarray) else list(a.split(list(sizes)))


def run_grouped(feeds: Sequence[Feed], run: Callable[[dict[str, np.ndarray]], Sequence[np.ndarray]],
                keys: Sequence[Hashable] | None = None) -> list[list[np.ndarray] | Exception]:
    """``run`` once per group of feeds with equal ``keys`` (default :func:`shape_key`); each feed's outputs, in
    order, or the exception its group's run raised (the other groups are unaffected)."""
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, feed in enumerate(feeds):
        groups[keys[i] if keys is not None else shape_key(feed)].append(i)
    results: list[list[np.ndarray] | Exception] = [[] for _ in feeds]
    for members in groups.values():
        try:
            if len(members) == 1:
                got = [list(run(dict(feeds[members[0]])))]
            else:
                joined, sizes = join([feeds[i] for i in members])
                got = split(list(run(joined)), sizes)
        except Exception as e:  # this group's failure is its members' answer
            got = [e] * len(members)
        for i, r in zip(members, got, strict=True):
            results[i] = r
    return results
