"""The seeded stress patterns: the same pixels from the same seed, disjoint sets, and the report set held out of
every denoiser card's gate, calibration and training data."""

from __future__ import annotations

import hashlib

import numpy as np

from unroll import data, stress_patterns
from unroll.registry import get_spec


def _hashes(images) -> set[str]:
    return {hashlib.sha256(np.ascontiguousarray(a, np.float32).tobytes()).hexdigest() for a in images}


def test_a_pattern_is_its_seed_and_every_kind_is_drawn() -> None:
    for kind in stress_patterns.KINDS:
        a, b = stress_patterns.pattern(kind, 3), stress_patterns.pattern(kind, 3)
        assert a.dtype == np.float32 and a.shape == (stress_patterns.SIDE,) * 2
        assert np.array_equal(a, b) and 0.0 <= a.min() and a.max() <= 1.0
        assert a.std() > 0.02, f"{kind} seed 3 is flat"
        assert not np.array_equal(a, stress_patterns.pattern(kind, 4))


def test_the_gate_report_and_calibration_sets_are_disjoint_and_the_report_set_is_held_out() -> None:
    sets = {w: stress_patterns.pattern_set(w) for w in stress_patterns.SEEDS}
    per_set = len(stress_patterns.KINDS) * stress_patterns.PER_KIND
    hashes = {w: _hashes(s.values()) for w, s in sets.items()}
    assert all(len(h) == per_set for h in hashes.values())  # no two images of a set alike
    assert not (hashes["gate"] & hashes["report"]) and not (hashes["gate"] & hashes["calibration"])
    assert not (hashes["report"] & hashes["calibration"])
    card = get_spec("csc-denoiser").card
    assert card.data.calibration == "denoise-calibration" and card.data.stress == "denoise-stress"
    stress = _hashes(data.dataset(card.data.stress).load().values())
    calibration = _hashes(data.dataset(card.data.calibration).load().values())
    assert hashes["gate"] <= stress and hashes["calibration"] <= calibration  # gated and calibrated on
    for role in ("train", "calibration", "validation", "stress"):
        assert not hashes["report"] & _hashes(data.dataset(getattr(card.data, role)).load().values()), role
