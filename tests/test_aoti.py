"""AOTInductor packages (``export/aoti.py``) run by the ``aotinductor`` CPU session (``serving/aoti_runtime.py``):
equal to PyTorch on real inputs at several batches and, for the denoiser, image sizes (dynamic H×W); the sidecar
names the card's inputs and outputs; the session refuses feeds the package would misread."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import unroll
from unroll.data import add_noise, bundled_image, mnist_split
from unroll.export.aoti import compile_package, read_sidecar
from unroll.serving.aoti_runtime import aoti_session
from unroll.solvers.residual import WithResidual

# each compile takes 10–15 s (2 cores, warm Inductor cache) to ~1 min (cold)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOL = 1e-4


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``package(name)``: the model compiled once per module."""
    out, done = tmp_path_factory.mktemp("aoti"), {}

    def get(name: str) -> Path:
        if name not in done:
            done[name] = compile_package(name, out / f"{name}.pt2")
        return done[name]

    return get


def _max_err(got: np.ndarray, model: torch.nn.Module, *args: np.ndarray) -> float:
    with torch.no_grad():
        ref = model(*(torch.from_numpy(a) for a in args)).numpy()
    assert got.shape == ref.shape
    return float(np.abs(got - ref).max())


def test_sdnet_mnist(package: Callable[[str], Path]) -> None:
    path = package("sdnet-mnist")
    side = read_sidecar(path)
    assert side["model"] == "sdnet-mnist" and side["torch"] == torch.__version__
    # the solver's residual and code size too (card.ood), as the ONNX export carries them
    assert side["inputs"] == {"image": [None, 1, 28, 28], "lam": [None]}
    assert side["outputs"] == ["logits", "solver_fit"]
    lam = side["card"]["lam"]["default"]
    assert lam is not None  # filled in from the model, as in the ONNX export

    run = aoti_session(path, threads=2)
    assert run.runtime == "aotinductor" and run.inputs == side["inputs"]
    model = unroll.load("sdnet-mnist")
    digits = mnist_split()[2][:3]
    for b in (1, 3):
        lams = np.array([lam, lam / 2, 3 * lam][:b], np.float32)
        got = run({"image": digits[:b], "lam": lams})
        assert _max_err(got["logits"], model, digits[:b], lams) <= TOL
        with torch.no_grad():
            _, fit = WithResidual(model)(torch.from_numpy(digits[:b]), torch.from_numpy(lams))
        assert np.abs(got["solver_fit"] - fit.numpy()).max() <= TOL * max(1.0, float(fit.abs().max()))

    with pytest.raises(ValueError, match="unknown input"):
        run({"image": digits[:1], "lam": lams[:1], "sigma": lams[:1]})


def test_csc_denoiser(package: Callable[[str], Path]) -> None:
    path = package("csc-denoiser")
    side = read_sidecar(path)
    assert side["inputs"] == {"noisy": [None, 1, None, None], "sigma": [None]} and side["outputs"] == ["denoised"]

    run = aoti_session(path, threads=2)
    model = unroll.load("csc-denoiser")
    camera = bundled_image("camera")
    for h, w in ((64, 64), (96, 80)):
        for b in (1, 2):
            clean = np.stack([camera[200 + 40 * i:200 + 40 * i + h, 150:150 + w][None] for i in range(b)])
            noisy = add_noise(clean, 25, seed=h * w + b)
            sigma = np.full(b, 25 / 255, np.float32)
            got = run({"noisy": noisy, "sigma": sigma})["denoised"]
            assert _max_err(got, model, noisy, sigma) <= TOL, (h, w, b)

    with pytest.raises(ValueError, match="unknown input"):
        run({"noisy": noisy, "sigma": sigma, "lam": sigma})
