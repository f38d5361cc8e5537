"""The soak's operating phases: a stalled tritonserver, and a model update, each under classify load.

Phase 3 stops ``tritonserver`` (SIGSTOP) for :data:`STALL_S` and resumes it: requests that need Triton must be
answered (503 with ``Retry-After``) within about the gateway's ``UNROLL_TRITON_STALL_S`` of the stop, never held to
the request deadline, and the supervisor must not replace a server that resumes before its unready limit (20 s).
Phase 4 runs ``unroll deploy`` of the classifier (a full swap to a new version) against the running service, found
from the state ``unroll serve`` left: nothing lost, and the same tritonserver throughout (a planned unload is not a
crash). Each passes when no request is lost and the fault window its clients saw (from the stop or the deployment's
start to the last non-200 answer, :func:`~unroll.benchmarks.soak_stub.fault_window_s`) is at most
:data:`~unroll.benchmarks.soak_stub.TARGET_503_S`: a stop that outlasts the stall detection costs 503s until it ends,
unless a warm standby takes the calls.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from unroll.benchmarks import soak_stub
from unroll.benchmarks.common import unroll_command
from unroll.benchmarks.loadgen import Payload

if TYPE_CHECKING:
    from unroll.benchmarks.soak import ServeProcess

#: Clients in closed loop; how long Triton stays stopped; load before and after each action.
CLIENTS, STALL_S, SETTLE_S = 8, 8.0, 2.0
#: The gateway's default stall detection (``Settings.triton_stall_s``) is the target; answers may come this much
#: later on a loaded machine.
ANSWER_MARGIN_S = 1.0
REQUEST_TIMEOUT_S = 90.0


async def _drive(s: ServeProcess, path: str, body: bytes, action: Callable[[], Awaitable[dict]]) -> tuple[list, dict]:
    """:data:`CLIENTS` closed-loop clients (the load engine's, :class:`.soak_stub.Traffic`) posting ``body`` to
    ``path`` while ``action`` runs, and :data:`SETTLE_S` before and after it."""
    traffic = soak_stub.Traffic(s.base, [Payload(path, body, {"Content-Type": "image/png"})], CLIENTS,
                                REQUEST_TIMEOUT_S)

    async def conductor() -> dict:
        await asyncio.sleep(SETTLE_S)
        marks = await action()
        await asyncio.sleep(SETTLE_S)
        return marks

    marks = await traffic.run(conductor())
    return traffic.results, marks


def _counts(results: list[dict]) -> dict:
    """The answers' status codes and how they count (:func:`.soak_stub.answers`)."""
    return {"status_counts": dict(Counter(str(r["status"]) for r in results)), **soak_stub.answers(results)}


def stall_phase(s: ServeProcess, path: str, body: bytes, stall_s: float, log: Callable[[str], None]) -> dict:
    """Phase 3 (module docstring); ``stall_s``: the gateway's ``triton_stall_s``."""
    async def stop_and_resume() -> dict:
        pid = await asyncio.to_thread(s.triton_pid)  # it samples CPU for a moment: off the event loop
        assert pid is not None, "no tritonserver to stop"
        os.kill(pid, signal.SIGSTOP)
        stopped = time.perf_counter()
        log(f"kill -STOP tritonserver (pid {pid}) for {STALL_S:g} s")
        try:
            await asyncio.sleep(STALL_S)
        finally:
            os.kill(pid, signal.SIGCONT)
        return {"pid": pid, "stopped": stopped, "resumed": time.perf_counter()}

    results, m = asyncio.run(_drive(s, path, body, stop_and_resume))
    during = [r for r in results if r["end"] > m["stopped"] and r["start"] < m["resumed"]]
    # how long a request waited for an answer once Triton had stopped (from the later of its start and the stop;
    # one held until Triton resumed counts its whole wait)
    waits = [r["end"] - max(r["start"], m["stopped"]) for r in during]
    first_503 = min((r["end"] for r in during if r["status"] == 503), default=None)
    p = {"clients": CLIENTS, "stall_s": STALL_S, "detection_s": stall_s, **_counts(results),
         "first_503_after_stop_s": None if first_503 is None else round(first_503 - m["stopped"], 2),
         "longest_wait_s": round(max(waits, default=0.0), 2),
         "target_s": stall_s + ANSWER_MARGIN_S,
         "window_s": soak_stub.fault_window_s(results, m["stopped"]), "target_503_s": soak_stub.TARGET_503_S,
         "non200_s": soak_stub.non200_offsets(results, m["stopped"]),
         "triton_replaced": m["pid"] not in s.triton_pids(),
         "served_after": sum(1 for r in results if r["start"] > m["resumed"] and r["status"] == 200),
         # sent after the stall was detected and answered while the server was still stopped: only a warm standby
         # can answer these (the other server)
         "served_while_stopped": sum(1 for r in during if r["status"] == 200 and r["start"] > m["stopped"] + stall_s
                                     and r["end"] < m["resumed"])}
    p["passed"] = (not p["lost"] and p["longest_wait_s"] <= p["target_s"] and not p["triton_replaced"]
                   and p["served_after"] > 0 and p["unavailable_503"] == p["unavailable_with_retry_after"]
                   and p["window_s"] <= p["target_503_s"])
    return p


def deploy_phase(s: ServeProcess, model: str, log: Callable[[str], None]) -> dict:
    """Phase 4 (module docstring): ``unroll deploy MODEL`` of its current graph as a new version, under load."""
    root = s.repo.parent

    async def deploy() -> dict:
        pid, lines = await asyncio.to_thread(s.triton_pid), len(s.output)
        log(f"unroll deploy {model} under classify load")
        t0 = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            unroll_command(), "deploy", model, "--repo", str(s.repo), "--onnx-dir",
            str(s.onnx_dir), "--triton-key-file", str(s.onnx_dir.parent / "triton.key"), "--drain-s", "3",
            "--samples", "64", cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out, _ = await proc.communicate()
        return {"pid": pid, "lines": lines, "rc": proc.returncode, "output": out.decode(errors="replace")[-2000:],
                "started": t0, "seconds": round(time.perf_counter() - t0, 1)}

    x_path = f"/v1/classify?model={model}&top_k=1"
    results, m = asyncio.run(_drive(s, x_path, _digit(model), deploy))
    serve_log = "".join(s.output[m["lines"]:])  # what unroll serve logged from the deployment on
    p = {"clients": CLIENTS, "model": model, "deploy_rc": m["rc"], "deploy_s": m["seconds"],
         "deploy_output": m["output"], **_counts(results),
         "window_s": soak_stub.fault_window_s(results, m["started"]), "target_503_s": soak_stub.TARGET_503_S,
         "non200_s": soak_stub.non200_offsets(results, m["started"]),
         "triton_replaced": m["pid"] not in s.triton_pids() or "lost its Python-backend stub" in serve_log}
    p["passed"] = (m["rc"] == 0 and not p["lost"] and not p["unavailable_503"] and not p["triton_replaced"]
                   and p["window_s"] <= p["target_503_s"])
    return p


def _digit(model: str) -> bytes:
    from unroll import data
    from unroll.benchmarks.common import png_bytes
    from unroll.registry import get_spec

    x, _ = data.dataset(get_spec(model).card.data.test).load()
    return png_bytes(x[0, 0])


def markdown(stall: dict | None, deploy: dict | None) -> list[str]:
    """Phases 3 and 4's lines of ``soak.md``."""
    lines: list[str] = []
    if stall is not None:
        lines += [
            f"### Phase 3: tritonserver stopped (SIGSTOP) for {stall['stall_s']:g} s under classify load", "",
            f"{stall['clients']} clients in closed loop; the gateway's stall detection is {stall['detection_s']:g} s "
            "(`UNROLL_TRITON_STALL_S`).", "",
            f"- succeeded: {stall['ok']:,}; answered 503: {stall['unavailable_503']:,} "
            f"({stall['unavailable_with_retry_after']:,} with Retry-After); **lost: {stall['lost']}**",
            f"- first 503 {stall['first_503_after_stop_s']} s after the stop; **no request waited more than "
            f"{stall['longest_wait_s']} s** for its answer while Triton was stopped (target ≤ {stall['target_s']:g} s; "
            f"without the stall detection they waited until it resumed)",
            f"- **fault window {stall['window_s']} s** (from the stop to the last non-200 answer; target ≤ "
            f"{stall['target_503_s']:g} s: {'met' if stall['window_s'] <= stall['target_503_s'] else '**not met**'}); "
            f"{stall['served_while_stopped']:,} requests sent after the stall was detected were answered while it was "
            "still stopped (by the other server, when there is one)",
            "- tritonserver " + ("was replaced" if stall["triton_replaced"] else
                                 "was not replaced (it resumed before the supervisor's 20 s unready limit)")
            + f"; {stall['served_after']:,} requests succeeded after it resumed",
            f"- phase **{'passed' if stall['passed'] else 'FAILED'}**", ""]
    if deploy is not None:
        lines += [
            f"### Phase 4: `unroll deploy {deploy['model']}` (a full swap) under classify load", "",
            f"- the deployment took {deploy['deploy_s']} s (exit code {deploy['deploy_rc']}); succeeded: "
            f"{deploy['ok']:,}; answered 503: {deploy['unavailable_503']:,}; **lost: {deploy['lost']}**; fault window "
            f"{deploy['window_s']} s (target ≤ {deploy['target_503_s']:g} s)",
            "- tritonserver " + ("was replaced" if deploy["triton_replaced"] else
                                 "was the same throughout (the old version's unload is planned, not a crash)"),
            f"- phase **{'passed' if deploy['passed'] else 'FAILED'}**", ""]
    return lines
