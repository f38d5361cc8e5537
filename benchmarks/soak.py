"""``unroll bench soak``: traffic through a real ``unroll serve`` while parts of Triton are killed.

Phases 1 to 4 run on the default ``unroll serve`` (a warm standby where the machine's memory allows it, as it chose
and said): phase 1 (:mod:`unroll.benchmarks.soak_stub`) kills the denoiser's Python-backend stub under denoise load
and the classifier's under classify load; phase 2 kills ``tritonserver`` under mixed traffic; phases 3 and 4
(:mod:`.soak_ops`) stop it and deploy a model under load. Phase 5 (:mod:`.soak_standby`) repeats the kills of phases
1 and 2 on ``unroll serve --no-standby``, to show what the standby saves. A request is *lost* when it neither
succeeded nor got the documented 503 with ``Retry-After``. Every phase is judged on what its clients saw: the
**fault window** (from the kill, or the first non-200 answer if earlier, to the last non-200 answer;
:func:`soak_stub.fault_window_s`) against ``soak_stub.TARGET_503_S``, and the lost requests; the supervisor's
crash-loop back-off is reported beside the window, never subtracted. The run passes when the default deployment
passes every phase (windows, nothing lost, traffic goes on after each recovery), phase 5 loses nothing and recovers
(its windows are shown met or not met), and no process or ``/dev/shm`` region is left behind. The README's soak
paragraphs are generated from the results (:func:`readme_paragraph`, :func:`readme_standby_paragraph`).
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
from unroll.benchmarks.common import RESULTS, demo_model, machine_info, png_bytes, unroll_command, write_docs_blocks
from unroll.benchmarks.loadgen import Payload
from unroll.errors import BenchError
from unroll.registry import get_spec
from unroll.serving.gateway.settings import Settings
from unroll.serving.process_watch import read_stat
from unroll.serving.standby import HEADROOM, resident_mb
from unroll.serving.triton import SHM_DIR, free_ports, group_members, processes_with, shm_regions

READY_TIMEOUT_S = 300.0
#: How long processes of the stopped server may take to disappear before they count as left behind.
LEFTOVER_GRACE_S = 10.0
REQUEST_TIMEOUT_S = 60.0
#: A client's pause after a 503 before its next request (the gateway advises Retry-After: 5 s; a short pause
#: keeps the soak going through the outage instead of burning the remaining requests in a second): every phase's.
BACKOFF_ON_503_S = soak_stub.BACKOFF_ON_503_S
#: Requests that must succeed after a round's last failure before the next round (or the end).
AFTER_RECOVERY = 100
#: A round that has not recovered this long after its kill ends anyway (and the soak fails).
ROUND_TIMEOUT_S = 60.0
#: How long :meth:`ServeProcess.triton_pid` watches the servers' CPU to tell which one serves the traffic.
BUSY_SAMPLE_S = 0.3
#: What a lost request's example in the results keeps (phase 2's requests are numbered and of a kind).
EXAMPLE_FIELDS = ("i", "kind", "status", "code")
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
    #: The warm standby's, if it runs one.
    standby_ports: tuple[int, int, int] | None = None
    #: The line ``unroll serve`` printed about its standby (``standby: on (auto): …``).
    standby_choice: str = ""
    output: list[str] = field(default_factory=list)
    regions: set[str] = field(default_factory=set)
    server_pids: set[int] = field(default_factory=set)

    def tritons(self) -> dict[int, list[str]]:
        """Every tritonserver of this service (two with ``--standby``): ``{pid: command line}``."""
        return {pid: argv for pid, argv in processes_with(f"--model-repository={self.repo}").items()
                if argv[0].endswith("tritonserver")}

    def triton_pids(self) -> list[int]:
        return sorted(self.tritons())

    def http_ports(self) -> list[int]:
        """Every server's HTTP port: Triton's, and the standby's when it runs one."""
        return [self.triton_ports[0]] + ([self.standby_ports[0]] if self.standby_ports else [])

    def memory_mb(self) -> dict[str, float]:
        """Resident memory of each server with its backend processes (MiB), by its HTTP port."""
        return {f"tritonserver on :{port}": resident_mb(self.triton_on(port)) for port in self.http_ports()}

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
                standby: bool | None = False, args: tuple[str, ...] = (),
                ready_timeout_s: float = READY_TIMEOUT_S) -> ServeProcess:
    """``unroll serve`` from ``root`` (its build/ and repository go there) on spare ports; ``settings``:
    ``UNROLL_*`` variables for it (none are inherited); ``onnx_dir``: its graphs (default ``root/onnx``; its parent
    gets the Triton key and the state file ``unroll deploy`` reads); ``standby``: ``False`` (the default here)
    passes ``--no-standby`` (one tritonserver: what a test of the single server's restart needs, and half the
    start-up), ``True`` ``--standby``, ``None`` neither (``unroll serve``'s own default, auto), each with spare
    standby ports; ``args``: more of its options (``--target gpu``, ``--workers N``)."""
    port, http, grpc, metrics, *spare = free_ports(7)
    repo = root / artifacts.REPOSITORY_DIR.name
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNROLL_")} | (settings or {})
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [unroll_command(), "serve", "--models", ",".join(models), "--port", str(port),
           "--triton-http-port", str(http), "--triton-grpc-port", str(grpc), "--triton-metrics-port", str(metrics),
           "--repo", str(repo), "--onnx-dir", str(onnx_dir or root / "onnx"), "--log-level", "warning",
           "--standby-ports", ",".join(map(str, spare))]
    if standby is not None:
        cmd.append("--standby" if standby else "--no-standby")
    cmd += list(args)
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    s = ServeProcess(proc, f"http://127.0.0.1:{port}", repo, onnx_dir or root / "onnx", (http, grpc, metrics))
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
    s.standby_choice = next((ln.strip() for ln in s.output if ln.startswith("standby: ")), "")
    if s.standby_choice.startswith("standby: on"):
        s.standby_ports = (spare[0], spare[1], spare[2])
    if len(s.triton_pids()) != len(s.http_ports()):
        stop_serve(s)
        raise BenchError(f"unroll serve said {s.standby_choice!r} but runs {len(s.triton_pids())} tritonserver(s)")
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


