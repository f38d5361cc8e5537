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
import sys
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
from unroll.benchmarks import soak_stub
from unroll.benchmarks.common import RESULTS, demo_model, machine_info, png_bytes, write_readme_block
from unroll.registry import get_spec
from unroll.serving.triton import SHM_DIR, free_ports, group_members, processes_with, shm_regions

READY_TIMEOUT_S = 300.0
#: How long processes of the stopped server may take to disappear before they count as left behind.
LEFTOVER_GRACE_S = 10.0
REQUEST_TIMEOUT_S = 60.0
#: A client's pause after a 503 before its next request (the gateway advises Retry-After: 5 s; a short pause
#: keeps the soak going through the outage instead of burning the remaining requests in a second).
BACKOFF_ON_503_S = 0.25
#: Share of the traffic per kind (the rest is /v1/models).
MIX = {"classify": 0.55, "classify-auto": 0.15, "denoise": 0.25}


@dataclass
class ServeProcess:
    """A running ``unroll serve`` subprocess and what it printed."""

    proc: subprocess.Popen
    base: str
    repo: Path
    #: Triton's HTTP, gRPC and metrics ports.
    triton_ports: tuple[int, int, int]
    output: list[str] = field(default_factory=list)
    regions: set[str] = field(default_factory=set)
    server_pids: set[int] = field(default_factory=set)

    def triton_pid(self) -> int | None:
        for pid, argv in processes_with(f"--model-repository={self.repo}").items():
            if argv[0].endswith("tritonserver"):
                return pid
        return None

    def stub_pid(self, model: str) -> int | None:
        """The Python-backend stub serving ``model`` in the current server (its ``model.py`` path names it)."""
        server = self.triton_pid()
        members = group_members(server) if server is not None else {}
        return next((p for p, argv in members.items() if p != server and any(f"/{model}/" in a for a in argv)), None)

    def record(self) -> None:
        """Remember the current server, its stubs and their shared-memory regions (to check clean-up later)."""
        pid = self.triton_pid()
        if pid is not None:
            members = group_members(pid)
            self.server_pids |= set(members)
            self.regions |= shm_regions(list(members.values()))


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



def start_serve(root: Path, models: list[str], log: Callable[[str], None]) -> ServeProcess:
    """``python -m unroll.app.serve`` from ``root`` (its build/ and repository go there) on spare ports."""
    port, http, grpc, metrics = free_ports(4)
    repo = root / artifacts.REPOSITORY_DIR.name
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNROLL_")}
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-m", "unroll.app.serve", "--models", ",".join(models), "--port", str(port),
           "--triton-http-port", str(http), "--triton-grpc-port", str(grpc), "--triton-metrics-port", str(metrics),
           "--repo", str(repo), "--onnx-dir", str(root / "onnx"), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    s = ServeProcess(proc, f"http://127.0.0.1:{port}", repo, (http, grpc, metrics))
    ready = threading.Event()

    def pump() -> None:
        for line in proc.stdout:
            s.output.append(line)
            if "unroll gateway ready" in line:
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    log("starting unroll serve (exports and repository on first run)")
    if not ready.wait(READY_TIMEOUT_S) or proc.poll() is not None:
        stop_serve(s)
        raise RuntimeError("unroll serve did not become ready:\n" + "".join(s.output)[-4000:])
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


async def _traffic(s: ServeProcess, payloads: dict, requests: int, concurrency: int, kill_at: int,
                   log: Callable[[str], None]) -> tuple[list[dict], float | None]:
    import httpx

    rng = np.random.default_rng(0)
    kinds = rng.choice(list(MIX) + ["models"], size=requests, p=[*MIX.values(), 1 - sum(MIX.values())])
    results: list[dict] = []
    next_i = 0
    killed_at: float | None = None

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal next_i, killed_at
        while next_i < requests:
            i = next_i
            next_i += 1
            if i == kill_at:
                pid = s.triton_pid()
                s.record()
                os.kill(pid, signal.SIGKILL)
                killed_at = time.perf_counter()
                log(f"request {i}: kill -9 tritonserver (pid {pid})")
            kind = str(kinds[i])
            t0 = time.perf_counter()
            try:
                if kind == "models":
                    r = await client.get("/v1/models")
                else:
                    path, body = payloads[kind][i % len(payloads[kind])]
                    r = await client.post(path, content=body, headers={"Content-Type": "image/png"})
                status, code = r.status_code, (r.json().get("error", {}).get("code") if r.status_code >= 400 and
                                              r.headers.get("content-type", "").startswith("application/json")
                                              else None)
                retry_after = r.headers.get("retry-after")
            except httpx.HTTPError as e:
                status, code, retry_after = None, type(e).__name__, None
            results.append({"i": i, "kind": kind, "status": status, "code": code, "retry_after": retry_after,
                            "start": t0, "end": time.perf_counter()})
            if status == 503:
                await asyncio.sleep(BACKOFF_ON_503_S)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=s.base, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return sorted(results, key=lambda r: r["i"]), killed_at


