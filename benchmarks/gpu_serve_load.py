"""The GPU serving check's load generator: closed-loop HTTP/1.1 over asyncio (uvloop when present) with h11, one
keep-alive connection per request in flight, spread over several processes so the client is not the bottleneck.

Why its own: the lent GPU machine has neither ``ab`` nor ``perf_analyzer`` (``unroll bench serve`` uses both), and
one Python thread per request in flight (``serve_load.closed_loop``) cannot hold 256 in flight cheaply. Each process
reports the CPU seconds it spent in the measured window, so a result the client limited shows as a client near 100 %
of its cores. Standalone (stdlib, h11, optionally uvloop): :func:`drive` runs this file as a script in each process,
so it needs no installed ``unroll``.

A level: every process opens its connections, sends for ``warmup_s`` (not recorded), then records from the shared
wall-clock ``start_at`` for ``duration_s``; requests in flight at the deadline finish and count, none starts after
it. Anything but a 200 is an error (its first bytes kept).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

#: Error messages each process keeps (the rest are counted).
MAX_ERROR_SAMPLES = 3


@dataclass
class Request:
    """One request to send (the level cycles through its requests)."""

    path: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class LevelResult:
    """A level's merged result: latencies (ms) of the measured requests, errors, wall seconds, client CPU seconds."""

    latencies_ms: list[float]
    errors: int
    error_samples: list[str]
    elapsed_s: float
    client_cpu_s: float
    processes: int
    concurrency: int
    #: Each client process's measured window (wall-clock start, end): the processes ran together where they overlap.
    windows: list[tuple[float, float]] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return len(self.latencies_ms)

    @property
    def throughput(self) -> float:
        return self.requests / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def client_cpu_share(self) -> float:
        """The client's CPU use as a share of its processes' cores (1.0: every client process busy all along)."""
        return self.client_cpu_s / (self.elapsed_s * self.processes) if self.elapsed_s > 0 else 0.0


#: Seconds allowed for the client processes to start before the warm-up (a loaded machine starts Python slowly: a
#: process that started after the window had closed would report no request at all).
CLIENT_START_S = 1.0


async def _connection(host: str, port: int, requests: list[Request], offset: int, step: int, start_at: float,
                      deadline: float, out: dict) -> None:
    import h11

    reader, writer = await asyncio.open_connection(host, port)
    conn = h11.Connection(h11.CLIENT)
    i = offset
    try:
        while (t0 := time.time()) < deadline:
            req = requests[i % len(requests)]
            i += step
            headers = [("Host", f"{host}:{port}"), ("Content-Length", str(len(req.body))), *req.headers.items()]
            writer.write(conn.send(h11.Request(method="POST", target=req.path, headers=headers))
                         + conn.send(h11.Data(data=req.body)) + conn.send(h11.EndOfMessage()))
            status, first = 0, b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await reader.read(262144)
                    if not data:
                        raise ConnectionError("the server closed the connection")
                    conn.receive_data(data)
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    if status != 200 and len(first) < 200:
                        first += bytes(event.data[:200])
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    raise ConnectionError("the server closed the connection")
            conn.start_next_cycle()
            t1 = time.time()
            if t0 >= start_at:
                if status == 200:
                    out["lat"].append((t1 - t0) * 1e3)
                else:
                    out["errors"] += 1
                    if len(out["samples"]) < MAX_ERROR_SAMPLES:
                        out["samples"].append(f"HTTP {status}: {first.decode(errors='replace')[:160]}")
    except Exception as e:  # noqa: BLE001 (a broken connection is this level's error, not the process's)
        out["errors"] += 1
        if len(out["samples"]) < MAX_ERROR_SAMPLES:
            out["samples"].append(f"{type(e).__name__}: {e}"[:200])
    finally:
        writer.close()


async def _run(spec: dict) -> dict:
    requests = [Request(r["path"], base64.b64decode(r["body"]), r.get("headers", {})) for r in spec["requests"]]
    out: dict = {"lat": [], "errors": 0, "samples": []}
    start_at, deadline = spec["start_at"], spec["start_at"] + spec["duration_s"]
    n = spec["connections"]
    tasks = [_connection(spec["host"], spec["port"], requests, spec["offset"] + k, spec["step"], start_at, deadline,
                         out) for k in range(n)]
    wait = start_at - time.time()
    runner = asyncio.gather(*tasks)
    if wait > 0:
        await asyncio.sleep(wait)
    cpu0 = time.process_time()
    wall0 = time.time()
    await runner
    out["cpu_s"] = time.process_time() - cpu0
    end = time.time()
    out["elapsed_s"] = max(end, deadline) - max(wall0, start_at)
    return {"lat": out["lat"], "errors": out["errors"], "samples": out["samples"], "cpu_s": out["cpu_s"],
            "elapsed_s": out["elapsed_s"], "window": [max(wall0, start_at), end]}


