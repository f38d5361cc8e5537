"""The σ estimate's wavelet band, computed with NumPy alone, is PyWavelets' (what scikit-image's ``estimate_sigma``
uses) on every shape class: even and odd sides, sides shorter than the filter, 8-bit and 16-bit steps, noise."""

from __future__ import annotations

import numpy as np
import pytest
import pywt

from unroll.serving.imaging import sigma


@pytest.mark.parametrize("shape", [(1, 1), (1, 5), (2, 3), (3, 3), (4, 7), (16, 16), (17, 33), (64, 63), (300, 200)])
def test_the_diagonal_band_is_pywavelets(shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(sum(shape))
    for plane in (rng.random(shape), np.round(rng.random(shape) * 255) / 255, np.full(shape, 0.5),
                  np.round(rng.random(shape) * 65535) / 65535):
        want = pywt.dwtn(plane, "db2")["dd"]
        got = sigma.diagonal_band(plane)
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
        single = plane.astype(np.float32)  # the gateway's planes: float32, kept so (as PyWavelets does)
        got, want = sigma.diagonal_band(single), pywt.dwtn(single, "db2")["dd"]
        assert got.dtype == want.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_the_filter_is_pywavelets_db2() -> None:
    np.testing.assert_array_equal(sigma.DB2_HIGH_PASS, np.array(pywt.Wavelet("db2").dec_hi))