def run(requests: int = 10_000, concurrency: int = 32, out_dir: Path | None = Path("benchmarks/results"),
        progress: Callable[[str], None] | None = None, stub_phase: bool = True) -> dict:
    """The soak; returns the payload (and writes ``soak.json`` / ``soak.md`` into ``out_dir`` unless None).

    ``stub_phase``: run phase 1 (the denoiser's backend process killed) before the mixed traffic."""
    log = progress or (lambda m: None)
    classifier, denoiser = demo_model(tasks.CLASSIFICATION), demo_model(tasks.DENOISING)
    root = Path(tempfile.mkdtemp(prefix="unroll-soak-")).resolve()
    t_start = time.perf_counter()
    s = start_serve(root, [classifier, denoiser], log)
    stub = None
    try:
        if stub_phase:
            stub = soak_stub.run_phase(s, denoiser, log)
        payloads = _payloads(classifier, denoiser, 1000)
        log(f"{requests} requests at concurrency {concurrency}")
        results, killed_at = asyncio.run(_traffic(s, payloads, requests, concurrency, requests // 2, log))
        s.record()  # the restarted server too
        serve_log = "".join(s.output)
    finally:
        stop_serve(s)
    left = _still_there(s.server_pids, LEFTOVER_GRACE_S)
    leaked = sorted(r for r in s.regions if (SHM_DIR / r).exists())
    orphans = processes_with(str(root))
    shutil.rmtree(root, ignore_errors=True)

    ok = [r for r in results if r["status"] is not None and r["status"] < 400]
    failed = [r for r in results if r not in ok]
    unavailable = [r for r in failed if r["status"] == 503]
    lost = [r for r in failed if r["status"] != 503]
    # recovered once the last failure has been answered: everything started later succeeded (by definition),
    # so what proves recovery is how much traffic that was
    recovered_at = max((r["end"] for r in failed), default=killed_at)
    after_recovery = [r for r in results if recovered_at is not None and r["start"] > recovered_at]
    payload = {
        "machine": machine_info(threads=2),
        "requests": requests, "concurrency": concurrency, "mix": {**MIX, "models": round(1 - sum(MIX.values()), 2)},
        "models": {tasks.CLASSIFICATION: classifier, tasks.DENOISING: denoiser},
        "kill": {"at_request": requests // 2, "signal": "SIGKILL", "target": "tritonserver"},
        "status_counts": dict(Counter(str(r["status"]) for r in results)),
        "error_codes": dict(Counter(r["code"] for r in results if r["code"])),
        "ok": len(ok), "unavailable_503": len(unavailable),
        "unavailable_with_retry_after": sum(1 for r in unavailable if r["retry_after"]),
        "lost": len(lost), "lost_examples": [{k: r[k] for k in ("i", "kind", "status", "code")} for r in lost[:10]],
        "recovery_s": None if killed_at is None else round(recovered_at - killed_at, 2),
        "requests_after_recovery": len(after_recovery),
        "backoff_on_503_s": BACKOFF_ON_503_S,
        "left_processes": left, "orphans": {str(p): " ".join(a)[:200] for p, a in orphans.items()},
        "leaked_shm": leaked, "shm_regions_seen": len(s.regions),
        "restart_logged": "restart" in serve_log,
        "seconds": round(time.perf_counter() - t_start, 1),
        "stub_kill": stub,
    }
    payload["passed"] = (killed_at is not None and not lost and len(after_recovery) >= requests // 10
                         and not left and not leaked and not orphans and (stub is None or stub["passed"]))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "soak.json").write_text(json.dumps(payload, indent=2) + "\n")
        (out_dir / "soak.md").write_text(markdown(payload))
        if out_dir.resolve() == RESULTS.resolve():  # the committed results: the README quotes them
            write_readme_paragraph(payload, RESULTS.parent.parent / "README.md")
    return payload


def markdown(p: dict) -> str:
    m = p["machine"]
    rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(p["status_counts"].items()))
    stub = p.get("stub_kill")
    return "\n".join([
        "# Soak: parts of Triton killed under load" if stub else
        f"# Soak: {p['requests']:,} mixed requests at concurrency {p['concurrency']}, tritonserver killed "
        f"(SIGKILL) at request {p['kill']['at_request']:,}",
        "",
        f"{m.get('cpu', '?')}, {m.get('logical_cores', '?')} cores; `unroll bench soak` ({p['seconds']} s), one "
        "`unroll serve` throughout.",
        "",
        *(soak_stub.markdown(stub) if stub else []),
        *([f"## Phase 2: {p['requests']:,} mixed requests at concurrency {p['concurrency']}, tritonserver killed "
           f"(SIGKILL) at request {p['kill']['at_request']:,}", ""] if stub else []),
        f"Models: {p['models'][tasks.CLASSIFICATION]} (trained λ and lam=auto), {p['models'][tasks.DENOISING]} (64×64 "
        "crops, σ=25), and /v1/models.",
        "",
        "| status | requests |", "|---|---|", rows, "",
        f"- succeeded: {p['ok']:,}; answered 503 (Triton unavailable): {p['unavailable_503']:,} "
        f"({p['unavailable_with_retry_after']:,} with Retry-After)",
        f"- **lost** (neither success nor 503: other 5xx, timeouts, dropped connections): **{p['lost']}**",
        f"- last 503 answered {p['recovery_s']} s after the kill; every one of the {p['requests_after_recovery']:,} "
        f"requests started after it succeeded (clients pause {p['backoff_on_503_s']} s after a 503)",
        f"- after stopping: processes of any Triton server left: {len(p['left_processes'])}; orphans under the run's "
        f"folder: {len(p['orphans'])}; leaked /dev/shm regions: {len(p['leaked_shm'])} of "
        f"{p['shm_regions_seen']} seen (every server of the run)",
        f"- **{'passed' if p['passed'] else 'FAILED'}**" + (" (both phases)" if stub else ""),
        "",
    ])


#: The README's soak paragraph sits between these markers; :func:`readme_paragraph` writes it from soak.json.
README_BEGIN, README_END = "<!-- soak: generated from benchmarks/results/soak.json -->", "<!-- /soak -->"


def readme_paragraph(p: dict) -> str:
    """The README's summary of a soak payload (numbers from the results, never typed by hand)."""
    text = ""
    stub = p.get("stub_kill")
    if stub:
        text += (f"**Soak** ([`soak.md`](benchmarks/results/soak.md), `unroll bench soak`), one real `unroll serve`. "
                 f"Phase 1: {stub['clients']} clients denoising {stub['image']} images, the denoiser's "
                 f"Python-backend stub killed (SIGKILL): {stub['ok']:,} succeeded, {stub['unavailable_503']:,} got 503 "
                 f"with `Retry-After`, **{stub['lost']} lost**; the last 503 came **{stub['unavailable_s']} s** after "
                 f"the kill (target ≤ {stub['target_503_s']:g} s)"
                 + (", tritonserver replaced by the supervisor" if stub["triton_replaced"] else "") + ". Phase 2: ")
    else:
        text += "**Soak** ([`soak.md`](benchmarks/results/soak.md), `unroll bench soak`): "
    text += (f"{p['requests']:,} mixed requests (classify with the trained λ and with `lam=auto`, denoise 64×64 "
             f"crops, `/v1/models`) at concurrency {p['concurrency']}, `tritonserver` killed (SIGKILL) at request "
             f"{p['kill']['at_request']:,}: {p['ok']:,} succeeded, {p['unavailable_503']:,} got 503 with "
             f"`Retry-After`, **{p['lost']} lost**; the last 503 came {p['recovery_s']} s after the kill and all "
             f"{p['requests_after_recovery']:,} requests started after it succeeded (clients pause "
             f"{p['backoff_on_503_s']} s after a 503). After stopping, "
             + ("no process and no `/dev/shm` region of any of its Triton servers was left."
                if not (p["left_processes"] or p["orphans"] or p["leaked_shm"]) else
                f"{len(p['left_processes'])} processes and {len(p['leaked_shm'])} `/dev/shm` regions were left."))
    return textwrap.fill(text, width=116, break_long_words=False, break_on_hyphens=False)


def write_readme_paragraph(p: dict, readme: Path) -> bool:
    """Replace the text between the README's soak markers with :func:`readme_paragraph`; ``False`` if none."""
    return write_readme_block(readme, README_BEGIN, README_END, readme_paragraph(p))
