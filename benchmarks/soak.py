"""``unroll bench soak``: traffic through a real ``unroll serve`` while parts of Triton are killed.

Phase 1 (:mod:`unroll.benchmarks.soak_stub`) kills the denoiser's Python-backend stub under denoise load; phase 2
kills ``tritonserver`` under mixed traffic. A request is *lost* when it neither succeeded nor got the documented 503
with ``Retry-After``. The run passes when nothing is lost, traffic goes on after each recovery, phase 1's 503s end
within ``soak_stub.TARGET_503_S`` of its kill, and no process or ``/dev/shm`` region is left behind. The README's
soak paragraph is generated from the results (:func:`readme_paragraph`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from unroll import artifacts, data, tasks
from unroll.benchmarks import soak_ops, soak_standby, soak_stub
from unroll.benchmarks.common import RESULTS, demo_model, machine_info, png_bytes, unroll_command, write_readme_block
from unroll.errors import BenchError
from unroll.registry import get_spec
from unroll.serving.gateway.settings import Settings
from unroll.serving.process_watch import read_stat
from unroll.serving.triton import SHM_DIR, free_ports, group_members, processes_with, shm_regions

READY_TIMEOUT_S = 300.0
#: How long processes of the stopped server may take to disappear before they count as left behind.
LEFTOVER_GRACE_S = 10.0
REQUEST_TIMEOUT_S = 60.0
#: A client's pause after a 503 before its next request (the gateway advises Retry-After: 5 s; a short pause
#: keeps the soak going through the outage instead of burning the remaining requests in a second).
BACKOFF_ON_503_S = 0.25
#: Requests that must succeed after a round's last failure before the next round (or the end).
AFTER_RECOVERY = 100
#: A round that has not recovered this long after its kill ends anyway (and the soak fails).
ROUND_TIMEOUT_S = 60.0
#: How long :meth:`ServeProcess.triton_pid` watches the servers' CPU to tell which one serves the traffic.
BUSY_SAMPLE_S = 0.3
#: Share of the traffic per kind (the rest is /v1/models).
MIX = {"classify": 0.55, "classify-auto": 0.15, "denoise": 0.25}


@dataclass
class ServeProcess:
    """A running ``unroll serve`` subprocess and what it printed."""

    proc: subprocess.Popen
    base: str
    repo: Path
    #: Its graphs (``--onnx-dir``); the Triton key and the state for ``unroll deploy`` are in its parent.
    onnx_dir: Path
    #: Triton's HTTP, gRPC and metrics ports.
    triton_ports: tuple[int, int, int]
    #: The warm standby's (``--standby``), if there is one.
    standby_ports: tuple[int, int, int] | None = None
    output: list[str] = field(default_factory=list)
    regions: set[str] = field(default_factory=set)
    server_pids: set[int] = field(default_factory=set)

    def tritons(self) -> dict[int, list[str]]:
        """Every tritonserver of this service (two with ``--standby``): ``{pid: command line}``."""
        return {pid: argv for pid, argv in processes_with(f"--model-repository={self.repo}").items()
                if argv[0].endswith("tritonserver")}

    def triton_pids(self) -> list[int]:
        return sorted(self.tritons())

    def triton_on(self, http_port: int) -> int:
        """The tritonserver listening on ``http_port`` (its ``--http-port`` argument)."""
        return next(pid for pid, argv in self.tritons().items() if f"--http-port={http_port}" in argv)

    def triton_pid(self) -> int | None:
        """The tritonserver that serves the traffic now: the only one, or with a standby the one whose processes
        used the most CPU over the last :data:`BUSY_SAMPLE_S` (the gateway sends every call to one of them)."""
        pids = self.triton_pids()
        if len(pids) < 2:
            return pids[0] if pids else None
        before = {pid: _group_cpu_s(pid) for pid in pids}
        time.sleep(BUSY_SAMPLE_S)
        return max(pids, key=lambda pid: _group_cpu_s(pid) - before[pid])

    def stub_pid(self, model: str, server: int | None = None) -> int | None:
        """The Python-backend stub serving ``model`` (its ``model.py`` path names it) in ``server``, by default the
        one that serves the traffic."""
        server = server if server is not None else self.triton_pid()
        members = group_members(server) if server is not None else {}
        return next((p for p, argv in members.items() if p != server and any(f"/{model}/" in a for a in argv)), None)

    def record(self) -> None:
        """Remember the current servers, their stubs and their shared-memory regions (to check clean-up later)."""
        for pid in self.triton_pids():
            members = group_members(pid)
            self.server_pids |= set(members)
            self.regions |= shm_regions(list(members.values()))


def _group_cpu_s(pid: int) -> float:
    """CPU seconds used so far by the process group ``pid`` leads (a tritonserver and its stubs)."""
    return sum(stat.cpu_s for p in group_members(pid) if (stat := read_stat(p)) is not None)


def _still_there(pids: set[int], grace_s: float) -> dict[str, str]:
    """Which of ``pids`` still exist after ``grace_s`` (a process may take a moment to exit): ``{pid: state cmd}``."""
    deadline = time.monotonic() + grace_s
    while True:
        left = {}
        for pid in pids:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "zombie" not in status and "triton" not in cmd:
                continue  # the pid went to an unrelated new process
            state = next((ln.split(":", 1)[1].strip() for ln in status.splitlines() if ln.startswith("State:")), "?")
            left[str(pid)] = f"{state} {cmd[:160]}"
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)



def start_serve(root: Path, models: list[str], log: Callable[[str], None],
                settings: dict[str, str] | None = None, onnx_dir: Path | None = None,
                standby: bool = False, args: tuple[str, ...] = (),
                ready_timeout_s: float = READY_TIMEOUT_S) -> ServeProcess:
    """``unroll serve`` from ``root`` (its build/ and repository go there) on spare ports; ``settings``:
    ``UNROLL_*`` variables for it (none are inherited); ``onnx_dir``: its graphs (default ``root/onnx``; its parent
    gets the Triton key and the state file ``unroll deploy`` reads); ``standby``: with a warm standby Triton;
    ``args``: more of its options (``--target gpu``, ``--workers N``)."""
    port, http, grpc, metrics, *spare = free_ports(7 if standby else 4)
    repo = root / artifacts.REPOSITORY_DIR.name
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNROLL_")} | (settings or {})
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [unroll_command(), "serve", "--models", ",".join(models), "--port", str(port),
           "--triton-http-port", str(http), "--triton-grpc-port", str(grpc), "--triton-metrics-port", str(metrics),
           "--repo", str(repo), "--onnx-dir", str(onnx_dir or root / "onnx"), "--log-level", "warning"]
    if standby:
        cmd += ["--standby", "--standby-ports", ",".join(map(str, spare))]
    cmd += list(args)
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    s = ServeProcess(proc, f"http://127.0.0.1:{port}", repo, onnx_dir or root / "onnx", (http, grpc, metrics),
                     (spare[0], spare[1], spare[2]) if standby else None)
    ready, announced = threading.Event(), threading.Event()

    def pump() -> None:
        for line in proc.stdout:
            s.output.append(line)
            if "unroll gateway ready" in line:
                announced.set()
                ready.set()
        ready.set()  # its output ended: it exited (or is exiting) without being ready

    threading.Thread(target=pump, daemon=True).start()
    log("starting unroll serve (exports and repository on first run)")
    if not ready.wait(ready_timeout_s) or not announced.is_set() or proc.poll() is not None:
        stop_serve(s)
        raise BenchError("unroll serve did not become ready:\n" + "".join(s.output)[-4000:])
    s.record()
    return s


def stop_serve(s: ServeProcess) -> None:
    if s.proc.poll() is None:
        s.proc.send_signal(signal.SIGINT)
        try:
            s.proc.wait(60)
        except subprocess.TimeoutExpired:
            s.proc.kill()
            s.proc.wait()


def _payloads(classifier: str, denoiser: str, n: int) -> dict[str, list[tuple[str, bytes]]]:
    """Request bodies per kind: real digits of the classifier's test split, noisy 64×64 crops of bundled images."""
    x, _ = data.dataset(get_spec(classifier).card.data.test).load()
    digits = [png_bytes(x[i, 0]) for i in range(min(n, len(x)))]
    crops = []
    for name in data.DENOISE_TEST_IMAGES[:4]:
        img = data.bundled_image(name)
        for k in range(4):
            crop = img[32 * k:32 * k + 64, 32 * k:32 * k + 64]
            crops.append(png_bytes(data.add_noise(crop, 25.0, data.noise_seed(name, 25.0) + k)))
    return {"classify": [(f"/v1/classify?model={classifier}&top_k=1", d) for d in digits],
            "classify-auto": [(f"/v1/classify?model={classifier}&top_k=1&lam=auto", d) for d in digits],
            "denoise": [(f"/v1/denoise?model={denoiser}&sigma=25", c) for c in crops]}


