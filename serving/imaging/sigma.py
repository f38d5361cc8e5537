"""Noise σ of an image for ``POST /v1/denoise`` without ``sigma``, and whether the image looks noise-like at all.

scikit-image's ``estimate_sigma`` (wavelet MAD of the finest diagonal ``db2`` band, averaged over the channels),
computed here with NumPy alone — the band is PyWavelets' ``dwtn(…, "db2")["dd"]`` (tests/test_sigma_band.py holds
them equal), so the serving path needs neither PyWavelets nor SciPy — and so that the images where it means nothing
are caught instead of giving NaN or a huge σ. Each rule that fires marks the estimate unreliable and is reported by
name (``X-Sigma-Rule``): ``constant-channel`` (no detail: counted as noise-free), ``mostly-flat`` (over half exactly
flat, e.g. line art: the median over all coefficients, zeros included), ``structured`` (one frequency holds most of
the band, e.g. a checkerboard: removed first) and ``above-range`` (clipped to the card's ``sigma.max``). The value is
always finite and within ``[0, limit]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: Daubechies-2's decomposition high-pass filter (PyWavelets' ``Wavelet("db2").dec_hi``).
DB2_HIGH_PASS = np.array([-0.48296291314453416, 0.8365163037378079, -0.2241438680420134, -0.12940952255126037])
#: Φ⁻¹(3/4): the MAD of a standard normal variable (scikit-image's ``scipy.stats.norm.ppf(0.75)``).
MAD_OF_NORMAL = 0.6744897501960817
#: Coefficients this small are float rounding, not detail (|coefficient| on the [0, 1] scale; one 16-bit step
#: of one pixel gives coefficients of 2.5e-7 and more, an 8-bit step 257 times that).
ROUNDING = 1e-7
#: A single frequency holding more than this share of the diagonal band's energy makes the image ``structured``:
#: white noise's largest bin holds about 2·ln(N/2)/N of N bins, well under half even for a 16×16 image.
PEAK_SHARE = 0.5
#: A channel with fewer than this share of non-zero diagonal coefficients is ``mostly-flat`` (noise is never flat,
#: so the non-zero ones are edges, whose median would read their contrast as σ).
FLAT_SHARE = 0.5
CONSTANT, MOSTLY_FLAT, STRUCTURED, ABOVE_RANGE = "constant-channel", "mostly-flat", "structured", "above-range"
#: Every rule, in the order they are reported.
RULES = (CONSTANT, MOSTLY_FLAT, STRUCTURED, ABOVE_RANGE)
#: The ``sigma`` query parameter's OpenAPI description: how σ is estimated and what each rule means.
QUERY_HELP = (
    "Noise standard deviation on the 0–255 scale, used as given. Omitted: estimated from the image (scikit-image's "
    "wavelet MAD, averaged over the colour channels), always finite and at most the model's largest σ (card "
    "`sigma.max`). `X-Sigma-Reliable: false` marks an image that does not look like a picture plus white noise, "
    "and `X-Sigma-Rule` names why (comma-separated when several apply): `constant-channel` (a channel without any "
    "detail, e.g. black, pure red, transparent black, 16-bit zeros: counted as noise-free; σ = 0 when all are), "
    "`mostly-flat` (most of a channel exactly flat, e.g. line art: measured with the flat part, usually 0), "
    "`structured` (one spatial frequency holds over half of the finest diagonal detail, e.g. a 1-pixel "
    "checkerboard: measured after removing it, 0 for a clean pattern), `above-range` (clipped to `sigma.max`). "
    "Pass `sigma` for such images."
)


@dataclass(frozen=True)
class SigmaEstimate:
    """σ on the [0, 1] scale, and the rules (:data:`RULES`) that made it unreliable (none: reliable)."""

    value: float
    rules: tuple[str, ...] = ()

    @property
    def reliable(self) -> bool:
        return not self.rules

    @property
    def rule(self) -> str | None:
        """The rules that fired, comma-separated (the ``X-Sigma-Rule`` header), or ``None``."""
        return ",".join(self.rules) or None


def estimate(planes: np.ndarray, limit: float = math.inf) -> SigmaEstimate:
    """σ of ``planes`` ``[C, H, W]`` (values in [0, 1]) on the [0, 1] scale, clipped to ``limit``; see the module
    docstring for the rules."""
    sigmas: list[float] = []
    rules: set[str] = set()
    for plane in planes:
        band = diagonal_band(plane)
        magnitude = np.abs(band)
        detail = magnitude[magnitude > ROUNDING]
        if detail.size == 0:
            rules.add(CONSTANT)
            continue
        if detail.size < FLAT_SHARE * band.size:
            rules.add(MOSTLY_FLAT)
            magnitude[magnitude <= ROUNDING] = 0.0
            detail = magnitude  # the zeros count: a flat region is evidence of no noise there
        sigma = float(np.median(detail)) / MAD_OF_NORMAL
        residual = _without_peaks(_interior(band, plane.shape))
        if residual is not None:
            rules.add(STRUCTURED)
            sigma = float(np.median(np.abs(residual))) / MAD_OF_NORMAL
        sigmas.append(sigma)
    value = float(np.mean(sigmas)) if sigmas else 0.0
    if value > limit:
        value = float(limit)
        rules.add(ABOVE_RANGE)
    return SigmaEstimate(value, tuple(r for r in RULES if r in rules))


def _high_pass(x: np.ndarray, axis: int) -> np.ndarray:
    """One level of ``db2``'s detail along ``axis`` as PyWavelets' ``symmetric`` mode computes it: half-sample
    symmetric extension, the filter, every other sample from the second, ``(n + 3) // 2`` coefficients, in the
    input's float precision. Only the kept samples are computed (memory: the extension and the output)."""
    x = np.moveaxis(x, axis, -1)
    taps = len(DB2_HIGH_PASS)
    ext = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(taps - 1, taps - 1)], mode="symmetric")
    m = (x.shape[-1] + taps - 1) // 2
    out = np.zeros(x.shape[:-1] + (m,), np.result_type(x.dtype, np.float32))
    for j, h in enumerate(DB2_HIGH_PASS):  # output k is full-convolution sample 1 + 2k: ext[taps - j + 2k]·h[j]
        out += float(h) * ext[..., taps - j:taps - j + 2 * m:2]
    return np.moveaxis(out, -1, axis)


