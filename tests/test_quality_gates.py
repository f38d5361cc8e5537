"""Issue 17: disjoint train/validation/test/stress sets on every card, and gates that hold on the worst image."""

import hashlib
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from unroll import data, gates, stress_patterns
from unroll.card import from_onnx
from unroll.export.quantize import calibration_inputs, quantize, to_int8
from unroll.registry import get_spec, list_models

ROLES = ("train", "calibration", "validation", "test", "stress")
#: Roles that may share content: calibration data may include the training data (it calibrates, it is not held out).
MAY_SHARE = {frozenset({"train", "calibration"})}


def _hashes(ds: data.Dataset) -> set[str]:
    """One content hash per image (images) or per sample (labelled arrays)."""
    loaded = ds.load()
    items = loaded.values() if ds.kind == "images" else np.asarray(loaded[0])
    return {hashlib.sha256(np.ascontiguousarray(a, np.float32).tobytes()).hexdigest() for a in items}


def test_every_cards_data_roles_are_disjoint_by_content() -> None:
    cache: dict[str, set[str]] = {}
    checked = 0
    for name in list_models():
        card = get_spec(name).card
        ids = {r: getattr(card.data, r) for r in ROLES if getattr(card.data, r) is not None}
        for r, i in ids.items():
            if i not in cache:
                cache[i] = _hashes(data.dataset(i))
            assert cache[i], f"{name}: card.data.{r} = {i} is empty"
        roles = list(ids)
        for a in range(len(roles)):
            for b in range(a + 1, len(roles)):
                ra, rb = roles[a], roles[b]
                if frozenset({ra, rb}) in MAY_SHARE:
                    continue
                assert ids[ra] != ids[rb], f"{name}: {ra} and {rb} are the same dataset {ids[ra]}"
                shared = cache[ids[ra]] & cache[ids[rb]]
                assert not shared, f"{name}: {ra} ({ids[ra]}) and {rb} ({ids[rb]}) share {len(shared)} items"
                checked += 1
    assert checked >= 9  # the denoiser's 4 roles (6 pairs) and the classifier's 3 (3 pairs) at least


def test_the_demo_cards_choose_on_validation_and_gate_the_stress_set() -> None:
    den, cls = get_spec("csc-denoiser").card, get_spec("sdnet-mnist").card
    assert den.data.gate == "validation" and den.data.stress == "denoise-stress" and den.data.test == "denoise-test"
    assert cls.data.gate == "validation" and cls.data.validation == "mnist-validation"
    assert gates.gate_roles(den) == ["validation", "stress"] and gates.gate_roles(cls) == ["validation"]
    assert den.gate("int8")["psnr_loss_db_worst"] == 0.15  # the worst single image, not only the mean
    stress = data.dataset("denoise-stress").load()
    assert {"shepp_logan_phantom", "checkerboard", "horse", "pil_text", "line_art", "flat_shapes"} <= set(stress)
    assert all(min(v.shape) >= 16 and 0 <= v.min() and v.max() <= 1 for v in stress.values())
    x, y = data.dataset("mnist-validation").load()
    assert len(x) == data.MNIST_VALIDATION == len(y) and len(data.dataset("mnist-train").load()[0]) == 3500


def test_gate_cases_are_tagged_by_role_and_the_worst_image_is_named() -> None:
    card = get_spec("csc-denoiser").card
    cases = gates.gate_cases(card, max_hw=(48, 48))
    assert {c.role for c in cases} == {"validation", "stress"}
    stress_images = set(data.DENOISE_STRESS_IMAGES) | set(stress_patterns.pattern_set("gate"))
    assert {c.image for c in cases if c.role == "stress"} == stress_images
    assert not {c.image for c in cases} & set(data.DENOISE_TEST_IMAGES)  # nothing is chosen on the test set
    assert {c.role for c in gates.gate_cases(card, "test", max_hw=(48, 48))} == {"test"}

    def damage_the_phantom(feeds, _cases=cases):  # the "candidate" blurs one image only
        case = next(c for c in _cases if c.feeds is feeds)
        out = feeds["noisy"].copy()
        return 0.5 * out + 0.5 * out.mean() if case.image == "shepp_logan_phantom" else out

    refs = [c.feeds["noisy"] for c in cases]  # the "reference" returns its input: other images lose exactly 0
    res = gates.evaluate(card, cases, refs, damage_the_phantom, card.gate("int8"))
    assert res.metrics["worst_image"].startswith("stress/shepp_logan_phantom σ=")
    assert res.metrics["per_image"]["validation/sklearn_china"]["worst_loss_db"] == 0.0
    assert len(res.metrics["per_image"]) == len(data.DENOISE_VALIDATION_IMAGES) + len(stress_images)
    assert any(f.startswith("psnr_loss_db_worst ") and "stress/shepp_logan_phantom" in f for f in res.failures)


