"""The out-of-distribution score from the solver's residual (issue 40, measured part): its data halves are disjoint,
the residual is what the layer's reconstruction says, the rule is chosen on validation only, and the committed
results, their Markdown and the README's table agree."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from unroll import ood_sets, registry
from unroll.benchmarks import ood
from unroll.benchmarks.common import RESULTS
from unroll.solvers.csc import output_padding
from unroll.solvers.residual import first_solver, forward_with_residual

ROOT = Path(__file__).resolve().parents[1]


def _hashes(sets: dict[str, np.ndarray]) -> set[str]:
    return {hashlib.sha256(img.tobytes()).hexdigest() for imgs in sets.values() for img in imgs}


def test_the_validation_and_test_halves_are_disjoint_by_content_and_reproducible() -> None:
    val, test = ood_sets.ood_sets("validation"), ood_sets.ood_sets("test")
    assert list(val) == list(test) == list(ood_sets.KINDS)
    for sets in (val, test):
        for kind, imgs in sets.items():
            assert imgs.dtype == np.float32 and imgs.shape[1:] == (1, 28, 28) and len(imgs) > 20, kind
            assert 0.0 <= imgs.min() and imgs.max() <= 1.0, kind
    assert not _hashes(val) & _hashes(test)  # no image in both halves
    assert not set(ood_sets.VALIDATION_PHOTOS) & set(ood_sets.TEST_PHOTOS)
    assert not set(ood_sets.VALIDATION_FONTS) & set(ood_sets.TEST_FONTS)
    assert not set(ood_sets.VALIDATION_CHARS) & set(ood_sets.TEST_CHARS)
    again = ood_sets.ood_sets("test")
    assert all(np.array_equal(test[k], again[k]) for k in test)
    assert set(ood_sets.photos()) == set(ood_sets.WHOLE_PHOTOS)


@pytest.mark.parametrize("name, kind", [("sdnet-mnist", "DictBlock"), ("vars-vit-mnist", "VARSAttention"),
                                        ("dic-vit-mnist", "DicAttention"), ("ham-cnn-mnist", "NMFHam")])
def test_the_residual_leaves_the_output_alone_and_is_the_layers_reconstruction_error(name: str, kind: str) -> None:
    model = registry.load(name).eval()
    x = torch.from_numpy(ood_sets.ood_sets("validation")["inverted digits"][:4])
    y, r, fit = forward_with_residual(model, x)
    with torch.no_grad():
        assert torch.equal(y, model(x))  # the hook only watches
    assert type(first_solver(model)).__name__ == kind and r.shape == (4,)
    assert bool((torch.isfinite(r) & (r > 0)).all()), r  # (a relative residual may pass 1: D·z can overshoot)
    if kind == "DictBlock":  # by hand: the layer's input minus the transposed convolution of its code
        layer = fit.layer
        rec = F.conv_transpose2d(fit.code, layer.weight, stride=layer.stride, padding=layer.padding,
                                 output_padding=output_padding(layer.stride))
        want = (fit.target - rec).flatten(1).norm(dim=1) / fit.target.flatten(1).norm(dim=1)
        torch.testing.assert_close(r, want)


def test_a_model_without_a_solver_has_no_residual() -> None:
    with pytest.raises(ValueError, match="no solver layer"):
        forward_with_residual(registry.load("cnn-mnist").eval(), torch.zeros(1, 1, 28, 28))


def test_the_scores_and_the_rule() -> None:
    inside = np.linspace(0.4, 0.6, 200)
    assert ood.auroc(inside, inside + 1) == 1.0 and ood.fpr95(inside, inside + 1) == 0.0
    assert ood.auroc(inside, inside - 1) == 0.0 and ood.fpr95(inside, inside - 1) == 1.0
    rule, mean = ood.choose_rule(inside, {"low": inside - 1, "high": inside + 1})  # out on both sides: two-sided
    assert rule.sided == "both" and mean["both"] > mean["high"]
    assert rule.flags(inside).mean() <= 1 - ood.FLAG_QUANTILE + 1e-9
    rule, _ = ood.choose_rule(inside, {"high": inside + 1})
    assert rule.sided == "high"


def test_a_quick_run_writes_consistent_results(tmp_path: Path) -> None:
    p = ood.run(["sdnet-mnist"], digits=120, out_dir=tmp_path)
    assert (tmp_path / "ood.md").read_text() == ood.markdown(json.loads((tmp_path / "ood.json").read_text()))
    assert (tmp_path / "ood.png").stat().st_size > 0
    m = p["models"]["sdnet-mnist"]
    assert m["digits"] == {"validation": 120, "test": 120} and set(m["sets"]) == set(ood_sets.KINDS)
    assert [t["met"] for t in p["targets"]] == [t["met"] for t in ood.verdicts(p)]


def test_the_committed_results_their_markdown_and_the_readme_agree() -> None:
    p = json.loads((RESULTS / "ood.json").read_text())
    assert (RESULTS / "ood.md").read_text() == ood.markdown(p)
    assert list(p["models"]) == ood.scored_models() and all(m["digits"]["test"] == 1000 for m in p["models"].values())
    assert p["targets"] == json.loads(json.dumps(ood.verdicts(p)))  # each verdict follows from the numbers
    readme = (ROOT / "README.md").read_text()
    start, end = readme.index(ood.README_BEGIN) + len(ood.README_BEGIN), readme.index(ood.README_END)
    assert readme[start:end].strip() == ood.readme_block(p).strip()