def diagonal_band(plane: np.ndarray) -> np.ndarray:
    """The finest diagonal ``db2`` wavelet band of a 2-D ``plane`` (PyWavelets' ``dwtn(plane, "db2")["dd"]``)."""
    return _high_pass(_high_pass(np.asarray(plane), 0), 1)


def _interior(band: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The coefficients of a ``db2`` level-1 band computed from the image alone (index 1 … (n − 2) // 2 per axis):
    the others mix in the symmetric extension at the border."""
    return band[1:(shape[0] - 2) // 2 + 1, 1:(shape[1] - 2) // 2 + 1]


def _without_peaks(band: np.ndarray) -> np.ndarray | None:
    """``band`` with every frequency (and its mirror) that holds over :data:`PEAK_SHARE` of the energy left removed,
    or ``None`` when no frequency does (the band looks like noise)."""
    if band.size < 4:
        return None
    spectrum = np.fft.fft2(band)
    power = np.abs(spectrum) ** 2
    removed = False
    while (total := float(power.sum())) > 0.0:
        peak = np.unravel_index(int(np.argmax(power)), power.shape)
        mirror = tuple(int(-i) % n for i, n in zip(peak, power.shape, strict=True))
        share = float(power[peak] + (power[mirror] if mirror != peak else 0.0)) / total
        if share <= PEAK_SHARE:
            break
        spectrum[peak] = spectrum[mirror] = 0.0
        power[peak] = power[mirror] = 0.0
        removed = True
    return np.real(np.fft.ifft2(spectrum)) if removed else None