def mixed_requests(payloads: dict[str, list[tuple[str, bytes]]], n: int, seed: int = 0) -> list[Payload]:
    """``n`` requests in send order, each of a kind drawn by :data:`MIX` (the rest ``GET /v1/models``), the ``i``-th
    of a kind its ``i % len``-th body; tagged with their kind. The engine sends them in turn (and again from the
    first, should a phase outlast them)."""
    rng = np.random.default_rng(seed)
    kinds = rng.choice([*MIX, "models"], size=n, p=[*MIX.values(), 1 - sum(MIX.values())])
    out = []
    for i, kind in enumerate(map(str, kinds)):
        if kind == "models":
            out.append(Payload("/v1/models", b"", method="GET", tag=kind))
        else:
            path, body = payloads[kind][i % len(payloads[kind])]
            out.append(Payload(path, body, {"Content-Type": "image/png"}, tag=kind))
    return out


async def _traffic(s: ServeProcess, payloads: dict, requests: int, concurrency: int, rounds: int,
                   log: Callable[[str], None]) -> tuple[list[dict], list[dict]]:
    """Mixed traffic (the load engine's closed loop, :class:`.soak_stub.Traffic`) with ``tritonserver`` killed once
    per round: every response, and each round's kill.

    A round issues ``requests // rounds`` requests at least; its kill comes halfway, and the round ends once
    :data:`AFTER_RECOVERY` requests started after its last failure have succeeded (so a slow restart lengthens the
    round instead of leaving nothing to show recovery), or :data:`ROUND_TIMEOUT_S` after the kill."""
    per_round = max(requests // rounds, 2)
    traffic = soak_stub.Traffic(s.base, mixed_requests(payloads, max(2 * requests, 1000)), concurrency,
                                REQUEST_TIMEOUT_S)
    results = traffic.results
    kills: list[dict] = []

    def recovered(since: float, at: float) -> bool:
        """:data:`AFTER_RECOVERY` requests started after the kill at ``at`` and after the round's last failure (its
        requests started from ``since``) succeeded."""
        last_failure = max((r["end"] for r in results if r["start"] >= since and not _succeeded(r)), default=at)
        return sum(1 for r in results if r["start"] > max(last_failure, at) and _succeeded(r)) >= AFTER_RECOVERY

    async def conductor() -> None:
        for k in range(rounds):
            first, started = traffic.started, time.perf_counter()
            while traffic.started - first < per_round // 2:
                await asyncio.sleep(0.01)
            # a standby covers one failure at a time: every server ready before the kill (the traffic goes on)
            ready_wait = await asyncio.to_thread(soak_standby.both_ready, s.http_ports())
            pid = await asyncio.to_thread(s.triton_pid)
            s.record()
            lines = len(s.output)
            os.kill(pid, signal.SIGKILL)
            at = time.perf_counter()
            kills.append({"round": k, "started": started, "at": at, "at_request": traffic.started, "pid": pid,
                          "ready_wait_s": ready_wait})
            log(f"round {k + 1}/{rounds}, request {traffic.started}: kill -9 tritonserver (pid {pid})")
            while time.perf_counter() - at < ROUND_TIMEOUT_S and not (traffic.started - first >= per_round
                                                                    and recovered(started, at)):
                await asyncio.sleep(0.05)
            kills[-1]["recovered"] = recovered(started, at)
            kills[-1]["backoff_s"] = soak_stub.restart_backoff_s("".join(s.output[lines:]))
            s.record()  # the restarted server too

    await traffic.run(conductor())
    return sorted(results, key=lambda r: r["i"]), kills


def _succeeded(r: dict) -> bool:
    return r["status"] == 200


def round_summary(results: list[dict], kill: dict, until: float | None) -> dict:
    """One round's account: its requests are those started from the round's start until the next round's; judged on
    its fault window (from the kill to the last non-200 answer) and its lost requests."""
    mine = [r for r in results if r["start"] >= kill["started"] and (until is None or r["start"] < until)]
    recovered_at = max([r["end"] for r in mine if not _succeeded(r)] + [kill["at"]])
    after = [r for r in mine if r["start"] > recovered_at]
    p = {"round": kill["round"] + 1, "kill_at_request": kill["at_request"], "requests": len(mine),
         **soak_stub.answers(mine, EXAMPLE_FIELDS),
         "window_s": soak_stub.fault_window_s(mine, kill["at"]), "target_503_s": soak_stub.TARGET_503_S,
         "non200_s": soak_stub.non200_offsets(mine, kill["at"]),
         "recovery_s": round(recovered_at - kill["at"], 2), "restart_backoff_s": kill.get("backoff_s", 0.0),
         "ready_wait_s": kill.get("ready_wait_s", 0.0), "recovered": kill.get("recovered", True),
         "requests_after_recovery": len(after)}
    p["passed"] = (not p["lost"] and p["recovered"] and len(after) >= AFTER_RECOVERY
                   and p["window_s"] <= soak_stub.TARGET_503_S)
    return p


def kill_phases(s: ServeProcess, classifier: str, denoiser: str, rounds: int, requests: int, concurrency: int,
                log: Callable[[str], None], name: str,
                stub_kills: bool = True) -> tuple[list[dict], list[dict], list[dict]]:
    """The kills of phases 1 and 2 against ``s``, ``rounds`` of each: the denoiser's stub under denoise load and the
    classifier's under classify load, each once every server is ready (``stub_kills``: these at all); then
    ``requests`` mixed requests with tritonserver killed once per round. Phase 1's kills, phase 2's responses, and
    its kills."""
    stubs = []
    for k in range(rounds if stub_kills else 0):
        for model, load in ((denoiser, None), (classifier, soak_stub.classify_load(classifier))):
            wait = soak_standby.both_ready(s.http_ports())
            log(f"{name}, round {k + 1}/{rounds}: {model}'s backend process")
            stubs.append(soak_stub.run_phase(s, model, log, load) | {"round": k + 1, "ready_wait_s": wait})
    payloads = _payloads(classifier, denoiser, 1000)
    log(f"{name}: {requests} requests at concurrency {concurrency}, tritonserver killed {rounds} time(s)")
    results, kills = asyncio.run(_traffic(s, payloads, requests, concurrency, rounds, log))
    s.record()  # the restarted server too
    return stubs, results, kills


def mixed_summary(results: list[dict], kills: list[dict]) -> dict:
    """Phase 2's account: its responses in all and per round (:func:`round_summary`)."""
    ends = [k["started"] for k in kills[1:]] + [None]
    per_round = [round_summary(results, k, until) for k, until in zip(kills, ends, strict=True)]
    return {
        "requests": len(results),
        "status_counts": dict(Counter(str(r["status"]) for r in results)),
        "error_codes": dict(Counter(r["code"] for r in results if r["code"])),
        **soak_stub.answers(results, EXAMPLE_FIELDS),
        "rounds": per_round,
        # the widest round's fault window, the slowest recovery, the fewest requests any round served after it
        "window_s": max((r["window_s"] for r in per_round), default=None),
        "recovery_s": max((r["recovery_s"] for r in per_round), default=None),
        "requests_after_recovery": min((r["requests_after_recovery"] for r in per_round), default=0),
    }


def run(requests: int = 10_000, concurrency: int = 32, out_dir: Path | None = RESULTS,
        progress: Callable[[str], None] | None = None, stub_phase: bool = True, rounds: int = 1,
        ops: bool = True, no_standby_rounds: int = 0) -> dict:
    """The soak; returns the payload (and writes ``soak.json`` / ``soak.md`` into ``out_dir`` unless None).

    Phases 1 to 4 on the default ``unroll serve``. ``stub_phase``: run phase 1 (each model's backend process killed)
    before the mixed traffic; ``rounds``: how many times each phase kills (phase 2: ``requests`` spread over the
    rounds, see :func:`_traffic`); ``ops``: then phases 3 and 4 (:mod:`.soak_ops`: Triton stopped, a model update);
    ``no_standby_rounds``: then phase 5 (:mod:`.soak_standby`) on ``unroll serve --no-standby`` with that many kills
    of each kind, ``requests`` // 3 requests in its mixed traffic."""
    log = progress or (lambda m: None)
    classifier, denoiser = demo_model(tasks.CLASSIFICATION), demo_model(tasks.DENOISING)
    root = Path(tempfile.mkdtemp(prefix="unroll-soak-")).resolve()
    t_start = time.perf_counter()
    s = start_serve(root, [classifier, denoiser], log, standby=None)  # the default deployment, as it chooses
    log(s.standby_choice)
    deployment = _deployment(s)
    try:
        stubs, results, kills = kill_phases(s, classifier, denoiser, rounds, requests, concurrency, log,
                                            "phases 1 and 2", stub_kills=stub_phase)
        stall, deploy = _ops_phases(s, classifier, denoiser, deployment, log) if ops else (None, None)
        deployment["memory_mb"]["end"] = s.memory_mb()
    finally:
        stop_serve(s)
    left, leaked, orphans = _leftovers(s, root)
    no_standby = None
    if no_standby_rounds:
        no_standby = no_standby_phase(classifier, denoiser, no_standby_rounds, requests // 3, concurrency, log)
        left |= no_standby.pop("left_processes")
        leaked += no_standby.pop("leaked_shm")
        orphans |= no_standby.pop("orphans")
    payload = {"machine": machine_info(threads=2), "deployment": deployment, **mixed_summary(results, kills),
               "concurrency": concurrency, **_setup(classifier, denoiser, rounds, kills),
               **_left_behind(s, left, leaked, orphans), "seconds": round(time.perf_counter() - t_start, 1),
               "stub_kills": stubs, "stall": stall, "deploy": deploy, "no_standby": no_standby}
    payload |= _verdict(payload, rounds)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "soak.json").write_text(json.dumps(payload, indent=2) + "\n")
        (out_dir / "soak.md").write_text(markdown(payload))
        if out_dir.resolve() == RESULTS.resolve():  # the committed results: the docs quote them
            write_docs_paragraphs(payload, RESULTS.parent.parent)
    return payload


def _deployment(s: ServeProcess) -> dict:
    """What the default ``unroll serve`` chose (a warm standby or not, and by which rule) and its memory once ready;
    the phases add to it."""
    return {"standby": s.standby_ports is not None, "servers": len(s.triton_pids()), "choice": s.standby_choice,
            "rule": f"auto: a standby when the memory available is at least {HEADROOM:g} × the first "
                    "server's resident memory, once it is ready",
            "memory_mb": {"ready": s.memory_mb()}}


def _ops_phases(s: ServeProcess, classifier: str, denoiser: str, deployment: dict,
                log: Callable[[str], None]) -> tuple[dict, dict]:
    """Phases 3 and 4 (:mod:`.soak_ops`) on ``s``: Triton stalled, then a model deployed under load, with the
    versions each server serves after it; how long each phase first waited for every server ready goes into
    ``deployment``."""
    path, digit = _payloads(classifier, denoiser, 1)["classify"][0]
    deployment["ready_waits_s"] = [soak_standby.both_ready(s.http_ports())]
    stall = soak_ops.stall_phase(s, path, digit, Settings().triton_stall_s, log)
    deployment["ready_waits_s"].append(soak_standby.both_ready(s.http_ports()))
    deploy = soak_ops.deploy_phase(s, classifier, log)
    key = (s.onnx_dir.parent / artifacts.TRITON_KEY.name).read_text().strip()
    deploy["versions"] = {f"tritonserver on :{port}": soak_standby.served_versions(port, key, classifier)
                          for port in s.http_ports()}
    s.record()
    return stall, deploy


def _setup(classifier: str, denoiser: str, rounds: int, kills: list[dict]) -> dict:
    """The payload's account of what the soak did: its traffic mix, models, kills and targets."""
    return {"mix": {**MIX, "models": round(1 - sum(MIX.values()), 2)},
            "models": {tasks.CLASSIFICATION: classifier, tasks.DENOISING: denoiser},
            "kill": {"rounds": rounds, "signal": "SIGKILL", "target": "tritonserver",
                     "at_requests": [k["at_request"] for k in kills]},
            "target_503_s": soak_stub.TARGET_503_S,
            "backoff_on_503_s": BACKOFF_ON_503_S}


def _left_behind(s: ServeProcess, left: dict[str, str], leaked: list[str], orphans: dict[int, list[str]]) -> dict:
    """The payload's account of what the stopped services left (processes, ``/dev/shm`` regions, orphans) and what
    the default one's log showed."""
    return {"left_processes": left, "orphans": {str(p): " ".join(a)[:200] for p, a in orphans.items()},
            "leaked_shm": leaked, "shm_regions_seen": len(s.regions),
            "restart_logged": "restart" in "".join(s.output)}


def _verdict(payload: dict, rounds: int) -> dict:
    """The verdict is the default deployment's: every phase within the fault window, nothing lost, recovered; phase 5
    (--no-standby) shows its windows met or not, and must only lose nothing and recover, like any deployment; and
    nothing may be left behind."""
    stall, deploy, no_standby = payload["stall"], payload["deploy"], payload["no_standby"]
    default_passed = (len(payload["kill"]["at_requests"]) == rounds and all(r["passed"] for r in payload["rounds"])
                      and all(x["passed"] for x in payload["stub_kills"])
                      and all(p["passed"] for p in (stall, deploy) if p is not None))
    return {"default_passed": default_passed,
            "passed": (default_passed and not payload["left_processes"] and not payload["leaked_shm"]
                       and not payload["orphans"] and (no_standby is None or no_standby["correct"]))}


def _leftovers(s: ServeProcess, root: Path) -> tuple[dict[str, str], list[str], dict[int, list[str]]]:
    """After ``s`` stopped: its servers' processes still there, their ``/dev/shm`` regions still there, and
    processes still running from ``root`` (which is then removed)."""
    left = _still_there(s.server_pids, LEFTOVER_GRACE_S)
    leaked = sorted(r for r in s.regions if (SHM_DIR / r).exists())
    orphans = processes_with(str(root))
    shutil.rmtree(root, ignore_errors=True)
    return left, leaked, orphans


def no_standby_phase(classifier: str, denoiser: str, rounds: int, requests: int, concurrency: int,
                     log: Callable[[str], None]) -> dict:
    """Phase 5 (:mod:`.soak_standby`) on a new ``unroll serve --no-standby``: the stub kills and tritonserver kills of
    phases 1 and 2; its summary with what the service left behind."""
    root = Path(tempfile.mkdtemp(prefix="unroll-soak-no-standby-")).resolve()
    s = start_serve(root, [classifier, denoiser], log, standby=False)
    try:
        memory = s.memory_mb()
        stubs, results, kills = kill_phases(s, classifier, denoiser, rounds, max(requests, 2), concurrency, log,
                                            "phase 5 (--no-standby)")
    finally:
        stop_serve(s)
    left, leaked, orphans = _leftovers(s, root)
    mixed = mixed_summary(results, kills)
    return soak_standby.summary(stubs, mixed["rounds"], memory, s.standby_choice, soak_stub.TARGET_503_S) | {
        "status_counts": mixed["status_counts"], "left_processes": left, "leaked_shm": leaked, "orphans": orphans}


def _round_rows(rounds: list[dict]) -> list[str]:
    """Phase 2's table (and phase 5's tritonserver kills): one row per round, the fault window judged on each."""
    return ["| round | killed at request | succeeded | 503 | lost | fault window (s) | ≤ "
            f"{soak_stub.TARGET_503_S:g} s | backoff (s) | waited for every server ready (s) | succeeded after it |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *(f"| {r['round']} | {r['kill_at_request']:,} | {r['ok']:,} | {r['unavailable_503']:,} | **{r['lost']}** | "
              f"**{r['window_s']}** | {soak_stub.met(r['window_s'], r['target_503_s'])} | {r['restart_backoff_s']:g} | "
              f"{r['ready_wait_s']:g} | {r['requests_after_recovery']:,} |" for r in rounds)]