# ------------------------------------------------------------------------------------------ INT8 on the stress set

#: Small crops keep the quantize search fast; the phantom's crop keeps its bright skull ring and dark interior.
CROP = 160


def _cropped(ds_id: str, names: tuple[str, ...]) -> data.Dataset:
    full = data.dataset(ds_id)

    def load() -> dict[str, np.ndarray]:
        imgs = full.load()
        return {n: gates._center_crop(imgs[n], (CROP, CROP)) for n in names}

    return data.Dataset(ds_id, "images", full.description + " (test crops)", load)


@pytest.fixture()
def small_denoiser_sets(monkeypatch, demo_onnx_dir: Path, tmp_path: Path) -> Path:
    monkeypatch.setitem(data.DATASETS, "denoise-validation",
                        _cropped("denoise-validation", ("sklearn_china", "mpl_mri")))
    monkeypatch.setitem(data.DATASETS, "denoise-stress",
                        _cropped("denoise-stress", ("shepp_logan_phantom", "checkerboard")))
    monkeypatch.setitem(data.DATASETS, "denoise-test", _cropped("denoise-test", ("camera", "brick")))
    shutil.copy(demo_onnx_dir / "csc-denoiser.onnx", tmp_path / "csc-denoiser.onnx")
    return tmp_path


@pytest.mark.slow
@pytest.mark.timeout(600)  # two INT8 quantizations with gates; ~2.5 min on a busy 2-core machine
def test_all_int8_fails_the_worst_image_gate_and_the_chosen_placement_passes(small_denoiser_sets: Path) -> None:
    """The INT8 the mean-only gate on natural images took (all weighted ops INT8, percentile calibration) loses
    far more than 0.15 dB on the stress set; quantize tries other placements and calibrations until one passes on
    every image (which one depends on the graph: layers kept in FP32, or another calibration method)."""
    src = small_denoiser_sets / "csc-denoiser.onnx"
    card = from_onnx(src)
    cases = gates.gate_cases(card)
    refs = gates.reference_outputs(cases, gates.onnxruntime_run(src, card.output))
    feeds = calibration_inputs(card, 32)
    old = to_int8(src, feeds, [], small_denoiser_sets / "old.onnx", method="percentile")
    res = gates.evaluate(card, cases, refs, gates.onnxruntime_run(old, card.output), gates.tolerances(card, "int8"))
    assert not res.passed and res.metrics["worst_image"].startswith("stress/")
    assert res.metrics["psnr_loss_db_worst"] > 0.15

    r = quantize("csc-denoiser", "int8", small_denoiser_sets, calib=32)
    assert r["passed"] and r["metrics"]["psnr_loss_db_worst"] <= 0.15 * 0.8, r["chosen"]
    assert r["tries"][0]["config"].startswith("all weighted ops in INT8") and r["tries"][0]["failures"]
    assert r["chosen"] != r["tries"][0]["config"], "all-INT8 (percentile) fails the stress set"
    assert all(v["worst_loss_db"] <= 0.15 for v in r["metrics"]["per_image"].values())
    assert {v["role"] for v in r["metrics"]["per_image"].values()} == {"validation", "stress"}
    assert r["gate_data"].startswith("card.data.validation = denoise-validation + card.data.stress = denoise-stress")
    test = r["test"]["metrics"]["per_image"]  # measured for the report only
    assert set(test) == {"test/camera", "test/brick"} and "reported only" in r["test"]["note"]
    model = onnx.load(small_denoiser_sets / "csc-denoiser.int8.onnx")
    assert from_onnx(model).data.stress == "denoise-stress"
