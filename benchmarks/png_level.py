"""Which zlib level the denoisers' PNG answers are written at: encode time against size, on real photos.

A denoised photo is smooth, so it compresses well, but zlib's higher levels buy a few percent of size for several
times the CPU. What an answer costs end to end is the server's encode time (CPU time of the encoding thread, so a
busy machine does not skew it) plus the time to send the bytes, which depends on the client's link: the level is
the one whose worst ratio to the best level, over the links in :data:`LINKS_MBIT_S` (a client on a 100 Mbit/s
line, a client in the same data centre on 1 Gbit/s), is least. ``unroll bench png-level`` writes
``png_level.{json,md}``; ``serving/imaging/images.py:PNG_LEVEL`` is this result, and a test keeps the two equal.
"""

from __future__ import annotations

import io
import statistics
import time
from pathlib import Path

import numpy as np
from PIL import Image

from unroll.benchmarks.common import RESULTS, machine_info, write_results

LEVELS = tuple(range(10))
#: Client links the choice must suit (Mbit/s).
LINKS_MBIT_S = (100.0, 1000.0)
#: Photos from scikit-image (gray and colour), denoised-looking: smoothed as a denoiser's output is.
PHOTOS = ("camera", "astronaut", "coffee", "chelsea")
SIDE = 512
REPEATS = 7


def _photos() -> dict[str, Image.Image]:
    from skimage import data, transform

    out = {}
    for name in PHOTOS:
        a = getattr(data, name)()
        a = transform.resize(a, (SIDE, SIDE) + a.shape[2:], anti_aliasing=True, preserve_range=True)
        out[name] = Image.fromarray(np.clip(np.rint(a), 0, 255).astype(np.uint8))
    return out


def _encode_ms(img: Image.Image, level: int) -> tuple[float, int]:
    times, size = [], 0
    for _ in range(REPEATS):
        buf = io.BytesIO()
        t0 = time.thread_time()
        img.save(buf, format="PNG", compress_level=level)
        times.append((time.thread_time() - t0) * 1e3)
        size = buf.tell()
    return statistics.median(times), size


def run(out_dir: Path | None = RESULTS) -> dict:
    """Encode every photo at every level; the chosen level has the least worst-case regret over the links."""
    photos = _photos()
    rows = []
    for level in LEVELS:
        cells = [_encode_ms(img, level) for img in photos.values()]
        enc = statistics.mean(c[0] for c in cells)
        size = statistics.mean(c[1] for c in cells)
        total = {str(int(m)): enc + size * 8 / (m * 1e6) * 1e3 for m in LINKS_MBIT_S}
        rows.append({"level": level, "encode_cpu_ms": enc, "bytes": size, "total_ms": total})
    best = {link: min(r["total_ms"][link] for r in rows) for link in rows[0]["total_ms"]}
    for r in rows:
        r["regret"] = max(r["total_ms"][link] / best[link] for link in best)
    chosen = min(rows, key=lambda r: r["regret"])["level"]
    payload = {"benchmark": "png_level", "machine": machine_info(1), "photos": list(PHOTOS), "side": SIDE,
               "links_mbit_s": list(LINKS_MBIT_S), "rows": rows, "chosen": chosen}
    if out_dir is not None:
        write_results("png_level", payload, markdown(payload), Path(out_dir))
    return payload


def markdown(p: dict) -> str:
    raw = p["side"] * p["side"]
    links = list(p["rows"][0]["total_ms"])
    lines = [f"# PNG level of denoised answers ({p['machine']['cpu']}, one thread)", "",
             f"Mean over {len(p['photos'])} scikit-image photos ({', '.join(p['photos'])}) at {p['side']}×{p['side']}; "
             f"encode: CPU ms of Pillow's encoder, median of {REPEATS}; encode + send at each client link. Regret: the "
             f"level's worst ratio to the best level over the links. Chosen (least regret): **{p['chosen']}**.", "",
             "| level | encode CPU ms | KiB | bytes/pixel | " + " | ".join(f"encode + send ms at {m} Mbit/s"
                                                                    for m in links) + " | regret |",
             "|---|---|---|---|" + "---|" * len(links) + "---|"]
    for r in p["rows"]:
        mark = " **(chosen)**" if r["level"] == p["chosen"] else ""
        lines.append(f"| {r['level']}{mark} | {r['encode_cpu_ms']:.2f} | {r['bytes'] / 1024:.0f} | "
                     f"{r['bytes'] / raw:.2f} | " + " | ".join(f"{r['total_ms'][m]:.2f}" for m in links)
                     + f" | {r['regret']:.2f} |")
    return "\n".join(lines) + "\n"