def _memory(mb: dict[str, float]) -> str:
    return ", ".join(f"{k}: {v:,.0f} MiB" for k, v in mb.items())


def markdown(p: dict) -> str:
    m, d = p["machine"], p["deployment"]
    rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(p["status_counts"].items()))
    kill = p["kill"]
    return "\n".join([
        "# Soak: parts of Triton killed under load",
        "",
        f"{m.get('cpu', '?')}, {m.get('logical_cores', '?')} cores; `unroll bench soak` ({p['seconds']} s). Every "
        "phase is judged on what its clients saw: the **fault window**, from the kill or stop (or the first non-200 "
        "answer, if earlier) to the last non-200 answer, against "
        f"{p['target_503_s']:g} s, and the **lost** requests (neither success nor 503 with Retry-After). The "
        "supervisor's crash-loop backoff is shown beside the window, never taken out of it.",
        "",
        f"## Phases 1 to 4: the default `unroll serve` ({d['servers']} tritonserver"
        + ("s: a warm standby" if d["standby"] else ", no standby") + ")",
        "",
        f"What it chose and why: `{d['choice']}` (rule: {d['rule']}).",
        "",
        f"- memory (resident, each server with its backend processes): once ready {_memory(d['memory_mb']['ready'])}; "
        f"at the end of phase 4 {_memory(d['memory_mb'].get('end', {}))}",
        "",
        *soak_stub.markdown(p["stub_kills"], "Phase 1: a backend process killed"),
        f"### Phase 2: {p['requests']:,} mixed requests at concurrency {p['concurrency']}, tritonserver killed "
        f"(SIGKILL) {kill['rounds']} time(s)",
        "",
        f"Models: {p['models'][tasks.CLASSIFICATION]} (trained λ and lam=auto), {p['models'][tasks.DENOISING]} (64×64 "
        "crops, σ=25), and /v1/models. Each round kills the tritonserver that serves the traffic halfway through its "
        f"requests, once every server is ready, and lasts until {AFTER_RECOVERY} requests started after its last "
        f"failure have succeeded; clients pause {p['backoff_on_503_s']} s after a 503.",
        "",
        "| status | requests |", "|---|---|", rows, "",
        *_round_rows(p["rounds"]), "",
        f"- succeeded: {p['ok']:,}; answered 503 (Triton unavailable): {p['unavailable_503']:,} "
        f"({p['unavailable_with_retry_after']:,} with Retry-After); **lost: {p['lost']}**",
        "",
        *soak_ops.markdown(p.get("stall"), p.get("deploy")),
        *(["- versions served after the deployment: "
           + ", ".join(f"{k}: {v}" for k, v in p["deploy"]["versions"].items()), ""] if p.get("deploy") else []),
        f"- the default deployment **{'passed' if p['default_passed'] else 'FAILED'}** phases 1 to 4 (every fault "
        f"window within {p['target_503_s']:g} s, nothing lost, traffic recovered after each kill)",
        "",
        *soak_standby.markdown(p.get("no_standby"), _round_rows(p["no_standby"]["rounds"]) if p.get("no_standby")
                               else []),
        "## Verdict",
        "",
        f"- after stopping: processes of any Triton server left: {len(p['left_processes'])}; orphans under the run's "
        f"folders: {len(p['orphans'])}; leaked /dev/shm regions: {len(p['leaked_shm'])} of "
        f"{p['shm_regions_seen']} seen (phases 1 to 4)",
        f"- **{'passed' if p['passed'] else 'FAILED'}**: the verdict is the default deployment's (phases 1 to 4); "
        "phase 5's fault windows are shown met or not met and not required, its lost requests and what it left "
        "behind are (a lost request is a fault in any deployment)",
        "",
    ])


