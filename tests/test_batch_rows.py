"""One way to run several callers' rows as a batch (:mod:`unroll.serving.batch_rows`): equal shapes run once, every
caller gets its own rows back, a failing group fails only its own members."""

from __future__ import annotations

import numpy as np
import pytest

from unroll.serving import batch_rows


def _feed(rows: int, side: int, fill: float) -> dict[str, np.ndarray]:
    return {"x": np.full((rows, side), fill, np.float32), "lam": np.full((rows,), fill, np.float32)}


def test_equal_shapes_run_once_and_each_feed_gets_its_rows_back() -> None:
    feeds = [_feed(2, 3, 1.0), _feed(1, 4, 2.0), _feed(3, 3, 3.0)]
    calls = []

    def run(feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        calls.append({k: v.shape for k, v in feed.items()})
        return [feed["x"].sum(axis=1) + feed["lam"], feed["x"][:, :1] * 10]

    out = batch_rows.run_grouped(feeds, run)
    assert calls == [{"x": (5, 3), "lam": (5,)}, {"x": (1, 4), "lam": (1,)}]  # the two 3-wide feeds joined
    for feed, got in zip(feeds, out, strict=True):
        want = run(feed)
        assert [a.shape for a in got] == [a.shape for a in want]
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_failing_group_fails_only_its_members_and_keys_can_keep_feeds_apart() -> None:
    feeds = [_feed(1, 3, 1.0), _feed(1, 5, 2.0), _feed(1, 3, 3.0)]

    def run(feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        if feed["x"].shape[1] == 5:
            raise ValueError("too wide")
        return [feed["x"] * 2]

    out = batch_rows.run_grouped(feeds, run)
    assert isinstance(out[1], ValueError) and str(out[1]) == "too wide"
    np.testing.assert_array_equal(out[2][0], feeds[2]["x"] * 2)
    seen = []
    batch_rows.run_grouped(feeds, lambda f: seen.append(len(f["x"])) or [f["x"]], keys=[0, 1, 2])
    assert seen == [1, 1, 1]  # distinct keys: each feed alone


def test_split_cuts_dicts_and_lists_alike() -> None:
    joined, sizes = batch_rows.join([_feed(2, 3, 1.0), _feed(1, 3, 2.0)])
    assert sizes == [2, 1] and joined["x"].shape == (3, 3)
    as_dicts = batch_rows.split({"y": joined["x"]}, sizes)
    as_lists = batch_rows.split([joined["x"]], sizes)
    assert [d["y"].shape for d in as_dicts] == [(2, 3), (1, 3)] == [v[0].shape for v in as_lists]
    with pytest.raises(ValueError):
        batch_rows.join([_feed(1, 3, 1.0), _feed(1, 4, 1.0)])  # unequal rows cannot join
