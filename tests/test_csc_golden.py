"""SDNet's CSC layer reproduces the official implementation's outputs (shared golden fixture)."""

from pathlib import Path

import numpy as np
import pytest
import torch

from unroll.solvers.csc import DictBlock

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "sdnet_csc_golden.npz"  # copied from shared/fixtures


def _cases() -> list[str]:
    if not FIXTURE.exists():
        return []
    return sorted({k.split("/")[0] for k in np.load(FIXTURE).files})


def _run_case(case: str) -> tuple[np.ndarray, np.ndarray]:
    """Our layer on one golden case's inputs (weight, step size, λ, K, stride) → (ours, official)."""
    d = np.load(FIXTURE)
    g = {k.split("/")[1]: d[k] for k in d.files if k.startswith(case + "/")}
    w = torch.from_numpy(g["weight"])
    block = DictBlock(w.shape[1], w.shape[0], kernel_size=w.shape[-1], stride=int(g["stride"]),
                      padding=int(g["padding"]), lmbd=float(g["lmbd"]), n_steps=int(g["n_steps"])).eval()
    with torch.no_grad():
        block.weight.copy_(w)
        block.step_size.fill_(float(g["step_size"]))
        out = block(torch.from_numpy(g["x"]))
    return out.numpy(), g["out"]


@pytest.mark.parametrize("case", _cases())
def test_dictblock_matches_official(case: str) -> None:
    ours, official = _run_case(case)
    np.testing.assert_allclose(ours, official, atol=1e-5, rtol=0)


def test_per_sample_lambda_override_matches_scalar() -> None:
    d = np.load(FIXTURE)
    case = "cifar_k3s1_lam0.1_2steps"
    w = torch.from_numpy(d[f"{case}/weight"])
    block = DictBlock(3, 64).eval()
    with torch.no_grad():
        block.weight.copy_(w)
        block.step_size.fill_(float(d[f"{case}/step_size"]))
        x = torch.from_numpy(d[f"{case}/x"])
        out = block(x, torch.tensor([0.1, 0.1]))
        np.testing.assert_allclose(out.numpy(), d[f"{case}/out"], atol=1e-5, rtol=0)
        mixed = block(x, torch.tensor([0.1, 0.9]))
    assert torch.allclose(mixed[0], out[0]) and not torch.allclose(mixed[1], out[1])
    assert (mixed[1] > 0).sum() < (out[1] > 0).sum()  # larger λ → sparser code


@pytest.mark.parametrize("case", _cases())
def test_textbook_form_matches_official_too(case: str) -> None:
    """The unfused textbook form (the naive export's source) is the same maths."""
    from unroll.solvers.shrink import textbook_mode

    with textbook_mode():
        ours, official = _run_case(case)
    np.testing.assert_allclose(ours, official, atol=1e-5, rtol=0)