#: The README's soak paragraph sits between these markers; :func:`readme_paragraph` writes it from soak.json.
README_BEGIN, README_END = "<!-- soak: generated from benchmarks/results/soak.json -->", "<!-- /soak -->"
#: The standby's cost and effect in the README's "When Triton crashes" (:func:`readme_standby_paragraph`).
STANDBY_BEGIN = "<!-- soak-standby: generated from benchmarks/results/soak.json -->"
STANDBY_END = "<!-- /soak-standby -->"


def _kills(p: dict) -> list[dict]:
    """Every kill of the default deployment (phase 1's stubs, phase 2's rounds)."""
    return [*p["stub_kills"], *p["rounds"]]


def _widest(kills: list[dict]) -> float:
    return max((k["window_s"] for k in kills if k["window_s"] is not None), default=0.0)


def _within(kills: list[dict], target_s: float) -> int:
    return sum(1 for k in kills if k["window_s"] is not None and k["window_s"] <= target_s)


def readme_paragraph(p: dict) -> str:
    """The README's summary of a soak payload (numbers from the results, never typed by hand)."""
    d, stubs, target = p["deployment"], p["stub_kills"], p["target_503_s"]
    ready = d["memory_mb"]["ready"]
    text = ("**Soak** ([`soak.md`](benchmarks/results/soak.md), `unroll bench soak`) on the default `unroll serve`, "
            + ("which here ran a warm standby" if d["standby"] else "which here ran no standby")
            + f" ({len(ready)} tritonserver(s), {' and '.join(f'{v:,.0f}' for v in ready.values())} MiB resident "
            f"once ready). Every phase is judged on the fault window its clients saw, from the kill to the last "
            f"non-200 answer (the supervisor's backoff inside it, not taken out), against {target:g} s, and on lost "
            "requests. ")
    if stubs:
        models = sorted({x["model"] for x in stubs})
        text += (f"Phase 1, {len(stubs)} kills: the Python-backend stub of {' and of '.join(models)} killed (SIGKILL) "
                 f"under load ({stubs[0]['clients']} clients): {sum(x['ok'] for x in stubs):,} succeeded, "
                 f"{sum(x['unavailable_503'] for x in stubs):,} got 503, **{sum(x['lost'] for x in stubs)} lost**, "
                 f"the widest window **{_widest(stubs)} s** (within {target:g} s in {_within(stubs, target)} of "
                 f"{len(stubs)}). ")
    rounds = p["rounds"]
    text += (f"Phase 2: {p['requests']:,} mixed requests (classify with the trained λ and with `lam=auto`, denoise "
             f"64×64 crops, `/v1/models`) at concurrency {p['concurrency']}, `tritonserver` killed (SIGKILL) "
             f"{len(rounds)} time(s): {p['ok']:,} succeeded, {p['unavailable_503']:,} got 503, **{p['lost']} lost**, "
             f"the widest window **{_widest(rounds)} s** (within {target:g} s in {_within(rounds, target)} of "
             f"{len(rounds)}). " + _ops_sentence(p) + _no_standby_sentence(p.get("no_standby"), target)
             + "After stopping, "
             + ("no process and no `/dev/shm` region of any of its Triton servers was left."
                if not (p["left_processes"] or p["orphans"] or p["leaked_shm"]) else
                f"{len(p['left_processes'])} processes and {len(p['leaked_shm'])} `/dev/shm` regions were left.")
             + f" **{'Passed' if p['passed'] else 'FAILED'}** (the default deployment's verdict).")
    return textwrap.fill(text, width=116, break_long_words=False, break_on_hyphens=False)


