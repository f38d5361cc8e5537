"""The out-of-distribution score from the solver's residual (issue 40, measured part): its data halves are disjoint,
the residual is what the layer's reconstruction says, the rule is chosen on validation only, and the committed
results, their Markdown and the README's table agree."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from unroll import ood_sets, registry
from unroll.benchmarks import denoise_ood, ood, ood_served, serve_ab
from unroll.benchmarks.common import RESULTS
from unroll.solvers.csc import output_padding
from unroll.solvers.residual import WithResidual, _fit, first_solver, forward_with_residual, reconstruct

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
    # the graph's third output: the code's size against the target's, from the code the layer found
    _, both = WithResidual(model)(x)
    assert both.shape == (4, 2)
    torch.testing.assert_close(both[:, 0], r)
    torch.testing.assert_close(both[:, 1], fit.code.abs().flatten(1).sum(1) / fit.target.flatten(1).norm(dim=1))
    if kind in ("VARSAttention", "NMFHam"):  # what the layer kept is what its solver gives again from its input
        seen = []
        handle = fit.layer.register_forward_hook(lambda _, inputs, out: seen.append((inputs[0], out)))
        with torch.no_grad():
            model(x)
        handle.remove()
        again = _fit(fit.layer, *seen[0])
        assert again.difference is None and fit.difference is not None  # recomputed, not kept
        torch.testing.assert_close(fit.code, again.code)
        torch.testing.assert_close(fit.difference, again.target - reconstruct(again))
    if kind == "DictBlock":  # by hand: the input minus the reconstruction of the iterate one step before the code
        layer = copy.deepcopy(fit.layer)
        layer.n_steps -= 1
        with torch.no_grad():
            before_last = layer(fit.target)
            rec = F.conv_transpose2d(before_last, layer.weight, stride=layer.stride, padding=layer.padding,
                                     output_padding=output_padding(layer.stride))
        want = (fit.target - rec).flatten(1).norm(dim=1) / fit.target.flatten(1).norm(dim=1)
        torch.testing.assert_close(r, want)
        assert fit.difference is not None and fit.layer.solver_residual is None  # caught, then let go
        assert not fit.layer.keep_residual


def test_a_model_without_a_solver_has_no_residual() -> None:
    with pytest.raises(ValueError, match="no solver layer"):
        forward_with_residual(registry.load("cnn-mnist").eval(), torch.zeros(1, 1, 28, 28))


def _signals(residual: np.ndarray, code: np.ndarray | None = None, msp: np.ndarray | None = None) -> dict:
    rng = np.random.default_rng(0)
    return {"residual": residual, "code_l1": rng.permutation(residual) if code is None else code,
            "msp": rng.permutation(residual) if msp is None else msp}


def test_the_scores_and_the_rule() -> None:
    inside = np.linspace(0.4, 0.6, 200)
    assert ood.auroc(inside, inside + 1) == 1.0 and ood.fpr95(inside, inside + 1) == 0.0
    assert ood.auroc(inside, inside - 1) == 0.0 and ood.fpr95(inside, inside - 1) == 1.0
    digits = _signals(inside)
    # out on both sides by the residual alone: the simplest rule that tells them apart, two-sided
    rule, name, mean = ood.choose_rule(digits, {"low": _signals(inside - 1), "high": _signals(inside + 1)})
    assert name == "residual, two-sided" and mean[name] > mean["residual, one-sided"]
    assert [t.signal for t in rule.terms] == ["residual"] and rule.terms[0].sided == "both"
    assert (rule.score(digits) > rule.threshold).mean() <= 1 - ood.FLAG_QUANTILE + 1e-9
    rule, name, _ = ood.choose_rule(digits, {"high": _signals(inside + 1)})
    assert name == "residual, one-sided" and rule.terms[0].sided == "high"
    # the residual says nothing, the code's size and the softmax each catch one set: all three terms
    odd = {"big codes": _signals(inside, code=inside + 1), "unsure": _signals(inside, msp=inside + 1)}
    rule, name, mean = ood.choose_rule(digits, odd)
    assert {t.signal for t in rule.terms} == {"residual", "code_l1", "msp"} and mean[name] == max(mean.values())
    one = {k: v[:1] for k, v in odd["unsure"].items()}  # the card scores one image as the benchmark scored many
    assert float(rule.score({k: float(v[0]) for k, v in one.items()})) == pytest.approx(float(rule.score(one)[0]))


@pytest.mark.triton
def test_a_quick_run_writes_consistent_results_and_serves_both_graphs(tmp_path: Path, demo_onnx_dir: Path) -> None:
    if serve_ab.find() is None:
        pytest.skip(serve_ab.missing_reason())
    p = ood.run(["sdnet-mnist"], digits=120, out_dir=tmp_path, onnx_dir=demo_onnx_dir, served_rounds=1,
                served_round_s=1, served_paired_s=1, quantized=())  # the quantized graphs' part: tests/test_quantize.py
    assert (tmp_path / "ood.md").read_text() == ood.markdown(json.loads((tmp_path / "ood.json").read_text()))
    assert (tmp_path / "ood.png").stat().st_size > 0
    m = p["models"]["sdnet-mnist"]
    assert m["digits"] == {"validation": 120, "test": 120} and set(m["sets"]) == set(ood_sets.KINDS)
    assert [t["met"] for t in p["targets"]] == [t["met"] for t in ood.verdicts(p)]
    served = p["served"]["sdnet-mnist"]
    for path in ood_served.PATHS:
        for graph in ("with", "without"):
            assert served[path][graph]["requests"] > 0 and served[path][graph]["p50_ms"] > 0, (path, graph)
            assert served[path][graph]["cpu_ms_per_request"] > 0, (path, graph)
            # Triton's mean model time per request (a mean: not comparable with one short run's percentiles)
            assert 0 < served[path][graph]["compute_ms"] < 1e3, (path, graph)
        assert served[path]["added_latency"] == pytest.approx(served[path]["added_compute_ms"] /
                                                              served[path]["without"]["p50_ms"])
        paired = served[path]["paired"]
        assert paired["pairs"] >= 10 and paired["base_p50_ms"] > 0 and paired["other_p50_ms"] > 0
        assert paired["added_ci_ms"][0] <= paired["added_ms"] <= paired["added_ci_ms"][1]
        assert served[path]["judged"]["added"] == pytest.approx(served[path]["judged"]["added_ms"] /
                                                                served[path]["without"]["p50_ms"])
    for pair in ("twin", "handover"):  # the A/A pair and the output's hand-over on one served model
        assert served[pair]["pairs"] >= 10 and served[pair]["base_p50_ms"] > 0, pair
    assert served["triton"]["judged"]["added_ms"] == pytest.approx(served["graph"]["added_ms"] +
                                                                   served["handover"]["added_ms"])
    assert served["gateway"]["judged"]["added_ms"] == pytest.approx(
        served["triton"]["judged"]["added_ms"] + served["graph"]["gateway_score"]["added_ms"])
    # the gateway's own work for the score costs something, and far less than a request
    assert 0 < served["graph"]["gateway_score"]["added_ms"] < 0.2
    assert len([t for t in p["targets"] if "served added latency" in t["target"]]) == len(ood_served.PATHS)


def test_the_plain_copy_is_the_same_graph_without_the_residual_branch(tmp_path: Path, demo_onnx_dir: Path) -> None:
    """What the served cost is measured against: the exported graph with its residual output and every node only it
    needs removed; its logits are the full graph's."""
    import onnx
    import onnxruntime as ort

    from unroll import artifacts
    from unroll.card import from_onnx

    for f in (artifacts.graph("sdnet-mnist", onnx_dir=demo_onnx_dir),
              artifacts.graph_report("sdnet-mnist", onnx_dir=demo_onnx_dir)):
        (tmp_path / f.name).symlink_to(f)
    plain = ood_served.plain_copy(tmp_path, "sdnet-mnist")
    full_model, plain_model = (onnx.load(str(tmp_path / f"{n}.onnx")) for n in ("sdnet-mnist", plain))
    assert [o.name for o in full_model.graph.output] == ["logits", "solver_fit"]
    assert [o.name for o in plain_model.graph.output] == ["logits"]
    assert len(plain_model.graph.node) < len(full_model.graph.node)
    card = from_onnx(plain_model)
    assert card.name == plain and card.ood is None
    x = ood_sets.ood_sets("validation")["photo crops"][:3]
    full = ort.InferenceSession(str(tmp_path / "sdnet-mnist.onnx"), providers=["CPUExecutionProvider"])
    bare = ort.InferenceSession(str(tmp_path / f"{plain}.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"image": x, "lam": np.full(len(x), card.lam.default, np.float32)}
    np.testing.assert_array_equal(full.run(["logits"], feeds)[0], bare.run(None, feeds)[0])


def test_the_committed_results_their_markdown_and_the_readme_agree() -> None:
    p = json.loads((RESULTS / "ood.json").read_text())
    assert (RESULTS / "ood.md").read_text() == ood.markdown(p)
    assert list(p["models"]) == ood.scored_models() and all(m["digits"]["test"] == 1000 for m in p["models"].values())
    assert p["targets"] == json.loads(json.dumps(ood.verdicts(p)))  # each verdict follows from the numbers
    readme = (ROOT / "README.md").read_text()
    start, end = readme.index(ood.README_BEGIN) + len(ood.README_BEGIN), readme.index(ood.README_END)
    assert readme[start:end].strip() == ood.readme_block(p).strip()


def test_the_denoisers_halves_share_no_photo_no_graphic_family_and_no_parameter() -> None:
    """The denoiser's out-of-distribution rule is chosen on images and noise the report never uses."""
    card = registry.get_spec("csc-denoiser").card
    halves = denoise_ood._halves(card)
    (val_photos, val_graphics), (test_photos, test_graphics) = halves["validation"], halves["test"]
    assert val_photos and test_photos and not set(val_photos) & set(test_photos)
    family = {h: {k.split("-")[0] for k in g} for h, g in (("validation", val_graphics), ("test", test_graphics))}
    assert family["validation"] and family["test"] and not family["validation"] & family["test"]
    val, test = denoise_ood.PARAMS["validation"], denoise_ood.PARAMS["test"]
    assert val.keys() == test.keys()
    for key in val:
        assert not set(np.atleast_1d(val[key])) & set(np.atleast_1d(test[key])), key
    sent = denoise_ood.requests("test", card, crops=1)
    assert set(sent) == {"in distribution", *denoise_ood.KINDS} and all(sent.values())
    assert sent == denoise_ood.requests("test", card, crops=1)  # seeded: the same bytes again
