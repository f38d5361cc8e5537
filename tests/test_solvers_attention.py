"""Unrolled attention-like solvers (VARS ISTA, Hamburger NMF, Dic-Attn elastic net) vs independent references.

References are scikit-learn's Lasso / ElasticNet optima, objective monotonicity, and plain numpy loops
written here (never the modules themselves). VARS's parity with the official code is tests/test_rvt.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from scipy.special import erf
from sklearn.linear_model import ElasticNet, Lasso

from unroll.solvers.dic_attn import DicAttention, elastic_net_codes
from unroll.solvers.nmf import NMFHam, nmf_bases_step, nmf_coef_step, nmf_updates
from unroll.solvers.vars_attn import VARSAttention, vars_codes


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    """The problems here are tiny: intra-op threads only add sync latency (badly so on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- numpy references


def np_shrink(v: np.ndarray, theta: np.ndarray | float) -> np.ndarray:
    return np.sign(v) * np.maximum(np.abs(v) - theta, 0.0)


def np_ista(D: np.ndarray, v: np.ndarray, lmbd: float, n_steps: int) -> np.ndarray:
    """ISTA with the Gershgorin step, batched over leading dims."""
    Dt = np.swapaxes(D, -1, -2)
    G, b = Dt @ D, Dt @ v
    L = np.abs(G).sum(-1).max(-1)[..., None, None] + 1.0
    x = np_shrink(b, lmbd)
    for _ in range(n_steps):
        x = np_shrink(x - (G @ x - b) / L, lmbd / L)
    return x


def np_gelu_shrink(v: np.ndarray, theta: np.ndarray | float) -> np.ndarray:
    u = np.abs(v) - theta
    return np.sign(v) * 0.5 * u * (1 + erf(u / np.sqrt(2)))


def ista_codes(D: torch.Tensor, v: torch.Tensor, lmbd: float, n_steps: int) -> torch.Tensor:
    """VARS's solver with identity learned parameters and the paper's soft threshold: plain ISTA on the Lasso."""
    Dt = D.transpose(-1, -2)
    return vars_codes(Dt @ D, Dt @ v, lmbd, n_steps, shrink="relu")


def np_elastic(D: np.ndarray, x: np.ndarray, beta: float, mu: float, n_steps: int, L: float) -> np.ndarray:
    phi = np.zeros(x.shape[:-1] + (D.shape[1],))
    for _ in range(n_steps):
        grad = (phi @ D.T - x) @ D + mu * phi
        phi = np_shrink(phi - grad / L, beta / L)
    return phi


def np_nmf(X: np.ndarray, bases: np.ndarray, coef: np.ndarray, n_steps: int) -> tuple[np.ndarray, np.ndarray]:
    Xt = np.swapaxes(X, 1, 2)
    for _ in range(n_steps):
        coef = coef * (Xt @ bases) / (coef @ (np.swapaxes(bases, 1, 2) @ bases) + 1e-6)
        bases = bases * (X @ coef) / (bases @ (np.swapaxes(coef, 1, 2) @ coef) + 1e-6)
    return bases, coef


def np_softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def lasso_obj(D: torch.Tensor, v: torch.Tensor, x: torch.Tensor, lmbd: float) -> float:
    return float(0.5 * ((v - D @ x) ** 2).sum() + lmbd * x.abs().sum())


def enet_obj(D: torch.Tensor, x: torch.Tensor, phi: torch.Tensor, beta: float, mu: float) -> float:
    return float(0.5 * ((x - phi @ D.T) ** 2).sum() + beta * phi.abs().sum() + 0.5 * mu * (phi**2).sum())


def unit_columns(a: torch.Tensor) -> torch.Tensor:
    return a / a.norm(dim=-2, keepdim=True)


# ----------------------------------------------------------------------------- ISTA (VARS)


def test_ista_reaches_sklearn_lasso_optimum() -> None:
    g = torch.Generator().manual_seed(0)
    n, m, lmbd = 40, 12, 0.5
    D = unit_columns(torch.randn(n, m, generator=g, dtype=torch.float64))
    v = torch.randn(n, 1, generator=g, dtype=torch.float64)
    x = ista_codes(D, v, lmbd, 3000)[:, 0].numpy()
    # sklearn: 1/(2n)‖y − Xw‖² + α‖w‖₁  ==  (1/n)·(½‖v − Dx‖² + λ‖x‖₁)  with α = λ/n.
    ref = Lasso(alpha=lmbd / n, fit_intercept=False, tol=1e-14, max_iter=200_000)
    ref.fit(D.numpy(), v[:, 0].numpy())
    assert (ref.coef_ == 0).any() and (ref.coef_ != 0).any()  # a genuinely sparse optimum
    np.testing.assert_allclose(x, ref.coef_, atol=1e-4)


@pytest.mark.parametrize("kind", ["gaussian", "positive_overcomplete"])
def test_ista_objective_non_increasing(kind: str) -> None:
    g = torch.Generator().manual_seed(1)
    n, m, lmbd = 20, 10 if kind == "gaussian" else 48, 0.3
    raw = torch.randn(n, m, generator=g, dtype=torch.float64)
    D = unit_columns(raw if kind == "gaussian" else raw.exp())  # positive atoms, like VARS's features
    v = torch.randn(n, 3, generator=g, dtype=torch.float64)
    objs = [lasso_obj(D, v, ista_codes(D, v, lmbd, k), lmbd) for k in range(40)]
    for before, after in zip(objs, objs[1:], strict=False):
        assert after <= before + 1e-12 * abs(before)
    assert objs[-1] < objs[0]


def test_ista_unrolled_equals_numpy_loop_batched() -> None:
    g = torch.Generator().manual_seed(2)
    D = unit_columns(torch.rand(2, 3, 9, 6, generator=g, dtype=torch.float64))  # [B, h, N, m]
    v = torch.randn(2, 3, 9, 4, generator=g, dtype=torch.float64)
    got = ista_codes(D, v, 0.2, 5).numpy()
    np.testing.assert_allclose(got, np_ista(D.numpy(), v.numpy(), 0.2, 5), rtol=1e-10, atol=1e-12)
    # Each (sample, head) has its own step size: batched equals one-by-one.
    single = ista_codes(D[1, 2], v[1, 2], 0.2, 5).numpy()
    np.testing.assert_allclose(got[1, 2], single, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------- elastic net (Dic-Attn)


def _enet_problem(seed: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    g = torch.Generator().manual_seed(seed)
    d, k = 30, 50  # overcomplete: only the μ term makes the optimum unique
    D = unit_columns(torch.randn(d, k, generator=g, dtype=torch.float64))
    x = torch.randn(2, d, generator=g, dtype=torch.float64)
    L = float(np.linalg.norm(D.numpy(), 2) ** 2)
    return D, x, L


def test_elastic_net_reaches_sklearn_optimum() -> None:
    beta, mu = 0.2, 0.1
    D, x, L = _enet_problem(3)
    phi = elastic_net_codes(D, x, beta, mu, 3000, L + mu).numpy()
    d = D.shape[0]
    # sklearn: 1/(2n)‖y − Xw‖² + αρ‖w‖₁ + ½α(1 − ρ)‖w‖²  ==  (1/n)·ours  with αρ = β/n, α(1 − ρ) = μ/n.
    alpha, l1_ratio = (beta + mu) / d, beta / (beta + mu)
    for i in range(x.shape[0]):
        ref = ElasticNet(alpha=alpha, l1_ratio=l1_ratio, fit_intercept=False, tol=1e-14, max_iter=200_000)
        ref.fit(D.numpy(), x[i].numpy())
        assert (ref.coef_ == 0).any()
        np.testing.assert_allclose(phi[i], ref.coef_, atol=1e-4)


def test_elastic_net_objective_non_increasing() -> None:
    beta, mu = 0.1, 0.1
    D, x, L = _enet_problem(4)
    objs = [enet_obj(D, x, elastic_net_codes(D, x, beta, mu, k, L + mu), beta, mu) for k in range(40)]
    assert objs[0] == pytest.approx(0.5 * float((x**2).sum()))  # φ₀ = 0
    for before, after in zip(objs, objs[1:], strict=False):
        assert after <= before + 1e-12 * abs(before)
    assert objs[-1] < objs[1] < objs[0]


def test_elastic_net_unrolled_equals_numpy_loop() -> None:
    D, x, L = _enet_problem(5)
    for k in (1, 5):
        got = elastic_net_codes(D, x, 0.1, 0.2, k, L + 0.2).numpy()
        np.testing.assert_allclose(got, np_elastic(D.numpy(), x.numpy(), 0.1, 0.2, k, L + 0.2), atol=1e-12)


# ----------------------------------------------------------------------------- NMF (Hamburger)


def _nmf_problem(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    X = torch.relu(torch.randn(2, 16, 40, generator=g, dtype=torch.float64))
    bases = unit_columns(torch.rand(2, 16, 8, generator=g, dtype=torch.float64))
    coef = torch.softmax(X.transpose(1, 2) @ bases, dim=-1)
    return X, bases, coef


def test_nmf_objective_non_increasing_every_update() -> None:
    X, bases, coef = _nmf_problem(6)

    def err(b: torch.Tensor, c: torch.Tensor) -> float:
        return float(torch.linalg.norm(X - b @ c.transpose(1, 2)))

    objs = [err(bases, coef)]
    for _ in range(40):
        coef = nmf_coef_step(X, bases, coef)
        objs.append(err(bases, coef))
        bases = nmf_bases_step(X, bases, coef)
        objs.append(err(bases, coef))
        assert (coef >= 0).all() and (bases >= 0).all()
    for before, after in zip(objs, objs[1:], strict=False):
        assert after <= before * (1 + 1e-10)  # the 1e-6 denominator guard allows O(ε²) slack only
    assert objs[-1] < 0.95 * objs[0]


def test_nmf_unrolled_equals_numpy_loop() -> None:
    X, bases, coef = _nmf_problem(7)
    b, c = nmf_updates(X, bases, coef, 5)
    rb, rc = np_nmf(X.numpy(), bases.numpy(), coef.numpy(), 5)
    np.testing.assert_allclose(b.numpy(), rb, rtol=1e-10)
    np.testing.assert_allclose(c.numpy(), rc, rtol=1e-10)


def np_ham(x: np.ndarray, bases: np.ndarray, n_steps: int) -> np.ndarray:
    """Hamburger NMF forward with the given constant bases [D, R], reference form."""
    X = np.maximum(x.reshape(x.shape[0], x.shape[1], -1), 0.0)
    B = np.repeat(bases[None], X.shape[0], axis=0)
    C = np_softmax(np.swapaxes(X, 1, 2) @ B)
    B, C = np_nmf(X, B, C, n_steps)
    C = C * (np.swapaxes(X, 1, 2) @ B) / (C @ (np.swapaxes(B, 1, 2) @ B) + 1e-6)
    return (B @ np.swapaxes(C, 1, 2)).reshape(x.shape)


def test_nmf_ham_uses_train_steps_in_training_and_eval_steps_in_eval() -> None:
    ham = NMFHam(12, rank=6, train_steps=2, eval_steps=5).double()
    x = torch.randn(2, 12, 5, 7, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    bases = ham.bases.numpy()
    assert np.allclose(np.linalg.norm(bases, axis=0), 1.0) and (bases >= 0).all()
    with torch.no_grad():
        out_train = ham.train()(x).numpy()
        out_eval = ham.eval()(x).numpy()
    np.testing.assert_allclose(out_train, np_ham(x.numpy(), bases, 2), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(out_eval, np_ham(x.numpy(), bases, 5), rtol=1e-9, atol=1e-12)
    assert not np.allclose(out_train, out_eval)
    assert (out_eval >= 0).all()


def test_nmf_ham_gradient_flows_through_last_update() -> None:
    ham = NMFHam(8, rank=4).train()
    x = torch.randn(2, 8, 3, 3, requires_grad=True)
    ham(x).square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- VARS module vs reference


@pytest.mark.parametrize("mode", ["d", "sd"])
def test_vars_attention_matches_numpy_reference(mode: str) -> None:
    """The official VARS maths (learned K, λ, L; GELU shrinkage) written out in numpy, float64."""
    dim, h, n = 16, 2, 11
    torch.manual_seed(0)
    attn = VARSAttention(dim, num_heads=h, mode=mode, num_tokens=n, num_step=4).double().eval()
    m = attn.num_features
    with torch.no_grad():  # learned parameters away from their identity init
        attn.learned_k.add_(0.05 * torch.randn(attn.learned_k.shape, dtype=torch.float64))
        attn.learned_lam.fill_(1.1)
        attn.learned_L.fill_(0.9)
    x = torch.randn(2, n, dim, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    with torch.no_grad():
        got = attn(x).numpy()
    p = {k: t.detach().numpy() for k, t in attn.named_parameters()}
    qv = (x.numpy() @ p["qkv.weight"].T + p["qkv.bias"]).reshape(2, n, 2, h, dim // h).transpose(2, 0, 3, 1, 4)
    q = qv[0] / np.linalg.norm(qv[0], axis=-1, keepdims=True)
    feats = np.exp(q @ p["rand_matrix"] - 0.5 * (q**2).sum(-1, keepdims=True)) / np.sqrt(m)
    if mode == "sd":
        feats = np.concatenate([feats, np.broadcast_to(p["kernel"], (2, h, n, m))], axis=-1)
    D = feats / np.linalg.norm(feats, axis=-2, keepdims=True)
    G, b = np.swapaxes(D, -1, -2) @ D, np.swapaxes(D, -1, -2) @ qv[1]
    K = p["learned_k"] @ G @ p["learned_k"]
    step = (np.abs(G).sum(-1).max(-1)[..., None, None] + 1) / p["learned_L"]
    lam = 0.3 * p["learned_lam"]
    z = np_gelu_shrink(b, lam)
    for _ in range(4):
        z = np_gelu_shrink(z - (K @ z - b) / step, lam / step)
    out = (D @ z).transpose(0, 2, 1, 3).reshape(2, n, dim)
    np.testing.assert_allclose(got, out @ p["proj.weight"].T + p["proj.bias"], rtol=1e-9, atol=1e-12)


def test_vars_sd_static_atoms_get_gradients() -> None:
    attn = VARSAttention(16, num_heads=2, mode="sd", num_tokens=7).train()
    attn(torch.randn(2, 7, 16)).square().sum().backward()
    assert attn.kernel.grad is not None and attn.kernel.grad.abs().sum() > 0
    assert attn.learned_k.grad is not None and not attn.rand_matrix.requires_grad


# ----------------------------------------------------------------------------- Dic-Attn module


def test_dic_attention_refresh_and_train_eval_agree() -> None:
    attn = DicAttention(16, num_atoms=24, n_steps=4, beta=0.05, mu=0.1)
    with torch.no_grad():
        attn.dictionary.mul_(torch.linspace(0.5, 2.0, 24))  # as after an optimiser step: not unit norm
    x = torch.randn(3, 10, 16, generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        out_train = attn.train()(x)
        L = attn.refresh()
        out_eval = attn.eval()(x)
    D = attn.dictionary.detach().numpy()
    np.testing.assert_allclose(np.linalg.norm(D, axis=0), 1.0, rtol=1e-6)
    assert L == pytest.approx(np.linalg.norm(D.astype(np.float64), 2) ** 2 + 0.1, rel=1e-5)
    torch.testing.assert_close(out_eval, out_train, rtol=1e-5, atol=1e-6)


def test_dic_attention_matches_numpy_reference() -> None:
    attn = DicAttention(8, num_atoms=12, n_steps=3, beta=0.05, mu=0.2).double()
    with torch.no_grad():  # non-trivial learned re-weighting and code mixing
        attn.w_d.copy_(torch.linspace(0.5, 1.5, 12, dtype=torch.float64))
        attn.w_phi.add_(0.1 * torch.randn(12, 12, generator=torch.Generator().manual_seed(11)).double())
    attn.refresh()
    attn.eval()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    with torch.no_grad():
        got = attn(x).numpy()
    D, wd, wphi = (t.detach().numpy() for t in (attn.dictionary, attn.w_d, attn.w_phi))
    L = np.linalg.norm(D, 2) ** 2 + 0.2
    phi = np_elastic(D, x.numpy(), 0.05, 0.2, 3, L)  # [2, 5, k]
    rec = np.einsum("dk,kj,bnj->bnd", D @ np.diag(wd), wphi, phi)
    ref = rec @ attn.proj.weight.detach().numpy().T + attn.proj.bias.detach().numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12)


# ----------------------------------------------------------------------------- all modules: serving behaviour

MODULES = {
    "vars_d": lambda: VARSAttention(32, num_heads=4, mode="d"),
    "vars_sd": lambda: VARSAttention(32, num_heads=4, mode="sd", num_tokens=49),  # static atoms: N fixed
    "nmf_ham": lambda: NMFHam(32, rank=8),
    "dic_attn": lambda: DicAttention(32, num_atoms=48),
}


def _input(name: str, batch: int, side: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if name == "nmf_ham":
        return torch.randn(batch, 32, side, side, generator=g)
    return torch.randn(batch, side * side, 32, generator=g)


@pytest.mark.parametrize("name", list(MODULES))
def test_module_eval_shapes_determinism_and_batch_independence(name: str) -> None:
    torch.manual_seed(0)
    module = MODULES[name]().eval()
    for side in (4, 7) if name != "vars_sd" else (7,):  # N = 16 and N = 49 tokens with the same module
        x3 = _input(name, 3, side, seed=side)
        with torch.no_grad():
            out3, again = module(x3), module(x3)
            out1 = module(x3[:1])
        assert out3.shape == x3.shape and out1.shape == x3[:1].shape
        assert torch.isfinite(out3).all() and torch.isfinite(out1).all()
        assert torch.equal(out3, again)
        torch.testing.assert_close(out1, out3[:1], rtol=1e-4, atol=1e-5)  # per-sample, any batch size
        assert out3.abs().sum() > 0


def test_nmf_ham_accepts_flat_tokens() -> None:
    ham = NMFHam(32, rank=8).eval()
    x = _input("nmf_ham", 2, 5, seed=13)
    with torch.no_grad():
        torch.testing.assert_close(ham(x.flatten(2)), ham(x).flatten(2))


def test_same_seed_same_random_buffers() -> None:
    import unroll

    a, b, c = (unroll.load("vars-d", pretrained=False, seed=s) for s in (3, 3, 4))
    assert torch.equal(a.rand_matrix, b.rand_matrix) and not torch.equal(a.rand_matrix, c.rand_matrix)
    assert torch.equal(NMFHam(16, rank=4, seed=3).bases, NMFHam(16, rank=4, seed=3).bases)
    assert torch.equal(DicAttention(16, seed=3).dictionary, DicAttention(16, seed=3).dictionary)