def _ops_sentence(p: dict) -> str:
    """Phases 3 and 4 in a sentence of the README's paragraph (empty when the run had none)."""
    stall, deploy = p.get("stall"), p.get("deploy")
    text = ""
    if stall:
        text += (f"Phase 3: `tritonserver` stopped (SIGSTOP) for {stall['stall_s']:g} s: **{stall['lost']} lost**, "
                 f"window **{stall['window_s']} s**, no request waited more than {stall['longest_wait_s']} s for an "
                 f"answer, {stall['served_while_stopped']:,} answered while it was still stopped. ")
    if deploy:
        same = len({tuple(v) for v in deploy.get("versions", {}).values()}) == 1
        text += (f"Phase 4: `unroll deploy` of the classifier under load ({deploy['deploy_s']} s): "
                 f"{deploy['ok']:,} succeeded, **{deploy['lost']} lost**, {deploy['unavailable_503']} got 503"
                 + (", the same versions on every server" if same else ", **the servers' versions differ**")
                 + ". ")
    return text


def _no_standby_sentence(ns: dict | None, target: float) -> str:
    """Phase 5 in a sentence of the README's paragraph (empty when the run had none)."""
    if not ns:
        return ""
    return (f"Phase 5, the same kills on `unroll serve --no-standby` ({len(ns['stub_kills'])} stub kills, "
            f"{len(ns['rounds'])} `tritonserver` kills; one server, {max(ns['memory_mb'].values()):,.0f} MiB "
            f"resident): {ns['ok']:,} succeeded, {ns['unavailable_503']:,} got 503, **{ns['lost']} lost**, windows "
            f"within {target:g} s in **{ns['windows_met']} of {ns['kills']}**, the widest **{ns['longest_window_s']} "
            f"s** (shown, not required; {_backoff_clause(ns)}). ")


