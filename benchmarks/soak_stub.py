"""The soak's first phase: a model's Python-backend stub killed under load (issue 22); every phase's fault window.

Triton 2.45 could crash (SIGSEGV) when a stub was killed under large-image load, so ``unroll serve``'s supervisor
replaces the server the moment a stub dies (:mod:`unroll.serving.supervisor` says why); the gateway answers the
requests that were in the dead process with 503 + Retry-After, or, with a warm standby, sends them to the other
server. This phase checks that: :data:`CLIENTS` clients in closed loop denoise a noisy :data:`IMAGE_SIDE`² image (or
classify a digit), the model's stub is killed after :data:`LOAD_BEFORE_S`, and it passes when no request is lost,
the service recovered, and the **fault window** the clients saw (:func:`fault_window_s`) is at most
:data:`TARGET_503_S`. The supervisor's crash-loop back-off is reported beside the window, never taken out of it:
clients wait through it like through the rest.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from unroll import data
from unroll.benchmarks.common import png_bytes
from unroll.benchmarks.loadgen import Answer, HttpSender, LevelResult, Load, Outcome, Payload, run_level

if TYPE_CHECKING:
    from unroll.benchmarks.soak import ServeProcess

T = TypeVar("T")

#: Clients, image side, load before the kill, successes after the last failure that end the phase.
CLIENTS, IMAGE_SIDE, LOAD_BEFORE_S, SERVED_AFTER = 4, 512, 3.0, 20
#: Give up waiting for recovery after this long.
TIMEOUT_S = 60.0
#: The target (issues 22 and 55): the fault window (:func:`fault_window_s`) at most this long.
TARGET_503_S = 3.0
#: A client's pause after a 503 (as in the mixed phase).
BACKOFF_ON_503_S = 0.25
REQUEST_TIMEOUT_S = 60.0


def noisy_image(side: int = IMAGE_SIDE) -> bytes:
    """A bundled test image, ``side``² crop, with σ=25 noise, as PNG bytes."""
    name = next(n for n in data.DENOISE_TEST_IMAGES if min(data.bundled_image(n).shape[:2]) >= side)
    img = data.bundled_image(name)[:side, :side]
    return png_bytes(data.add_noise(img, 25.0, data.noise_seed(name, 25.0)))


def fault_window_s(results: list[dict], at: float | None) -> float:
    """The window of non-200 answers the clients saw: from ``at`` (the kill or stop) or the first non-200 answer,
    whichever is earlier, to the last non-200 answer (``end`` times; lost requests count too); 0 when all were 200."""
    bad = [r["end"] for r in results if r["status"] != 200]
    if not bad:
        return 0.0
    return round(max(bad) - min(bad + ([at] if at is not None else [])), 2)


def answers(results: list[dict], examples: tuple[str, ...] = ("status", "code")) -> dict:
    """How the clients' requests were answered: ``ok`` (200), ``unavailable_503`` (the documented 503; of them
    ``unavailable_with_retry_after``), and ``lost``, anything else, with the ``examples`` fields of the first 10
    lost (``lost_examples``)."""
    failed = [r for r in results if r["status"] != 200]
    unavailable = [r for r in failed if r["status"] == 503]
    lost = [r for r in failed if r["status"] != 503]
    return {"ok": len(results) - len(failed), "unavailable_503": len(unavailable),
            "unavailable_with_retry_after": sum(1 for r in unavailable if r["retry_after"]),
            "lost": len(lost), "lost_examples": [{k: r[k] for k in examples} for r in lost[:10]]}


def non200_offsets(results: list[dict], at: float) -> list[float]:
    """When each non-200 answer came, in seconds from ``at`` (negative: before it), in order: the raw data of the
    fault window, kept in the results so that it can be re-derived from them."""
    return sorted(round(r["end"] - at, 3) for r in results if r["status"] != 200)


class _CountingSender(HttpSender):
    """The engine's HTTP sender, counting the requests it has started (a conductor acts after so many)."""

    def __init__(self, base_url: str, timeout_s: float) -> None:
        super().__init__(base_url, timeout_s)
        self.started = 0

    async def send(self, p: Payload) -> Outcome:
        self.started += 1
        return await super().send(p)


