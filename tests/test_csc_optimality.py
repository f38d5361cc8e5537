"""The CSC layer's FISTA reaches the optimum of its convex objective (scikit-learn as the reference)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.linear_model import Lasso

from unroll.solvers.csc import DictBlock, fista_momenta, power_iteration


def _explicit_dictionary(block: DictBlock, hw: int) -> np.ndarray:
    """The matrix of c ↦ D⊛c (conv_transpose2d), built column by column from unit codes."""
    with torch.no_grad():
        probe = F.conv2d(torch.zeros(1, block.in_channels, hw, hw), block.weight, stride=block.stride,
                         padding=block.padding)
        n = probe.numel()
        eye = torch.eye(n).reshape(n, *probe.shape[1:])
        cols = F.conv_transpose2d(eye, block.weight, stride=block.stride, padding=block.padding,
                                  output_padding=block.stride - 1)
    return cols.reshape(n, -1).T.double().numpy()


def _objective(dmat: np.ndarray, x: np.ndarray, c: np.ndarray, lmbd: float) -> float:
    return float(lmbd * np.abs(c).sum() + 0.5 * ((x - dmat @ c) ** 2).sum())


@pytest.mark.parametrize(("seed", "channels", "atoms", "stride", "lmbd"), [(0, 2, 6, 1, 0.05), (1, 1, 4, 2, 0.02)])
def test_many_fista_steps_reach_nonnegative_lasso_optimum(seed: int, channels: int, atoms: int, stride: int,
                                                          lmbd: float) -> None:
    torch.manual_seed(seed)
    block = DictBlock(channels, atoms, kernel_size=3, stride=stride, padding=1, lmbd=lmbd, n_steps=400,
                      probe_size=8).eval()
    x = torch.rand(1, channels, 8, 8)
    with torch.no_grad():
        code = block(x).double().flatten().numpy()
    dmat = _explicit_dictionary(block, 8)
    xv = x.double().flatten().numpy()
    ref = Lasso(alpha=lmbd / len(xv), fit_intercept=False, positive=True, tol=1e-12, max_iter=200000)
    ref.fit(dmat, xv)
    f_ours, f_ref = _objective(dmat, xv, code, lmbd), _objective(dmat, xv, ref.coef_, lmbd)
    # The dictionary is overcomplete, so the minimiser need not be unique: compare objective values.
    assert abs(f_ours - f_ref) <= 1e-5 * max(1.0, abs(f_ref))
    assert code.min() >= 0.0


def test_power_iteration_matches_dense_spectral_norm() -> None:
    torch.manual_seed(2)
    block = DictBlock(2, 5, kernel_size=3, stride=1, padding=1, probe_size=8)
    dmat = _explicit_dictionary(block, 8)
    eig = power_iteration(block.weight.detach(), (2, 8, 8), 1, 1, max_iters=2000, tol=1e-10)
    assert abs(eig - np.linalg.norm(dmat, 2) ** 2) <= 1e-3 * eig
    # step_size = 0.9 / L makes each step a descent step (t·L < 1)
    assert float(block.step_size) * np.linalg.norm(dmat, 2) ** 2 < 1.0 + 1e-3


def test_single_step_objective_decreases_from_zero() -> None:
    """Two ISTA-type steps (K=2: no momentum yet) never increase the objective: theory's guarantee."""
    torch.manual_seed(3)
    x = torch.rand(1, 2, 8, 8)
    prev = None
    for k in (1, 2):
        block = DictBlock(2, 6, n_steps=k, lmbd=0.05, probe_size=8).eval()
        if prev is None:
            torch.manual_seed(3)
            weights = block.weight.detach().clone()
            step = block.step_size.clone()
        with torch.no_grad():
            block.weight.copy_(weights)
            block.step_size.copy_(step)
            code = block(x).double().flatten().numpy()
        dmat = _explicit_dictionary(block, 8)
        f = _objective(dmat, x.double().flatten().numpy(), code, 0.05)
        zero = _objective(dmat, x.double().flatten().numpy(), np.zeros_like(code), 0.05)
        assert f <= (prev if prev is not None else zero) + 1e-9
        prev = f


def test_unrolled_steps_equal_plain_loop() -> None:
    """K unrolled steps equal the textbook loop written independently in NumPy on the dense matrix."""
    torch.manual_seed(4)
    block = DictBlock(2, 6, n_steps=5, lmbd=0.05, probe_size=8).eval()
    x = torch.rand(1, 2, 8, 8)
    with torch.no_grad():
        code = block(x).double().flatten().numpy()
    d, xv, t, lam = _explicit_dictionary(block, 8), x.double().flatten().numpy(), float(block.step_size), 0.05
    c = np.maximum(t * d.T @ xv - lam * t, 0)
    c_prev = c
    for beta in fista_momenta(5):
        a = c + beta * (c - c_prev)
        c_prev, c = c, np.maximum(a + t * d.T @ (xv - d @ c) - lam * t, 0)
    np.testing.assert_allclose(code, c, atol=1e-5)
