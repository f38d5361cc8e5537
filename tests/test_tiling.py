"""Tiling (unroll/tiling.py, the card's ``tiling``): windows cover every pixel once, the denoiser's margin covers
its measured receptive field, and windows stitched back equal the whole image within the export's parity
tolerance — while a card that leaves out the filler strip or shrinks the margin does not (so the check can fail)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from unroll.card import TileCard, from_onnx
from unroll.export.onnx_export import MAX_ABS_ERR, MAX_REL_ERR, ExportError, _check_tiling
from unroll.tiling import Tiler, run_tiled, spans


@pytest.mark.parametrize("length", [16, 447, 448, 449, 450, 900, 1031, 2048, 2049])
@pytest.mark.parametrize(("size", "margin", "align"), [(448, 20, 2), (100, 20, 2), (64, 0, 1), (97, 10, 3)])
def test_spans_cover_each_pixel_once_on_the_grid(length: int, size: int, margin: int, align: int) -> None:
    got = spans(length, size, margin, align)
    assert got[0].keep_lo == 0 and got[-1].keep_hi == length
    assert all(a.keep_hi == b.keep_lo for a, b in zip(got, got[1:], strict=False))  # no gap, no overlap
    assert len({s.stop - s.start for s in got}) == 1 and got[0].stop - got[0].start <= size  # one window length
    for s in got:
        assert s.start % align == 0 and 0 <= s.start and s.stop <= length
        assert s.keep_lo >= (s.start + margin if s.start > 0 else 0)  # kept outputs see `margin` of real input
        assert s.keep_hi <= (s.stop - margin if s.stop < length else length)


@pytest.fixture(scope="module")
def denoiser(demo_onnx_dir: Path) -> tuple[ort.InferenceSession, object]:
    path = demo_onnx_dir / "csc-denoiser.onnx"
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]), from_onnx(path)


def receptive_radius(sess: ort.InferenceSession, size: int = 160) -> int:
    """How far (pixels) a change of one input pixel reaches in the output, at both phases of the stride-2 grid.
    The image mean is kept unchanged (a second pixel far away takes the opposite change)."""
    x = np.random.default_rng(0).random((1, 1, size, size), np.float32)
    sig = np.array([25 / 255], np.float32)
    y0 = sess.run(None, {"noisy": x, "sigma": sig})[0][0, 0]
    radius = 0
    for p in (size // 2, size // 2 + 1):
        x1 = x.copy()
        x1[0, 0, p, p] += 0.5
        x1[0, 0, 3, 3] -= 0.5
        d = np.abs(sess.run(None, {"noisy": x1, "sigma": sig})[0][0, 0] - y0)[20:-20, 20:-20]
        rows, cols = np.nonzero(d > 0)
        radius = max(radius, int(np.abs(rows + 20 - p).max()), int(np.abs(cols + 20 - p).max()))
    return radius


def test_denoiser_margin_covers_its_receptive_field(denoiser) -> None:
    sess, card = denoiser
    radius = receptive_radius(sess)
    assert 0 < radius <= card.tiling.margin, (radius, card.tiling)


def _noisy_photo(h: int, w: int) -> np.ndarray:
    from unroll.data import add_noise, bundled_image

    clean = np.tile(bundled_image("camera"), (3, 3))[:h, :w]
    return add_noise(clean, 25.0, 0).astype(np.float32)[None, None]


def _errors(sess, x: np.ndarray, tiling: TileCard) -> tuple[float, float]:
    sig = {"sigma": np.array([25 / 255], np.float32)}

    def run(b: np.ndarray, more: dict) -> np.ndarray:
        return sess.run(None, {"noisy": b, **more})[0]

    whole = run(x, sig)
    diff = np.abs(run_tiled(x, sig, run, tiling).astype(np.float64) - whole)
    return float(diff.max()), float(np.linalg.norm(diff) / np.linalg.norm(whole))


@pytest.mark.parametrize(("h", "w", "size"), [(512, 512, 128), (333, 517, 100), (700, 130, 96), (97, 1000, 64)])
def test_windows_stitched_back_equal_the_whole_image(denoiser, h: int, w: int, size: int) -> None:
    sess, card = denoiser
    tiling = card.tiling.model_copy(update={"size": size})  # small windows: many of them on a small image
    assert Tiler(h, w, tiling).needed
    abs_err, rel_err = _errors(sess, _noisy_photo(h, w), tiling)
    assert abs_err <= MAX_ABS_ERR and rel_err <= MAX_REL_ERR, (abs_err, rel_err)


@pytest.mark.parametrize("wrong", [{"mean_centred": False}, {"margin": 12}])
def test_a_wrong_tiling_claim_breaks_parity_and_the_export_refuses_it(denoiser, demo_onnx_dir: Path,
                                                                      wrong: dict) -> None:
    import torch

    sess, card = denoiser
    bad = card.tiling.model_copy(update=wrong)
    abs_err, _ = _errors(sess, _noisy_photo(333, 517), bad.model_copy(update={"size": 100}))
    assert abs_err > 10 * MAX_ABS_ERR

    class Case:  # the export's first parity case, as far as the check reads it
        inputs = {"sigma": torch.tensor([0.1])}

    blob = (demo_onnx_dir / "csc-denoiser.onnx").read_bytes()
    with pytest.raises(ExportError, match="card.tiling"):
        _check_tiling(blob, card.model_copy(update={"tiling": bad}), Case, ["noisy", "sigma"])


def test_export_records_the_tiling_check(demo_onnx_dir: Path) -> None:
    import json

    rep = json.loads((demo_onnx_dir / "csc-denoiser.report.json").read_text())["tiling"]
    assert rep["ok"] and rep["windows"] > 1 and rep["max_abs_err"] <= MAX_ABS_ERR


def test_openvino_gives_memory_back_when_idle(demo_onnx_dir: Path) -> None:
    """After a batch of windows, the runtime's buffers (≈ 0.5 KB per pixel) go back once it has been idle."""
    code = f"""
import time, numpy as np
from unroll.serving.runtimes import open_session
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) * 1024
run = open_session({str(demo_onnx_dir / 'csc-denoiser.onnx')!r}, 'openvino', 2, release_idle_s=0.5)
x = np.random.default_rng(0).random((4, 1, 468, 448), np.float32)
run({{'noisy': x[:1, :, :32, :32], 'sigma': np.full(1, 0.1, np.float32)}})
time.sleep(1.0)
idle = rss()
run({{'noisy': x, 'sigma': np.full(4, 0.1, np.float32)}})
busy = rss()
time.sleep(1.5)
print(idle, busy, rss())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    idle, busy, after = map(int, out.stdout.split())
    assert busy - idle > 200 * 2 ** 20, (idle, busy)  # the batch took memory (so giving it back means something)
    assert after - idle < 64 * 2 ** 20, (idle, busy, after)
