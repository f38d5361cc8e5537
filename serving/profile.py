"""The TensorRT optimization profile a GPU model is served with, as ``unroll repo`` writes it into the config.

A TensorRT engine (a plan, or the one ONNX Runtime's TensorRT provider builds at load) covers one range of
input shapes and nothing outside it. ``unroll repo --target gpu`` records that range in the Triton config as
the parameter :data:`PROFILE_KEY`: JSON ``{"source": "...", "inputs": {NAME: {"min": [...], "opt": [...],
"max": [...]}}}``, full shapes with the batch axis first (a per-sample ``[B]`` input such as λ or σ is
``[b]``). Its source is the plan's JSON (``build/trt/NAME.PRECISION.json``, written by ``unroll build``) when
a plan is served, else the card's ``trt_profile`` (the shapes the config hands ONNX Runtime's TensorRT
provider). CPU configs carry none: ONNX Runtime on the CPU takes any shape.

The gateway reads it (``unroll.serving.gateway.triton_client.model_info``) to refuse an image outside the
profile with a 4xx naming the limit, and to split batches at the profile's largest batch, instead of passing
Triton a request TensorRT would fail. Dependency-free (json only): the gateway imports it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from unroll.errors import ProfileError

#: Triton config ``parameters`` key holding the served profile (GPU target only).
PROFILE_KEY = "unroll.profile"

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Range:
    """min/opt/max shape of one input (batch axis first)."""

    min: Shape
    opt: Shape
    max: Shape


@dataclass(frozen=True)
class ServedProfile:
    """The one optimization profile a GPU model's engine covers."""

    inputs: dict[str, Range]
    #: Where it came from: ``plan NAME.PRECISION.plan`` or ``card trt_profile``.
    source: str = ""

    @property
    def max_batch(self) -> int:
        """The largest batch every input takes (axis 0)."""
        return min(r.max[0] for r in self.inputs.values())

    @property
    def min_batch(self) -> int:
        return max(r.min[0] for r in self.inputs.values())

    def hw(self, name: str) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """``((min_h, min_w), (max_h, max_w))`` of an ``[N, C, H, W]`` input, else ``None``."""
        r = self.inputs.get(name)
        if r is None or len(r.max) != 4:
            return None
        return (r.min[2], r.min[3]), (r.max[2], r.max[3])

    def violations(self, shapes: dict[str, Shape]) -> list[str]:
        """Why ``shapes`` (full, batch included) do not fit the profile: one sentence per input, [] when they do."""
        out = []
        for name, shape in shapes.items():
            r = self.inputs.get(name)
            if r is None:
                continue
            if len(shape) != len(r.max) or any(not lo <= d <= hi for lo, d, hi in zip(r.min, shape, r.max,
                                                                                       strict=False)):
                out.append(f"input {name!r} of shape {list(shape)} lies outside the TensorRT optimization profile "
                           f"(min {list(r.min)}, max {list(r.max)})")
        return out

    # ------------------------------------------------------------------ serialisation

    def to_json(self) -> str:
        return json.dumps({"source": self.source, "inputs": {
            n: {"min": list(r.min), "opt": list(r.opt), "max": list(r.max)} for n, r in self.inputs.items()}},
            separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, where: str = "profile") -> ServedProfile:
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ProfileError(f"{where}: {PROFILE_KEY} is not JSON ({e})") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("inputs"), dict):
            raise ProfileError(f"{where}: {PROFILE_KEY} needs an object with 'inputs'")
        return cls(from_plan_profile(raw["inputs"], where), str(raw.get("source", "")))


def from_plan_profile(profile: object, where: str) -> dict[str, Range]:
    """``{name: {"min": [...], "opt": [...], "max": [...]}}`` (a plan JSON's ``profiles[0]``) → checked ranges."""
    if not isinstance(profile, dict) or not profile:
        raise ProfileError(f"{where}: a profile maps each input name to its min/opt/max shapes")
    out = {}
    for name, r in profile.items():
        try:
            shapes = [tuple(int(d) for d in r[k]) for k in ("min", "opt", "max")]
        except (TypeError, KeyError, ValueError):
            raise ProfileError(f"{where}: input {name!r} needs integer lists min, opt and max") from None
        lo, mid, hi = shapes
        if not len(lo) == len(mid) == len(hi) or not lo or any(
                not 0 < a <= b <= c for a, b, c in zip(lo, mid, hi, strict=True)):
            raise ProfileError(f"{where}: input {name!r} needs 0 < min ≤ opt ≤ max per axis, same rank "
                               f"(got {list(lo)} / {list(mid)} / {list(hi)})")
        out[str(name)] = Range(lo, mid, hi)
    return out
