"""Where images should be decoded on a GPU server (issue 37, "images on the GPU where it pays"): a photo encoded as
JPEG and as PNG at 512² and 2048², decoded as the gateway and the Python backend decode today (Pillow, to a NumPy
array) and by torchvision (``decode_jpeg`` on the device: nvJPEG on CUDA; ``decode_png`` on the CPU, which is where
torchvision decodes PNG). p50 ms per image, one at a time, wall clock until the pixels are there (a device decode
waits for its stream); the faster per format and size is what serving should use.
Empty, with the reason, where torchvision is missing (this machine's test venv)."""

from __future__ import annotations

import io
from collections.abc import Callable

import numpy as np

from unroll.benchmarks.gpu_check_device import time_runner

SIDES = (512, 2048)


def _photo(side: int) -> np.ndarray:
    from PIL import Image
    from skimage import data

    return np.asarray(Image.fromarray(data.astronaut()).resize((side, side), Image.Resampling.LANCZOS))


def _encoded(rgb: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def decoders(data: bytes, fmt: str, device: str) -> dict[str, tuple[str, Callable[[], object]]]:
    """The ways to decode ``data``: name → (where the pixels end up, the call)."""
    import torch
    import torchvision.io as tvio
    from PIL import Image

    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    ways = {"pillow": ("host", lambda: np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))}
    if fmt == "JPEG":
        ways["torchvision-cpu"] = ("host", lambda: tvio.decode_jpeg(raw))
        if device == "cuda":  # waited for: the pixels are there when the call returns, as a request needs them
            ways["nvjpeg"] = ("device", lambda: (tvio.decode_jpeg(raw, device="cuda"), torch.cuda.synchronize()))
    else:
        ways["torchvision-cpu"] = ("host", lambda: tvio.decode_png(raw))
    return ways


def decode_times(device: str, quick: bool) -> dict:
    """``{"rows": [...], "note": ...}``: per format, side and decoder, p50/p99 ms and whether it was the fastest."""
    try:
        import torchvision  # noqa: F401
    except ImportError as e:
        return {"rows": [], "note": f"not measured: torchvision is not importable here ({e})"}
    rows = []
    for side in SIDES[:1] if quick else SIDES:
        rgb = _photo(side)
        for fmt in ("JPEG", "PNG"):
            data = _encoded(rgb, fmt)
            measured = []
            for name, (lands, call) in decoders(data, fmt, device).items():
                t = time_runner(call, "cpu", 3, 10 if quick else 100, 0.5 if quick else 2.0)  # wall clock
                measured.append({"format": fmt.lower(), "side": side, "bytes": len(data), "decoder": name,
                                 "pixels_on": lands, "p50_ms": t["p50_ms"], "p99_ms": t["p99_ms"]})
            best = min(measured, key=lambda r: r["p50_ms"])
            rows += [{**r, "fastest": r is best} for r in measured]
    return {"rows": rows, "note": ""}


def markdown(d: dict) -> list[str]:
    """The section of ``gpu_serve.md``."""
    lines = ["", "## Decoding images: Pillow (today's path) against torchvision / nvJPEG", ""]
    if not d["rows"]:
        return [*lines, d["note"]]
    lines += ["| format | side | bytes | decoder | pixels on | p50 ms | p99 ms | fastest |",
              "| --- | ---: | ---: | --- | --- | ---: | ---: | --- |"]
    lines += [f"| {r['format']} | {r['side']} | {r['bytes']:,} | {r['decoder']} | {r['pixels_on']} | "
              f"{r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {'yes' if r['fastest'] else ''} |" for r in d["rows"]]
    return lines