def client_main() -> int:
    """One client process: the level's spec as JSON on stdin, its result as JSON on stdout."""
    spec = json.loads(sys.stdin.read())
    try:
        import uvloop

        uvloop.install()
        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    result = asyncio.run(_run(spec))
    result["loop"] = loop
    # Plain writes to the pipe: after uvloop's loop, a result larger than the pipe (64 KiB) written through
    # sys.stdout was cut off at 64 KiB whenever the parent read late (seen on a loaded machine; reproduced with a
    # parent that reads after a pause), while os.write delivers it all.
    view = memoryview(json.dumps(result).encode())
    while view:
        view = view[os.write(sys.stdout.fileno(), view):]
    return 0


def drive(host: str, port: int, requests: list[Request], concurrency: int, duration_s: float, warmup_s: float,
          processes: int = 1, python: str | None = None, start_at: float | None = None) -> LevelResult:
    """Run one level: ``concurrency`` connections over ``processes`` client processes (at most one per connection),
    recording from wall-clock ``start_at`` (default: :data:`CLIENT_START_S` for the processes to start, then
    ``warmup_s``); returns when every process has reported."""
    processes = max(1, min(processes, concurrency))
    start_at = start_at if start_at is not None else time.time() + CLIENT_START_S + warmup_s
    encoded = [{"path": r.path, "body": base64.b64encode(r.body).decode(), "headers": r.headers} for r in requests]
    procs = []
    for k in range(processes):
        share = concurrency // processes + (1 if k < concurrency % processes else 0)
        spec = {"host": host, "port": port, "requests": encoded, "connections": share, "offset": k,
                "step": processes, "start_at": start_at, "duration_s": duration_s}
        p = subprocess.Popen([python or sys.executable, str(Path(__file__).resolve())], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append((p, json.dumps(spec)))
    results = []
    # every process gets its spec at once (one after another, each would start when the one before had ended)
    with ThreadPoolExecutor(len(procs)) as pool:
        answers = list(pool.map(lambda ps: ps[0].communicate(ps[1], timeout=duration_s + warmup_s + 300), procs))
    for (p, _), (out, err) in zip(procs, answers, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"load client exited {p.returncode}: {err.strip()[-400:]}")
        results.append(json.loads(out))
    return LevelResult(
        latencies_ms=[x for r in results for x in r["lat"]], errors=sum(r["errors"] for r in results),
        error_samples=[s for r in results for s in r["samples"]][:MAX_ERROR_SAMPLES],
        elapsed_s=max(r["elapsed_s"] for r in results), client_cpu_s=sum(r["cpu_s"] for r in results),
        processes=processes, concurrency=concurrency, windows=[tuple(r["window"]) for r in results])


def _serve_nothing(port: int, seconds: float) -> int:
    """A server that costs next to nothing: one canned 200 per request head (bodies must be empty), for
    :func:`ceiling`."""
    canned = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tail = b""
        while data := await reader.read(262144):
            data = tail + data
            n = data.count(b"\r\n\r\n")
            tail = data[data.rfind(b"\r\n\r\n") + 4:] if n else data
            if n:
                writer.write(canned * n)
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        print("ready", flush=True)
        async with server:
            await asyncio.sleep(seconds)

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main())
    return 0


def ceiling(port: int, concurrency: int = 64, processes: int = 1, duration_s: float = 2.0,
            python: str | None = None) -> LevelResult:
    """The load generator's own ceiling: ``processes`` client processes against a server that does nothing
    (:func:`_serve_nothing`, its own process), empty POSTs."""
    server = subprocess.Popen([python or sys.executable, str(Path(__file__).resolve()), "--serve", str(port),
                               str(duration_s + 30)], stdout=subprocess.PIPE, text=True)
    try:
        server.stdout.readline()  # "ready"
        return drive("127.0.0.1", port, [Request("/", b"")], concurrency, duration_s, 0.3, processes, python)
    finally:
        server.kill()
        server.wait()


def default_processes(concurrency: int, cores: int | None = None) -> int:
    """Client processes for ``concurrency`` in flight: one per 32 connections, at most a quarter of the cores."""
    cores = cores or os.cpu_count() or 1
    return max(1, min(-(-concurrency // 32), max(1, cores // 4)))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        sys.exit(_serve_nothing(int(sys.argv[2]), float(sys.argv[3])))
    sys.exit(client_main())
