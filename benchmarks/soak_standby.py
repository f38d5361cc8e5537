"""The soak's standby parts: waiting for every server, their memory and versions; and phase 5, ``--no-standby``.

Phases 1 to 4 run on the default ``unroll serve``, which starts a warm standby where the machine's memory allows it
(:mod:`unroll.serving.standby`): a second tritonserver keeps the models warm and the gateway moves its calls to it
when the one in use loses a backend process or dies. A standby covers one failure at a time, so before each kill the
soak waits until every server is ready again (:func:`both_ready`; a second failure within the restart of the first is
an ordinary restart). Phase 5 shows what the standby saves: the same stub kills and tritonserver kills against a new
``unroll serve --no-standby``, where a dead stub replaces the whole server (Triton 2.45 cannot restart one stub
safely, :mod:`unroll.serving.supervisor`) and every kill costs 503s until it has reloaded every model. Its fault
windows are judged against the same :data:`~unroll.benchmarks.soak_stub.TARGET_503_S` and shown met or not met;
the soak's verdict is the default deployment's, with phase 5 required only to lose nothing and leave nothing behind.
It records the memory each server holds (resident set of its processes, summed).
"""

from __future__ import annotations

import json
import time
import urllib.request

from unroll.benchmarks import soak_stub
from unroll.serving.triton import RESTRICTED_HEADER

#: How long the soak waits for every server to be ready before a kill.
BOTH_READY_TIMEOUT_S = 120.0


def both_ready(http_ports: list[int], timeout_s: float = BOTH_READY_TIMEOUT_S) -> float:
    """Wait until every tritonserver on ``http_ports`` answers ready; the seconds it took. Raises ``TimeoutError``."""
    t0 = time.monotonic()
    while True:
        if all(_ready(p) for p in http_ports):
            return round(time.monotonic() - t0, 2)
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"tritonservers on {http_ports} not all ready after {timeout_s:g} s")
        time.sleep(0.1)


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def served_versions(http_port: int, key: str, model: str) -> list[int]:
    """The versions of ``model`` the tritonserver on ``http_port`` serves (READY in its repository index)."""
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v2/repository/index", data=b"{}", method="POST",
                                 headers={RESTRICTED_HEADER: key, "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        index = json.loads(r.read())
    return sorted(int(m["version"]) for m in index if m.get("name") == model and m.get("state") == "READY")


def summary(stubs: list[dict], rounds: list[dict], memory_mb: dict[str, float], choice: str,
            target_s: float) -> dict:
    """Phase 5's account: every kill's fault window against ``target_s`` (met or not, not required), and whether it
    lost nothing and recovered from every kill (``correct``: required of any deployment)."""
    windows = [x["window_s"] for x in stubs] + [r["window_s"] for r in rounds]
    p = {"stub_kills": stubs, "rounds": rounds, "memory_mb": memory_mb, "choice": choice, "target_503_s": target_s,
         "ok": sum(x["ok"] for x in stubs) + sum(r["ok"] for r in rounds),
         "unavailable_503": sum(x["unavailable_503"] for x in stubs) + sum(r["unavailable_503"] for r in rounds),
         "lost": sum(x["lost"] for x in stubs) + sum(r["lost"] for r in rounds),
         "longest_window_s": max((w for w in windows if w is not None), default=None),
         "kills": len(windows), "windows_met": sum(1 for w in windows if w is not None and w <= target_s)}
    p["correct"] = (p["lost"] == 0 and None not in windows
                    and all(x["requests_after_recovery"] >= soak_stub.SERVED_AFTER for x in stubs)
                    and all(r["recovered"] for r in rounds))
    return p


def markdown(p: dict | None, round_rows: list[str]) -> list[str]:
    """Phase 5's lines of ``soak.md`` (none when the run had no phase 5); ``round_rows``: its tritonserver kills as
    phase 2's table shows them."""
    if not p:
        return []
    mem = ", ".join(f"{k}: {v:,.0f} MiB" for k, v in p["memory_mb"].items())
    return [
        "## Phase 5: the same kills on `unroll serve --no-standby` (one tritonserver)", "",
        f"What the standby saves. `{p['choice']}`", "",
        *soak_stub.markdown(p["stub_kills"], "Phase 5a: a backend process killed"),
        "### Phase 5b: tritonserver killed (SIGKILL) under mixed traffic", "", *round_rows, "",
        f"- memory (resident, the server and its backend processes, once ready): {mem}",
        f"- **lost: {p['lost']}**; fault windows within {p['target_503_s']:g} s: **{p['windows_met']} of "
        f"{p['kills']}** kills; the longest **{p['longest_window_s']} s**",
        "- phase 5 **" + ("lost nothing and recovered every time" if p["correct"] else
                          "FAILED: it lost requests or did not recover")
        + "** (its windows are shown, not required: the soak judges the default deployment)", "",
    ]