class Traffic:
    """Closed-loop clients through a service while a conductor injects its faults: the engine's
    :func:`~unroll.benchmarks.loadgen.run_level` with ``clients`` in flight, sending ``payloads`` in turn, until the
    conductor is done. Every answer goes into :attr:`results` as it comes (``i``: its number in send order,
    ``kind``: the payload's tag, ``status``: ``None`` when no HTTP answer came, ``code``: the gateway's error code or
    how no answer came, ``retry_after``, and ``start``/``end`` on :func:`time.perf_counter`, the conductor's clock);
    after a 503 a client pauses :data:`BACKOFF_ON_503_S`, as one told to retry does."""

    def __init__(self, base_url: str, payloads: Sequence[Payload], clients: int,
                 timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.base_url, self.payloads, self.clients, self.timeout_s = base_url, payloads, clients, timeout_s
        self.results: list[dict] = []
        self.level: LevelResult | None = None
        self._sender: _CountingSender | None = None

    @property
    def started(self) -> int:
        """Requests sent so far (answered or not)."""
        return self._sender.started if self._sender is not None else 0

    def _record(self, a: Answer) -> None:
        o = a.outcome
        self.results.append({"i": a.i, "kind": getattr(a.payload, "tag", ""), "status": o.status, "code": o.code,
                             "retry_after": o.retry_after, "start": a.start, "end": a.end})

    @staticmethod
    def _pause(o: Outcome) -> float:
        return BACKOFF_ON_503_S if o.status == 503 else 0.0

    async def run(self, conductor: Awaitable[T]) -> T:
        """Send while ``conductor`` runs; its result, once every request in flight when it ended was answered."""
        until = asyncio.Event()
        async with _CountingSender(self.base_url, self.timeout_s) as sender:
            self._sender = sender
            level = asyncio.ensure_future(run_level(sender, self.payloads, Load(concurrency=self.clients), math.inf,
                                                    0.0, on_answer=self._record, until=until, pause=self._pause))
            try:
                return await conductor
            finally:
                until.set()
                self.level = await level


async def _drive(s: ServeProcess, path: str, body: bytes, victim_model: str,
                 log: Callable[[str], None]) -> tuple[list[dict], dict]:
    """Closed-loop clients, the kill, and the wait for recovery: every response, and what was killed when."""
    traffic = Traffic(s.base, [Payload(path, body, {"Content-Type": "image/png"})], CLIENTS)
    results = traffic.results
    kill: dict = {}

    async def conductor() -> None:
        await asyncio.sleep(LOAD_BEFORE_S)
        s.record()
        kill["log_lines"] = len(s.output)
        kill["server_before"] = server = await asyncio.to_thread(s.triton_pid)
        pid = s.stub_pid(victim_model, server)
        if pid is None:
            log(f"no stub of {victim_model} found; nothing killed")
            return
        os.kill(pid, signal.SIGKILL)
        kill["at"], kill["pid"] = time.perf_counter(), pid
        log(f"kill -9 the Python-backend stub of {victim_model} (pid {pid}) under load")
        while time.perf_counter() - kill["at"] < TIMEOUT_S:
            await asyncio.sleep(0.1)
            last_failure = max((r["end"] for r in results if r["status"] != 200), default=kill["at"])
            if sum(1 for r in results if r["start"] > last_failure) >= SERVED_AFTER:
                break
        kill["servers_after"] = s.triton_pids()
        s.record()

    await traffic.run(conductor())
    return results, kill


def classify_load(classifier: str) -> tuple[str, bytes, str]:
    """The path, body and description of the classifier's load: one digit of its test split, top-1."""
    from unroll.registry import get_spec

    x, _ = data.dataset(get_spec(classifier).card.data.test).load()
    side = f"{x.shape[-2]}×{x.shape[-1]}"
    return f"/v1/classify?model={classifier}&top_k=1", png_bytes(x[0, 0]), f"classify a {side} digit (top-1)"


def run_phase(s: ServeProcess, model: str, log: Callable[[str], None],
              load: tuple[str, bytes, str] | None = None) -> dict:
    """The phase against a running ``unroll serve``; its results (see the module doc). ``load``: path, body and a
    description of the clients' requests (default: ``model`` denoising a noisy :data:`IMAGE_SIDE`² image)."""
    path, body, what = load or (f"/v1/denoise?model={model}&sigma=25", noisy_image(),
                                f"denoise a noisy {IMAGE_SIDE}×{IMAGE_SIDE} image (σ=25)")
    results, kill = asyncio.run(_drive(s, path, body, model, log))
    killed_at = kill.get("at")
    failed = [r for r in results if r["status"] != 200]
    last_failure = max((r["end"] for r in failed), default=killed_at)
    after = [r for r in results if killed_at is not None and r["start"] > last_failure]
    serve_log = "".join(s.output[kill.get("log_lines", 0):])  # what unroll serve logged from the kill on
    restarts = re.findall(r"tritonserver(?: [AB])? restarted \(pid \d+\) and ready in ([\d.]+) s", serve_log)
    p = {
        "clients": CLIENTS, "load": what, "model": model,
        "kill": {"signal": "SIGKILL", "target": f"{model}'s Python-backend stub", "after_s": LOAD_BEFORE_S,
                 "done": killed_at is not None},
        "status_counts": dict(Counter(str(r["status"]) for r in results)),
        "error_codes": dict(Counter(r["code"] for r in results if r["code"])),
        **answers(results),
        # what the clients saw: from the kill (or an earlier non-200) to the last non-200 answer; judged
        "window_s": None if killed_at is None else fault_window_s(results, killed_at),
        "non200_s": [] if killed_at is None else non200_offsets(results, killed_at),
        # the supervisor's crash-loop backoff before this restart (0 for a first failure; it grows while failures
        # come less than a minute apart, as the rounds of a soak do): inside the window when clients wait for the
        # restart, reported beside it, never subtracted
        "restart_backoff_s": restart_backoff_s(serve_log),
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
    p["passed"] = (killed_at is not None and not p["lost"] and len(after) >= SERVED_AFTER
                   and p["window_s"] <= TARGET_503_S)
    return p


def restart_backoff_s(serve_log: str) -> float:
    """The backoff the supervisor announced before its latest restart in ``serve_log`` (``restarting tritonserver
    [A|B] in X s``); 0 when it has not restarted."""
    found = re.findall(r"restarting tritonserver(?: [AB])? in ([\d.]+) s", serve_log)
    return float(found[-1]) if found else 0.0


def met(window_s: float | None, target_s: float) -> str:
    """``met`` / ``**not met**`` for a fault window against its target (no window: nothing was killed, not met)."""
    return "met" if window_s is not None and window_s <= target_s else "**not met**"


def markdown(stubs: list[dict], title: str) -> list[str]:
    """The lines of ``soak.md`` for a phase of stub kills: one row per kill, the fault window judged on each."""
    if not stubs:
        return []
    first = stubs[0]
    rows = [f"| {x['model']} | {x['load']} | {x['ok']:,} | {x['unavailable_503']:,} | **{x['lost']}** | "
            f"**{x['window_s']}** | {met(x['window_s'], x['target_503_s'])} | "
            f"{x['restart_backoff_s']:g} | {'–' if x['restart_ready_s'] is None else x['restart_ready_s']} | "
            + ("replaced" if x["triton_replaced"] else "not replaced") + " |" for x in stubs]
    return [
        f"### {title}", "",
        f"{first['clients']} clients in closed loop; the model's Python-backend stub in the server that serves the "
        f"traffic is killed (SIGKILL) {first['kill']['after_s']:g} s in; each kill waits until every server is ready. "
        "The fault window runs from the kill to the last non-200 answer; the supervisor's crash-loop backoff (it "
        "grows while failures come less than a minute apart) is shown beside it, inside it, never taken out.", "",
        "| model | load | succeeded | 503 | lost | fault window (s) | ≤ "
        f"{first['target_503_s']:g} s | backoff (s) | new server ready in (s; –: after the phase ended) | its "
        "tritonserver |",
        "|---|---|---|---|---|---|---|---|---|---|", *rows, "",
        f"- {sum(x['unavailable_503'] == x['unavailable_with_retry_after'] for x in stubs)} of {len(stubs)} kills: "
        f"every 503 with Retry-After; every request started after a kill's last failure succeeded (at least "
        f"{min(x['requests_after_recovery'] for x in stubs):,} per kill)", "",
    ]