def _backoff_clause(ns: dict) -> str:
    """How phase 5's crash-loop backoff grew, and the widest window of its kills that had none before them."""
    kills = [*ns["stub_kills"], *ns["rounds"]]
    fresh = [k for k in kills if not k["restart_backoff_s"]]
    return (f"the supervisor's backoff, inside the windows, grew to {max(k['restart_backoff_s'] for k in kills):g} s "
            "as kills came less than a minute apart; "
            + (f"the widest window of the {len(fresh)} kill(s) with none: {_widest(fresh)} s" if fresh else
               "no kill came without one"))


def readme_standby_paragraph(p: dict) -> str:
    """What the standby costs and saves, for the README's "When Triton crashes" (numbers from the results)."""
    d, ns, target = p["deployment"], p.get("no_standby"), p["target_503_s"]
    kills, ready = _kills(p), d["memory_mb"]["ready"]
    text = (f"Measured ([`soak.md`](benchmarks/results/soak.md), `unroll bench soak`): on this machine the default "
            f"chose `{d['choice']}`. ")
    if d["standby"]:
        first, second = list(ready.values())[:2]
        text += (f"The standby's price: {second:,.0f} MiB resident beside the first server's {first:,.0f} MiB (each "
                 "with its backend processes, once ready). ")
    text += (f"On the default deployment a killed backend process or `tritonserver` cost clients at most "
             f"**{_widest(kills)} s** of non-200 answers ({_within(kills, target)} of {len(kills)} kills within "
             f"{target:g} s, {sum(k['lost'] for k in kills)} requests lost)")
    if ns:
        nkills = [*ns["stub_kills"], *ns["rounds"]]
        text += (f"; with `--no-standby`, at most **{_widest(nkills)} s** ({_within(nkills, target)} of {len(nkills)} "
                 f"within {target:g} s, {ns['lost']} lost; {_backoff_clause(ns)})")
    return textwrap.fill(text + ".", width=116, break_long_words=False, break_on_hyphens=False)


def write_docs_paragraphs(p: dict, root: Path) -> bool:
    """Replace the text between the soak markers with :func:`readme_paragraph`, and between the standby markers with
    :func:`readme_standby_paragraph`, on the pages under ``root`` that hold them; ``False`` if a pair is nowhere."""
    main = write_docs_blocks(root, README_BEGIN, README_END, readme_paragraph(p))
    return write_docs_blocks(root, STANDBY_BEGIN, STANDBY_END, readme_standby_paragraph(p)) and main
