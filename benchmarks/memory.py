"""``unroll bench memory``: the whole service's memory under the largest denoise requests it accepts.

One ``unroll serve`` subprocess at its defaults (gateway, supervised Triton and its Python-backend processes, and
the warm standby tritonserver when its memory rule starts one, :mod:`unroll.serving.standby`; the demo denoiser,
spare ports, a temporary folder) is measured idle, then ``requests`` clients (the load engine's closed loop,
:mod:`.loadgen`) each send one maximum-size image at once (a noisy colour photo of ``UNROLL_MAX_PIXELS`` pixels,
2048×2048 at the default), then it is measured again after ``settle_s`` seconds without traffic. Memory is the sum
of the **proportional set size** (PSS, from ``/proc/PID/smaps_rollup``) of every process of the service — the
``unroll serve`` process tree: gateway, ``tritonserver`` and its stubs, with the runtimes' arenas — sampled every
``interval_s``; PSS counts the shared memory that Triton and its stubs both map once, where summing RSS would count
it twice.

The run passes when every request got 200, the peak stays under ``peak_limit_bytes`` and the service returns to
within ``return_limit_bytes`` of its idle footprint. Results: ``benchmarks/results/memory.{json,md}``.
"""

from __future__ import annotations

import io
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from unroll import tasks
from unroll.benchmarks import loadgen
from unroll.benchmarks.common import demo_model, machine_info, write_results
from unroll.benchmarks.processes import descendants, kind_of
from unroll.benchmarks.soak import start_serve, stop_serve

GIB = 1024 ** 3
MIB = 1024 ** 2
#: The targets (issue "first contact", memory): 4 GiB peak for 20 maximum-size requests, back within 500 MiB.
PEAK_LIMIT_BYTES = 4 * GIB
RETURN_LIMIT_BYTES = 500 * MIB
REQUEST_TIMEOUT_S = 900.0


