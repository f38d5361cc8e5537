"""The soak's first phase: kill the denoiser's Python-backend stub under denoise load (issue 22).

Triton 2.45 could crash (SIGSEGV) when a stub was killed under large-image load, so ``unroll serve``'s supervisor
replaces the server the moment a stub dies (:mod:`unroll.serving.supervisor` says why) and the gateway answers the
requests that were in the dead process with 503 + Retry-After. This phase checks that: :data:`CLIENTS` clients in
closed loop denoise a noisy :data:`IMAGE_SIDE`² image, the stub is killed after :data:`LOAD_BEFORE_S`, and it passes
when no request is lost, the last 503 came within :data:`TARGET_503_S` of the kill, and the service recovered.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from unroll import data
from unroll.benchmarks.common import png_bytes

if TYPE_CHECKING:
    import httpx

    from unroll.benchmarks.soak import ServeProcess

#: Clients, image side, load before the kill, successes after the last failure that end the phase.
CLIENTS, IMAGE_SIDE, LOAD_BEFORE_S, SERVED_AFTER = 4, 512, 3.0, 20
#: Give up waiting for recovery after this long.
TIMEOUT_S = 60.0
#: The target (issue 22): the last 503 answered at most this long after the kill.
TARGET_503_S = 3.0
#: A client's pause after a 503 (as in the mixed phase).
BACKOFF_ON_503_S = 0.25
REQUEST_TIMEOUT_S = 60.0


def noisy_image(side: int = IMAGE_SIDE) -> bytes:
    """A bundled test image, ``side``² crop, with σ=25 noise, as PNG bytes."""
    name = next(n for n in data.DENOISE_TEST_IMAGES if min(data.bundled_image(n).shape[:2]) >= side)
    img = data.bundled_image(name)[:side, :side]
    return png_bytes(data.add_noise(img, 25.0, data.noise_seed(name, 25.0)))


def outcome(r: httpx.Response) -> tuple[int, str | None, str | None]:
    """``(status, error code, Retry-After)`` of an httpx response."""
    code = None
    if r.status_code >= 400 and r.headers.get("content-type", "").startswith("application/json"):
        code = r.json().get("error", {}).get("code")
    return r.status_code, code, r.headers.get("retry-after")


async def _drive(s: ServeProcess, path: str, body: bytes, victim_model: str,
                 log: Callable[[str], None]) -> tuple[list[dict], dict]:
    """Closed-loop clients, the kill, and the wait for recovery: every response, and what was killed when."""
    import httpx

    results: list[dict] = []
    kill: dict = {}
    done = asyncio.Event()

    async def client_loop(client: httpx.AsyncClient) -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            try:
                r = await client.post(path, content=body, headers={"Content-Type": "image/png"})
                status, code, retry_after = outcome(r)
            except httpx.HTTPError as e:
                status, code, retry_after = None, type(e).__name__, None
            results.append({"status": status, "code": code, "retry_after": retry_after, "start": t0,
                            "end": time.perf_counter()})
            if status == 503:
                await asyncio.sleep(BACKOFF_ON_503_S)

    async def conductor() -> None:
        await asyncio.sleep(LOAD_BEFORE_S)
        s.record()
        kill["server_before"] = server = s.triton_pid()
        pid = s.stub_pid(victim_model, server)
        if pid is None:
            log(f"no stub of {victim_model} found; nothing killed")
            done.set()
            return
        os.kill(pid, signal.SIGKILL)
        kill["at"], kill["pid"] = time.perf_counter(), pid
        log(f"kill -9 the Python-backend stub of {victim_model} (pid {pid}) under denoise load")
        while time.perf_counter() - kill["at"] < TIMEOUT_S:
            await asyncio.sleep(0.1)
            last_failure = max((r["end"] for r in results if r["status"] != 200), default=kill["at"])
            if sum(1 for r in results if r["start"] > last_failure) >= SERVED_AFTER:
                break
        kill["servers_after"] = s.triton_pids()
        s.record()
        done.set()

    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=s.base, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        await asyncio.gather(conductor(), *(client_loop(client) for _ in range(CLIENTS)))
    return results, kill


def run_phase(s: ServeProcess, denoiser: str, log: Callable[[str], None]) -> dict:
    """The phase against a running ``unroll serve``; its results (see the module doc)."""
    path = f"/v1/denoise?model={denoiser}&sigma=25"
    results, kill = asyncio.run(_drive(s, path, noisy_image(), denoiser, log))
    killed_at = kill.get("at")
    ok = [r for r in results if r["status"] == 200]
    failed = [r for r in results if r["status"] != 200]
    unavailable = [r for r in failed if r["status"] == 503]
    lost = [r for r in failed if r["status"] != 503]
    last_503 = max((r["end"] for r in unavailable), default=killed_at)
    last_failure = max((r["end"] for r in failed), default=killed_at)
    after = [r for r in results if killed_at is not None and r["start"] > last_failure]
    serve_log = "".join(s.output)
    restarts = re.findall(r"tritonserver restarted \(pid \d+\) and ready in ([\d.]+) s", serve_log)
    backoff = restart_backoff_s(serve_log)
    p = {
        "clients": CLIENTS, "image": f"{IMAGE_SIDE}×{IMAGE_SIDE}", "model": denoiser,
        "kill": {"signal": "SIGKILL", "target": f"{denoiser}'s Python-backend stub", "after_s": LOAD_BEFORE_S,
                 "done": killed_at is not None},
        "status_counts": dict(Counter(str(r["status"]) for r in results)),
        "error_codes": dict(Counter(r["code"] for r in results if r["code"])),
        "ok": len(ok), "unavailable_503": len(unavailable),
        "unavailable_with_retry_after": sum(1 for r in unavailable if r["retry_after"]),
        "lost": len(lost), "lost_examples": [{k: r[k] for k in ("status", "code")} for r in lost[:10]],
        # how long 503s went on: the last 503 answered, counted from the kill (0 when there was none)
        "unavailable_s": None if killed_at is None else round(last_503 - killed_at, 2),
        # the supervisor's crash-loop backoff before this restart (0 for a first failure; it grows while failures
        # come less than a minute apart, as the rounds of a soak do): waited on purpose, outside the target
        "restart_backoff_s": backoff,
        "unavailable_net_s": None if killed_at is None else round(last_503 - killed_at - backoff, 2),
        "recovery_s": None if killed_at is None else round(last_failure - killed_at, 2),
        "requests_after_recovery": len(after),
        # the supervisor's own account: how long the new server took from launch to ready (clients may see less
        # of it as 503s: a 512×512 request spends a while in the gateway before it reaches Triton)
        "restart_ready_s": float(restarts[-1]) if restarts else None,
        "target_503_s": TARGET_503_S, "backoff_on_503_s": BACKOFF_ON_503_S,
        "triton_replaced": "servers_after" in kill and kill.get("server_before") not in kill["servers_after"],
        "stub_loss_logged": "lost its Python-backend stub" in serve_log,
        "triton_crash_logged": "was killed by SIGSEGV" in serve_log or "was killed by SIGABRT" in serve_log,
    }
    p["passed"] = (killed_at is not None and not lost and len(after) >= SERVED_AFTER
                   and p["unavailable_net_s"] <= TARGET_503_S)
    return p


def restart_backoff_s(serve_log: str) -> float:
    """The backoff the supervisor announced before its latest restart (``restarting tritonserver in X s``); 0 when
    it has not restarted."""
    found = re.findall(r"restarting tritonserver in ([\d.]+) s", serve_log)
    return float(found[-1]) if found else 0.0


def markdown(p: dict, round_: int = 1, rounds: int = 1) -> list[str]:
    """Phase 1's lines of ``soak.md`` (one round of ``rounds``)."""
    rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(p["status_counts"].items()))
    how = ("the supervisor replaced tritonserver" if p["triton_replaced"] else "tritonserver was not replaced") + (
        " (it logged the lost stub)" if p["stub_loss_logged"] else "") + (
        "; tritonserver crashed first" if p["triton_crash_logged"] else "")
    return [
        f"## Phase 1: {p['model']}'s Python-backend stub killed (SIGKILL) under denoise load"
        + (f" (round {round_} of {rounds})" if rounds > 1 else ""),
        "",
        f"{p['clients']} clients in closed loop denoise a noisy {p['image']} image (σ=25); the stub is killed "
        f"{p['kill']['after_s']:g} s in.",
        "",
        "| status | requests |", "|---|---|", rows, "",
        f"- succeeded: {p['ok']:,}; answered 503: {p['unavailable_503']:,} "
        f"({p['unavailable_with_retry_after']:,} with Retry-After); {how}",
        f"- **lost** (neither success nor 503): **{p['lost']}**",
        f"- **last 503 answered {p['unavailable_s']} s after the kill**, of which {p['restart_backoff_s']:g} s the "
        f"supervisor's crash-loop backoff: **{p['unavailable_net_s']} s** without it (target ≤ "
        f"{p['target_503_s']:g} s); every "
        f"one of the {p['requests_after_recovery']:,} requests started after the last failure succeeded",
        f"- the new tritonserver was ready {p['restart_ready_s']} s after its launch (supervisor's log)",
        f"- phase **{'passed' if p['passed'] else 'FAILED'}**",
        "",
    ]
