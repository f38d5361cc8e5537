"""The robustness benchmark's corruptions: shapes, ranges, determinism, and harm that grows with severity."""

from __future__ import annotations

import numpy as np
import pytest

from unroll import data
from unroll.corruptions import CORRUPTIONS, SEVERITIES, corrupt


@pytest.fixture(scope="module")
def digits() -> np.ndarray:
    x, _ = data.dataset("mnist-validation").load()
    return np.asarray(x[:16], np.float32)


@pytest.fixture(scope="module")
def photos() -> np.ndarray:
    x, _ = data.dataset("photos").load()
    return np.asarray(x[:2, :, :64, :64], np.float32)


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_each_corruption_is_deterministic_bounded_and_worse_with_severity(name: str, digits: np.ndarray) -> None:
    dist = []
    for s in SEVERITIES:
        out = corrupt(digits, name, s, seed=3)
        assert out.shape == digits.shape and out.dtype == np.float32
        assert 0.0 <= out.min() and out.max() <= 1.0 and np.isfinite(out).all()
        assert np.array_equal(out, corrupt(digits, name, s, seed=3))  # same seed, same images
        dist.append(float(np.sqrt(((out - digits) ** 2).mean())))
    assert dist[0] > 0.0, f"{name} at severity 1 changed nothing"
    assert dist[0] < dist[1] < dist[2], (name, dist)  # each step harms more (RMS distance from the clean digit)


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_colour_images_keep_their_channels(name: str, photos: np.ndarray) -> None:
    out = corrupt(photos, name, 2)
    assert out.shape == photos.shape and 0.0 <= out.min() and out.max() <= 1.0


def test_images_get_their_own_draws_and_seeds_differ(digits: np.ndarray) -> None:
    same = np.repeat(digits[:1], 2, axis=0)
    out = corrupt(same, "gaussian_noise", 2)
    assert not np.array_equal(out[0], out[1])
    assert not np.array_equal(corrupt(digits, "occlusion", 3, seed=0), corrupt(digits, "occlusion", 3, seed=1))


def test_bad_arguments_are_named(digits: np.ndarray) -> None:
    with pytest.raises(KeyError, match="known: gaussian_noise"):
        corrupt(digits, "fog", 1)
    with pytest.raises(ValueError, match="severity"):
        corrupt(digits, "jpeg", 4)
    with pytest.raises(ValueError, match=r"\[N, C, H, W\]"):
        corrupt(digits[0], "jpeg", 1)