def pss_bytes(pid: int) -> int:
    """A process's proportional set size (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def service_bytes(root: int) -> dict[str, int]:
    """PSS of the service below ``root`` by process kind (gateway, tritonserver, backend stubs) and in all."""
    parts = {"gateway": 0, "tritonserver": 0, "backends": 0}
    for pid in descendants(root):
        kind = kind_of(pid)
        if kind is not None:
            parts["gateway" if kind == "client" else kind] += pss_bytes(pid)
    parts["total"] = sum(parts.values())
    return parts


def noisy_photo(pixels: int, sigma: float = 25.0, seed: int = 0) -> bytes:
    """A noisy colour photo (scikit-image's astronaut, Lanczos-enlarged) of ``side²`` ≤ ``pixels`` pixels, as PNG."""
    from skimage import data

    side = int(pixels ** 0.5)
    img = Image.fromarray(data.astronaut()).resize((side, side), Image.Resampling.LANCZOS)
    x = np.asarray(img, np.float32) + np.random.default_rng(seed).normal(0.0, sigma, (side, side, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(np.rint(x), 0, 255).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@dataclass
class Sampler:
    """Samples :func:`service_bytes` in a thread; ``peak`` is the largest total seen, with its split."""

    root: int
    interval_s: float = 0.1

    def __post_init__(self) -> None:
        self.peak: dict[str, int] = {"total": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = service_bytes(self.root)
            if now["total"] > self.peak["total"]:
                self.peak = now
            self._stop.wait(self.interval_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run(requests: int = 20, max_pixels: int = 2048 * 2048, settle_s: float = 8.0,
        peak_limit_bytes: int = PEAK_LIMIT_BYTES, return_limit_bytes: int = RETURN_LIMIT_BYTES,
        out: Path | None = None, log=print) -> dict:
    """Measure (module docstring); returns the results and writes them into ``out`` unless it is ``None``."""
    model = demo_model(tasks.DENOISING)
    body = noisy_photo(max_pixels)
    with tempfile.TemporaryDirectory(prefix="unroll-memory-") as tmp:
        os.environ.pop("UNROLL_MAX_PIXELS", None)
        serve = start_serve(Path(tmp), [model], log=log, standby=None)  # the default deployment, standby as it chose
        try:
            time.sleep(2.0)
            idle = service_bytes(serve.proc.pid)
            log(f"idle: {idle['total'] / MIB:.0f} MiB; sending {requests} requests of {len(body) / MIB:.1f} MiB")
            statuses: list[int] = []
            latencies: list[float] = []
            refusals: list[str] = []  # what each non-200 said: a failure names its cause

            def answered(a: loadgen.Answer) -> None:
                o = a.outcome
                statuses.append(o.status or 0)
                if o.status != 200:
                    refusals.append(f"{o.status}: {o.detail}" if o.status else f"no answer: {o.detail or o.cause}")
                latencies.append(a.end - a.start)

            # one burst: ``requests`` clients of the load engine's closed loop, one request each, all sent at once
            payload = loadgen.Payload(f"/v1/denoise?model={model}&sigma=25", body, {"Content-Type": "image/png"})
            t0 = time.perf_counter()
            with Sampler(serve.proc.pid) as sampler:
                loadgen.run(serve.base, [payload], loadgen.Load(concurrency=requests), 0.0, 0.0,
                            REQUEST_TIMEOUT_S, requests=requests, on_answer=answered)
            wall = time.perf_counter() - t0
            time.sleep(settle_s)
            after = service_bytes(serve.proc.pid)
            tritons = len(serve.triton_pids())
        finally:
            stop_serve(serve)
    peak = sampler.peak
    ok = statuses.count(200)
    result = {
        "machine": machine_info(threads=2), "model": model, "requests": requests, "image": {
            "pixels": max_pixels, "png_bytes": len(body), "mode": "RGB"},
        "deployment": {"standby_choice": serve.standby_choice, "tritonservers": tritons},
        "statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))}, "refusals": refusals,
        "wall_s": round(wall, 1),
        "latency_s": {"min": round(min(latencies), 2), "max": round(max(latencies), 2)},
        "idle_bytes": idle, "peak_bytes": peak, "after_bytes": after, "settle_s": settle_s,
        "limits": {"peak_bytes": peak_limit_bytes, "return_bytes": return_limit_bytes},
        "passed": {"all_200": ok == requests, "peak": peak["total"] <= peak_limit_bytes,
                   "returned": after["total"] - idle["total"] <= return_limit_bytes},
    }
    if out is not None:
        write_results("memory", result, markdown(result), out)
    return result


def markdown(r: dict) -> str:
    def mib(b: int) -> str:
        return f"{b / MIB:,.0f} MiB"

    rows = [f"| {k} | {mib(r['idle_bytes'][k])} | {mib(r['peak_bytes'].get(k, 0))} | {mib(r['after_bytes'][k])} |"
            for k in ("gateway", "tritonserver", "backends", "total")]
    return "\n".join([
        "# Whole-service memory under maximum-size denoise requests (`unroll bench memory`)", "",
        f"{r['requests']} concurrent requests, each a {r['image']['pixels']:,}-pixel noisy RGB photo "
        f"({r['image']['png_bytes'] / MIB:.1f} MiB PNG), to `{r['model']}` at the default settings; memory is the "
        "PSS of every process of `unroll serve` (gateway, tritonserver, Python-backend processes), sampled every "
        f"0.1 s; *after* is {r['settle_s']:g} s after the last answer.", "",
        f"Deployment: the default `unroll serve`, {r['deployment']['tritonservers']} tritonserver(s) "
        f"(the rows add them up): `{r['deployment']['standby_choice']}`", "",
        "| process | idle | at the peak | after |", "|---|---|---|---|", *rows, "",
        f"Statuses: {r['statuses']}; all answered in {r['wall_s']} s (latency {r['latency_s']['min']}–"
        f"{r['latency_s']['max']} s).", "",
        f"Limits: peak ≤ {mib(r['limits']['peak_bytes'])} → {'met' if r['passed']['peak'] else '**not met**'}; "
        f"back within {mib(r['limits']['return_bytes'])} of idle → "
        f"{'met' if r['passed']['returned'] else '**not met**'}; every request 200 → "
        f"{'met' if r['passed']['all_200'] else '**not met**'}.", ""])
