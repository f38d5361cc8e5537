"""The soak's fifth phase: the same kills against ``unroll serve --standby`` (issue 38, item 6).

Without a standby, a lost Python-backend process costs 503s until a new tritonserver has loaded every model (Triton
2.45 cannot restart one stub safely, :mod:`unroll.serving.supervisor`). With one, a second tritonserver keeps the
models warm and the gateway moves its calls to it. This phase starts such a service and, under load, kills the
denoiser's stub in the server that serves the traffic (as phase 1), kills that tritonserver under mixed traffic (as
phase 2), stops it (SIGSTOP, as phase 3: the requests waiting for it get 503 at the stall detection, the next ones go
to the other server while it is still stopped), and deploys a new classifier version (as phase 4), then asks both
servers which versions they serve. Before
each kill it waits until both servers are ready again: a standby covers one failure at a time, and a second failure
within the restart of the first is an ordinary restart. It records the memory each server holds (resident set of
its processes, summed). It passes when nothing is lost, every kill's 503s end within
:data:`~unroll.benchmarks.soak_stub.TARGET_503_S`, and both servers serve the deployed version.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

from unroll.serving.triton import RESTRICTED_HEADER, group_members

#: How long the phase waits for both servers to be ready before a kill.
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


def rss_mb(server_pid: int) -> float:
    """Resident memory of a tritonserver and its stubs, summed (MiB; shared pages count once per process)."""
    total_kb = 0
    for pid in group_members(server_pid):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total_kb += next((int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmRSS:")), 0)
    return round(total_kb / 1024, 1)


def served_versions(http_port: int, key: str, model: str) -> list[int]:
    """The versions of ``model`` the tritonserver on ``http_port`` serves (READY in its repository index)."""
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v2/repository/index", data=b"{}", method="POST",
                                 headers={RESTRICTED_HEADER: key, "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        index = json.loads(r.read())
    return sorted(int(m["version"]) for m in index if m.get("name") == model and m.get("state") == "READY")


def summary(stubs: list[dict], rounds: list[dict], stall: dict, deploy: dict, versions: dict[str, list[int]],
            memory_mb: dict[str, float], waits_s: list[float], target_s: float) -> dict:
    """The phase's account, and whether it passed (module doc)."""
    worst = max([x["unavailable_s"] or 0.0 for x in stubs] + [r["recovery_s"] for r in rounds if r["unavailable_503"]],
                default=0.0)
    deployed = {tuple(v) for v in versions.values()}
    p = {"stub_kills": stubs, "rounds": rounds, "stall": stall, "deploy": deploy, "versions": versions,
         "memory_mb": memory_mb, "both_ready_waits_s": waits_s, "target_503_s": target_s,
         "ok": sum(x["ok"] for x in stubs) + sum(r["ok"] for r in rounds),
         "unavailable_503": sum(x["unavailable_503"] for x in stubs) + sum(r["unavailable_503"] for r in rounds),
         "lost": sum(x["lost"] for x in stubs) + sum(r["lost"] for r in rounds) + stall["lost"] + deploy["lost"],
         "longest_503_s": worst,
         "same_versions_everywhere": len(deployed) == 1 and len(versions) == 2}
    p["passed"] = (p["lost"] == 0 and worst <= target_s and p["same_versions_everywhere"] and deploy["deploy_rc"] == 0
                   and all(x["requests_after_recovery"] > 0 for x in stubs) and stall["served_while_stopped"] > 0
                   and stall["longest_wait_s"] <= stall["target_s"])
    return p


def markdown(p: dict | None) -> list[str]:
    """Phase 5's lines of ``soak.md`` (none when the run had no standby phase)."""
    if not p:
        return []
    stub_rows = [f"| stub of {x['model']} killed, round {k + 1} | {x['ok']:,} | {x['unavailable_503']:,} | "
                 f"**{x['lost']}** | {x['unavailable_s']} |" for k, x in enumerate(p["stub_kills"])]
    kill_rows = [f"| tritonserver killed, round {r['round']} | {r['ok']:,} | {r['unavailable_503']:,} | "
                 f"**{r['lost']}** | {r['recovery_s'] if r['unavailable_503'] else 0.0} |" for r in p["rounds"]]
    d, st = p["deploy"], p["stall"]
    mem = ", ".join(f"{k}: {v:,.0f} MiB" for k, v in p["memory_mb"].items())
    return [
        "## Phase 5: the same kills with a warm standby (`unroll serve --standby`)",
        "",
        "A second tritonserver serves the same repository; the gateway sends its calls to one and moves them to the "
        "other when it is unavailable. Each kill hits the server that serves the traffic, once both are ready "
        f"(waited {', '.join(f'{w:g}' for w in p['both_ready_waits_s'])} s before the kills).",
        "",
        "| kill | succeeded | 503 | lost | last 503 after the kill (s) |", "|---|---|---|---|---|",
        *stub_rows, *kill_rows, "",
        f"- tritonserver stopped (SIGSTOP) for {st['stall_s']:g} s under classify load: {st['ok']:,} succeeded, "
        f"{st['served_while_stopped']:,} of them while it was stopped (by the other server), "
        f"{st['unavailable_503']} got 503 (those waiting for it when the stall was detected), **{st['lost']} lost**; "
        f"no request waited more than {st['longest_wait_s']} s",
        f"- `unroll deploy` of the classifier under load ({d['deploy_s']} s): {d['ok']:,} succeeded, "
        f"**{d['lost']} lost**, {d['unavailable_503']} got 503; versions served afterwards: "
        + ", ".join(f"{k}: {v}" for k, v in p["versions"].items()),
        f"- memory (resident, each server and its backend processes): {mem}",
        f"- **lost: {p['lost']}**; the longest run of 503s after a kill: **{p['longest_503_s']} s** "
        f"(target ≤ {p['target_503_s']:g} s)",
        f"- phase **{'passed' if p['passed'] else 'FAILED'}**",
        "",
    ]
