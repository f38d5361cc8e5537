"""Check a card's ``tiling`` claim on the exported graph: windows stitched back equal the whole image.

The gateway cuts large images into windows (``unroll/tiling.py``) only because the card says the graph's
receptive field fits in the margin and whether it removes its input's mean. A wrong claim would silently change
every large image's result, so the export runs the graph both ways with ONNX Runtime on a seeded image several
windows large and refuses the card beyond the export's parity tolerance; the report records the errors.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from unroll.card import ModelCard
from unroll.tiling import Tiler, run_tiled


def tiling_parity(session: ort.InferenceSession, card: ModelCard, extra: dict[str, np.ndarray]) -> dict:
    """Max abs and norm-wise relative error of the tiled against the untiled output on one seeded image of
    ``(2·size + 37) × (size + 61)`` pixels (odd sides, both axes cut); ``extra``: the graph's other inputs for
    one item (e.g. σ)."""
    tiling = card.tiling
    assert tiling is not None
    h, w = 2 * tiling.size + 37, tiling.size + 61
    rng = np.random.default_rng(0)
    coarse = rng.random((card.input.shape[0], h // 32 + 2, w // 32 + 2))
    smooth = np.kron(coarse, np.ones((32, 32)))[:, :h, :w]  # a blocky scene with edges, plus noise
    x = np.clip(smooth + rng.normal(0.0, 0.1, smooth.shape), 0.0, 1.0).astype(np.float32)[None]
    name = card.input.name

    def run(batch: np.ndarray, more: dict[str, np.ndarray]) -> np.ndarray:
        return session.run([card.output], {name: batch, **more})[0]

    whole = run(x, extra)
    tiled = run_tiled(x, extra, run, tiling)
    diff = np.abs(tiled.astype(np.float64) - whole)
    tiler = Tiler(h, w, tiling)
    return {"image_hw": [h, w], "windows": len(tiler.windows()), "window_hw": list(tiler.window_hw),
            "max_abs_err": float(diff.max()),
            "rel_err": float(np.linalg.norm(diff) / max(np.linalg.norm(whole), 1e-30))}