async def _traffic(s: ServeProcess, payloads: dict, requests: int, concurrency: int, rounds: int,
                   log: Callable[[str], None]) -> tuple[list[dict], list[dict]]:
    """Mixed traffic with ``tritonserver`` killed once per round: every response, and each round's kill.

    A round issues ``requests // rounds`` requests at least; its kill comes halfway, and the round ends once
    :data:`AFTER_RECOVERY` requests started after its last failure have succeeded (so a slow restart lengthens the
    round instead of leaving nothing to show recovery), or :data:`ROUND_TIMEOUT_S` after the kill."""
    import httpx

    per_round = max(requests // rounds, 2)
    rng = np.random.default_rng(0)
    mix = list(MIX) + ["models"]
    weights = [*MIX.values(), 1 - sum(MIX.values())]
    results: list[dict] = []
    kills: list[dict] = []
    next_i = 0
    done = asyncio.Event()

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal next_i
        while not done.is_set():
            i = next_i
            next_i += 1
            kind = str(rng.choice(mix, p=weights))
            t0 = time.perf_counter()
            try:
                if kind == "models":
                    r = await client.get("/v1/models")
                else:
                    path, body = payloads[kind][i % len(payloads[kind])]
                    r = await client.post(path, content=body, headers={"Content-Type": "image/png"})
                status, code, retry_after = soak_stub.outcome(r)
            except httpx.HTTPError as e:
                status, code, retry_after = None, type(e).__name__, None
            results.append({"i": i, "kind": kind, "status": status, "code": code, "retry_after": retry_after,
                            "start": t0, "end": time.perf_counter()})
            if status == 503:
                await asyncio.sleep(BACKOFF_ON_503_S)

    def recovered(since: float) -> bool:
        last_failure = max((r["end"] for r in results if r["start"] >= since and not _succeeded(r)), default=since)
        return sum(1 for r in results if r["start"] > last_failure and _succeeded(r)) >= AFTER_RECOVERY

    async def conductor() -> None:
        for k in range(rounds):
            first, started = next_i, time.perf_counter()
            while next_i - first < per_round // 2:
                await asyncio.sleep(0.01)
            pid = s.triton_pid()
            s.record()
            os.kill(pid, signal.SIGKILL)
            at = time.perf_counter()
            kills.append({"round": k, "started": started, "at": at, "at_request": next_i, "pid": pid})
            log(f"round {k + 1}/{rounds}, request {next_i}: kill -9 tritonserver (pid {pid})")
            while time.perf_counter() - at < ROUND_TIMEOUT_S and not (next_i - first >= per_round
                                                                    and recovered(started)):
                await asyncio.sleep(0.05)
            kills[-1]["backoff_s"] = soak_stub.restart_backoff_s("".join(s.output))
            s.record()  # the restarted server too
        done.set()

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=s.base, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        await asyncio.gather(conductor(), *(worker(client) for _ in range(concurrency)))
    return sorted(results, key=lambda r: r["i"]), kills


def _succeeded(r: dict) -> bool:
    return r["status"] is not None and r["status"] < 400


def round_summary(results: list[dict], kill: dict, until: float | None) -> dict:
    """One round's account: its requests are those started from the round's start until the next round's."""
    mine = [r for r in results if r["start"] >= kill["started"] and (until is None or r["start"] < until)]
    failed = [r for r in mine if not _succeeded(r)]
    unavailable = [r for r in failed if r["status"] == 503]
    lost = [r for r in failed if r["status"] != 503]
    recovered_at = max((r["end"] for r in failed), default=kill["at"])
    after = [r for r in mine if r["start"] > recovered_at]
    return {"round": kill["round"] + 1, "kill_at_request": kill["at_request"], "requests": len(mine),
            "ok": len(mine) - len(failed), "unavailable_503": len(unavailable),
            "unavailable_with_retry_after": sum(1 for r in unavailable if r["retry_after"]),
            "lost": len(lost), "lost_examples": [{k: r[k] for k in ("i", "kind", "status", "code")} for r in lost[:10]],
            "recovery_s": round(recovered_at - kill["at"], 2), "restart_backoff_s": kill.get("backoff_s", 0.0),
            "requests_after_recovery": len(after)}


def run(requests: int = 10_000, concurrency: int = 32, out_dir: Path | None = RESULTS,
        progress: Callable[[str], None] | None = None, stub_phase: bool = True, rounds: int = 1,
        ops: bool = True, standby_rounds: int = 0) -> dict:
    """The soak; returns the payload (and writes ``soak.json`` / ``soak.md`` into ``out_dir`` unless None).

    ``stub_phase``: run phase 1 (the denoiser's backend process killed) before the mixed traffic; ``rounds``: how many
    times each phase kills (phase 2: ``requests`` spread over the rounds, see :func:`_traffic`); ``ops``: then
    phases 3 and 4 (:mod:`.soak_ops`: Triton stopped, a model update); ``standby_rounds``: then phase 5
    (:mod:`.soak_standby`) with that many kills of each kind, ``requests`` // 3 requests in its mixed traffic."""
    log = progress or (lambda m: None)
    classifier, denoiser = demo_model(tasks.CLASSIFICATION), demo_model(tasks.DENOISING)
    root = Path(tempfile.mkdtemp(prefix="unroll-soak-")).resolve()
    t_start = time.perf_counter()
    s = start_serve(root, [classifier, denoiser], log)
    stubs: list[dict] = []
    try:
        if stub_phase:
            for k in range(rounds):
                log(f"phase 1, round {k + 1}/{rounds}")
                stubs.append(soak_stub.run_phase(s, denoiser, log))
        payloads = _payloads(classifier, denoiser, 1000)
        log(f"{requests} requests at concurrency {concurrency}, tritonserver killed {rounds} time(s)")
        results, kills = asyncio.run(_traffic(s, payloads, requests, concurrency, rounds, log))
        s.record()  # the restarted server too
        stall = deploy = None
        if ops:
            path, digit = payloads["classify"][0]
            stall = soak_ops.stall_phase(s, path, digit, Settings().triton_stall_s, log)
            deploy = soak_ops.deploy_phase(s, classifier, log)
            s.record()
        serve_log = "".join(s.output)
    finally:
        stop_serve(s)
    left, leaked, orphans = _leftovers(s, root)
    standby = None
    if standby_rounds:
        standby = standby_phase(classifier, denoiser, standby_rounds, requests // 3, concurrency, log)
        left |= standby.pop("left_processes")
        leaked += standby.pop("leaked_shm")
        orphans |= standby.pop("orphans")

    ends = [k["started"] for k in kills[1:]] + [None]
    per_round = [round_summary(results, k, until) for k, until in zip(kills, ends, strict=True)]
    ok = [r for r in results if _succeeded(r)]
    failed = [r for r in results if not _succeeded(r)]
    unavailable = [r for r in failed if r["status"] == 503]
    lost = [r for r in failed if r["status"] != 503]
    payload = {
        "machine": machine_info(threads=2),
        "requests": len(results), "concurrency": concurrency,
        "mix": {**MIX, "models": round(1 - sum(MIX.values()), 2)},
        "models": {tasks.CLASSIFICATION: classifier, tasks.DENOISING: denoiser},
        "kill": {"rounds": rounds, "signal": "SIGKILL", "target": "tritonserver",
                 "at_requests": [k["at_request"] for k in kills]},
        "status_counts": dict(Counter(str(r["status"]) for r in results)),
        "error_codes": dict(Counter(r["code"] for r in results if r["code"])),
        "ok": len(ok), "unavailable_503": len(unavailable),
        "unavailable_with_retry_after": sum(1 for r in unavailable if r["retry_after"]),
        "lost": len(lost), "lost_examples": [{k: r[k] for k in ("i", "kind", "status", "code")} for r in lost[:10]],
        "rounds": per_round,
        # the slowest round's recovery and the fewest requests any round served after it
        "recovery_s": max((r["recovery_s"] for r in per_round), default=None),
        "requests_after_recovery": min((r["requests_after_recovery"] for r in per_round), default=0),
        "backoff_on_503_s": BACKOFF_ON_503_S,
        "left_processes": left, "orphans": {str(p): " ".join(a)[:200] for p, a in orphans.items()},
        "leaked_shm": leaked, "shm_regions_seen": len(s.regions),
        "restart_logged": "restart" in serve_log,
        "seconds": round(time.perf_counter() - t_start, 1),
        "stub_kills": stubs,
        "stall": stall, "deploy": deploy, "standby": standby,
    }
    # phase 1's 3 s target holds where the service can meet it: with a standby (phase 5) when the run has one; without
    # one a restart loads every model first, and its time is reported per round, not required
    survived = all(x["kill"]["done"] and not x["lost"] and x["requests_after_recovery"] >= soak_stub.SERVED_AFTER
                   for x in stubs)
    payload["stub_target_met_by"] = "standby" if standby else "restart"
    payload["passed"] = (len(kills) == rounds and not lost and payload["requests_after_recovery"] >= AFTER_RECOVERY
                         and not left and not leaked and not orphans and survived
                         and (standby is not None or all(x["passed"] for x in stubs))
                         and all(p["passed"] for p in (stall, deploy, standby) if p is not None))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "soak.json").write_text(json.dumps(payload, indent=2) + "\n")
        (out_dir / "soak.md").write_text(markdown(payload))
        if out_dir.resolve() == RESULTS.resolve():  # the committed results: the README quotes them
            write_readme_paragraph(payload, RESULTS.parent.parent / "README.md")
    return payload


def _leftovers(s: ServeProcess, root: Path) -> tuple[dict[str, str], list[str], dict[int, list[str]]]:
    """After ``s`` stopped: its servers' processes still there, their ``/dev/shm`` regions still there, and
    processes still running from ``root`` (which is then removed)."""
    left = _still_there(s.server_pids, LEFTOVER_GRACE_S)
    leaked = sorted(r for r in s.regions if (SHM_DIR / r).exists())
    orphans = processes_with(str(root))
    shutil.rmtree(root, ignore_errors=True)
    return left, leaked, orphans


def standby_phase(classifier: str, denoiser: str, rounds: int, requests: int, concurrency: int,
                   log: Callable[[str], None]) -> dict:
    """Phase 5 (:mod:`.soak_standby`) on a new ``unroll serve --standby``: stub kills, tritonserver kills, a deploy;
    its summary with what the service left behind."""
    root = Path(tempfile.mkdtemp(prefix="unroll-soak-standby-")).resolve()
    s = start_serve(root, [classifier, denoiser], log, standby=True)
    assert s.standby_ports is not None
    ports = [s.triton_ports[0], s.standby_ports[0]]
    waits: list[float] = []
    try:
        memory = {f"tritonserver on :{port}": soak_standby.rss_mb(s.triton_on(port)) for port in ports}
        stubs = []
        for k in range(rounds):
            waits.append(soak_standby.both_ready(ports))
            log(f"phase 5 (standby), stub kill {k + 1}/{rounds}")
            stubs.append(soak_stub.run_phase(s, denoiser, log))
        payloads = _payloads(classifier, denoiser, 1000)
        per_round = []
        for k in range(rounds):
            waits.append(soak_standby.both_ready(ports))
            log(f"phase 5 (standby), tritonserver kill {k + 1}/{rounds}")
            results, kills = asyncio.run(_traffic(s, payloads, max(requests // rounds, 2), concurrency, 1, log))
            per_round.append(round_summary(results, kills[0], None) | {"round": k + 1})
            s.record()
        waits.append(soak_standby.both_ready(ports))
        path, digit = payloads["classify"][0]
        stall = soak_ops.stall_phase(s, path, digit, Settings().triton_stall_s, log)
        waits.append(soak_standby.both_ready(ports))
        deploy = soak_ops.deploy_phase(s, classifier, log)
        key = (s.onnx_dir.parent / artifacts.TRITON_KEY.name).read_text().strip()
        versions = {f"tritonserver on :{port}": soak_standby.served_versions(port, key, classifier) for port in ports}
        s.record()
    finally:
        stop_serve(s)
    left, leaked, orphans = _leftovers(s, root)
    return soak_standby.summary(stubs, per_round, stall, deploy, versions, memory, waits, soak_stub.TARGET_503_S) | {
        "left_processes": left, "leaked_shm": leaked, "orphans": orphans}


def markdown(p: dict) -> str:
    m = p["machine"]
    rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(p["status_counts"].items()))
    stubs = p.get("stub_kills") or []
    kill = p["kill"]
    rounds = "\n".join(f"| {r['round']} | {r['kill_at_request']:,} | {r['ok']:,} | {r['unavailable_503']:,} | "
                       f"**{r['lost']}** | {r['recovery_s']} | {r['restart_backoff_s']:g} | "
                       f"{r['requests_after_recovery']:,} |" for r in p["rounds"])
    title = (f"{p['requests']:,} mixed requests at concurrency {p['concurrency']}, tritonserver killed (SIGKILL) "
             f"{kill['rounds']} time(s)")
    return "\n".join([
        "# Soak: parts of Triton killed under load" if stubs else f"# Soak: {title}",
        "",
        f"{m.get('cpu', '?')}, {m.get('logical_cores', '?')} cores; `unroll bench soak` ({p['seconds']} s), one "
        "`unroll serve` throughout.",
        "",
        *[line for k, stub in enumerate(stubs) for line in soak_stub.markdown(stub, k + 1, len(stubs))],
        *([f"## Phase 2: {title}", ""] if stubs else []),
        f"Models: {p['models'][tasks.CLASSIFICATION]} (trained λ and lam=auto), {p['models'][tasks.DENOISING]} (64×64 "
        "crops, σ=25), and /v1/models. Each round kills tritonserver halfway through its requests and lasts until "
        f"{AFTER_RECOVERY} requests started after its last failure have succeeded.",
        "",
        "| status | requests |", "|---|---|", rows, "",
        "| round | killed at request | succeeded | 503 | lost | last 503 after the kill (s) | of which the "
        "supervisor's backoff (s) | succeeded after it |",
        "|---|---|---|---|---|---|---|---|", rounds, "",
        f"- succeeded: {p['ok']:,}; answered 503 (Triton unavailable): {p['unavailable_503']:,} "
        f"({p['unavailable_with_retry_after']:,} with Retry-After)",
        f"- **lost** (neither success nor 503: other 5xx, timeouts, dropped connections): **{p['lost']}**",
        f"- the slowest round answered its last 503 {p['recovery_s']} s after its kill; every request started after a "
        f"round's last 503 succeeded (at least {p['requests_after_recovery']:,} per round; clients pause "
        f"{p['backoff_on_503_s']} s after a 503)",
        f"- after stopping: processes of any Triton server left: {len(p['left_processes'])}; orphans under the run's "
        f"folder: {len(p['orphans'])}; leaked /dev/shm regions: {len(p['leaked_shm'])} of "
        f"{p['shm_regions_seen']} seen (every server of the run)",
        "",
        *soak_ops.markdown(p.get("stall"), p.get("deploy")),
        *soak_standby.markdown(p.get("standby")),
        f"- **{'passed' if p['passed'] else 'FAILED'}**" + (" (every phase)" if stubs else "")
        + ("; the 3 s target of a lost backend process is required of the service with a standby (phase 5), and "
           "reported per round without one (phase 1)" if p.get("standby") else ""),
        "",
    ])


#: The README's soak paragraph sits between these markers; :func:`readme_paragraph` writes it from soak.json.
README_BEGIN, README_END = "<!-- soak: generated from benchmarks/results/soak.json -->", "<!-- /soak -->"


def readme_paragraph(p: dict) -> str:
    """The README's summary of a soak payload (numbers from the results, never typed by hand)."""
    text = ""
    stubs = p.get("stub_kills") or []
    if stubs:
        first = stubs[0]
        text += (f"**Soak** ([`soak.md`](benchmarks/results/soak.md), `unroll bench soak`), one real `unroll serve`. "
                 f"Phase 1, {len(stubs)} time(s): {first['clients']} clients denoising {first['image']} images, the "
                 f"denoiser's Python-backend stub killed (SIGKILL): {sum(x['ok'] for x in stubs):,} succeeded, "
                 f"{sum(x['unavailable_503'] for x in stubs):,} got 503 with `Retry-After`, "
                 f"**{sum(x['lost'] for x in stubs)} lost**; the last 503 came at most "
                 f"**{max(x['unavailable_net_s'] for x in stubs)} s** after a kill, not counting the supervisor's "
                 f"crash-loop backoff of up to {max(x['restart_backoff_s'] for x in stubs):g} s between rounds "
                 f"(target ≤ {first['target_503_s']:g} s, met in {sum(x['passed'] for x in stubs)} of {len(stubs)} "
                 "rounds)"
                 + (", tritonserver replaced by the supervisor" if all(x["triton_replaced"] for x in stubs) else "")
                 + ". Phase 2: ")
    else:
        text += "**Soak** ([`soak.md`](benchmarks/results/soak.md), `unroll bench soak`): "
    text += (f"{p['requests']:,} mixed requests (classify with the trained λ and with `lam=auto`, denoise 64×64 "
             f"crops, `/v1/models`) at concurrency {p['concurrency']}, `tritonserver` killed (SIGKILL) "
             f"{p['kill']['rounds']} time(s): {p['ok']:,} succeeded, {p['unavailable_503']:,} got 503 with "
             f"`Retry-After`, **{p['lost']} lost**; the last 503 came at most {p['recovery_s']} s after a kill "
             f"(backoff included) and every request started after it succeeded (clients pause "
             f"{p['backoff_on_503_s']} s after a 503). "
             + _ops_sentence(p) + _standby_sentence(p.get("standby")) + "After stopping, "
             + ("no process and no `/dev/shm` region of any of its Triton servers was left."
                if not (p["left_processes"] or p["orphans"] or p["leaked_shm"]) else
                f"{len(p['left_processes'])} processes and {len(p['leaked_shm'])} `/dev/shm` regions were left."))
    return textwrap.fill(text, width=116, break_long_words=False, break_on_hyphens=False)


def _ops_sentence(p: dict) -> str:
    """Phases 3 and 4 in a sentence of the README's paragraph (empty when the run had none)."""
    stall, deploy = p.get("stall"), p.get("deploy")
    text = ""
    if stall:
        text += (f"Phase 3: `tritonserver` stopped (SIGSTOP) for {stall['stall_s']:g} s: **{stall['lost']} lost**, "
                 f"no request waited more than {stall['longest_wait_s']} s for its 503 (target ≤ "
                 f"{stall['target_s']:g} s), "
                 + ("the server was not replaced" if not stall["triton_replaced"] else "the server was replaced")
                 + ". ")
    if deploy:
        text += (f"Phase 4: `unroll deploy` of the classifier under load ({deploy['deploy_s']} s): "
                 f"{deploy['ok']:,} succeeded, **{deploy['lost']} lost**, {deploy['unavailable_503']} got 503, "
                 + ("the same tritonserver throughout" if not deploy["triton_replaced"] else "tritonserver replaced")
                 + ". ")
    return text


def _standby_sentence(sb: dict | None) -> str:
    """Phase 5 in a sentence of the README's paragraph (empty when the run had none)."""
    if not sb:
        return ""
    mem = max(sb["memory_mb"].values())
    return (f"Phase 5, the same with a warm standby (`unroll serve --standby`): {len(sb['stub_kills'])} stub kills and "
            f"{len(sb['rounds'])} `tritonserver` kills: {sb['ok']:,} succeeded, {sb['unavailable_503']:,} got 503, "
            f"**{sb['lost']} lost**, the longest run of 503s after a kill {sb['longest_503_s']} s; stopped, the server "
            f"in use was stood in for by the other ({sb['stall']['served_while_stopped']:,} requests answered while it "
            f"was stopped); `unroll deploy` reached both servers "
            + ("(the same versions on each)" if sb["same_versions_everywhere"] else "(**their versions differ**)")
            + f"; each server holds up to {mem:,.0f} MiB resident. ")


def write_readme_paragraph(p: dict, readme: Path) -> bool:
    """Replace the text between the README's soak markers with :func:`readme_paragraph`; ``False`` if none."""
    return write_readme_block(readme, README_BEGIN, README_END, readme_paragraph(p))
