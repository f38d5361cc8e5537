"""The GPU serving check's load: closed-loop levels on the project's load engine (:mod:`.loadgen`), spread over
several client processes so the client is not the bottleneck, and the engine's own ceiling on the machine.

Why several processes: the lent GPU machine has no ``perf_analyzer``, and one Python event loop
cannot hold 256 requests in flight cheaply; :func:`.loadgen.run_processes` runs the same engine in each process, one
measured window for all, and reports the client CPU they spent, so a level the client limited shows as a client
near 100 % of its cores. What it needs on the lent machine is what the engine needs: NumPy and ``h11`` (which
``httpx``, there too, is built on), and ``unroll`` importable by the interpreter that runs the check (its script
makes it so).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable, Sequence

from unroll.benchmarks.loadgen import LevelResult, Load, Payload, run_processes

#: Seconds a request may take before it counts as a ``timeout`` (512² denoising at 256 in flight queues for a while).
REQUEST_TIMEOUT_S = 120.0
#: Warm-up of a :func:`ceiling` level.
CEILING_WARMUP_S = 0.3


def level(base_url: str, payloads: Sequence[Payload], concurrency: int, duration_s: float, warmup_s: float,
          processes: int = 1, on_measure_start: Callable[[], object] | None = None) -> LevelResult:
    """One closed-loop level: ``concurrency`` in flight against ``base_url`` over ``processes`` client processes
    (at most one per request in flight); ``on_measure_start`` runs here when their measured window opens."""
    return run_processes(base_url, payloads, Load(concurrency=concurrency), duration_s, warmup_s, processes,
                         REQUEST_TIMEOUT_S, on_measure_start=on_measure_start)


def _serve_nothing(port: int, seconds: float) -> int:
    """A server that costs next to nothing: one canned 200 per request head (bodies must be empty), for
    :func:`ceiling` (uvloop when present: the server must not be what limits the client)."""
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


def ceiling(port: int, concurrency: int = 64, processes: int = 1, duration_s: float = 2.0) -> LevelResult:
    """The load engine's own ceiling here: ``processes`` client processes, ``concurrency`` empty POSTs in flight,
    against a server that does nothing (:func:`_serve_nothing`, in its own process on ``port``)."""
    server = subprocess.Popen([sys.executable, "-m", "unroll.benchmarks.gpu_serve_load", "--serve", str(port),
                               str(duration_s + 30)], stdout=subprocess.PIPE, text=True)
    try:
        server.stdout.readline()  # "ready"
        return level(f"http://127.0.0.1:{port}", [Payload("/", b"")], concurrency, duration_s, CEILING_WARMUP_S,
                     processes)
    finally:
        server.kill()
        server.wait()


def default_processes(concurrency: int, cores: int | None = None) -> int:
    """Client processes for ``concurrency`` in flight: one per 32 requests in flight, at most a quarter of the
    cores."""
    cores = cores or os.cpu_count() or 1
    return max(1, min(-(-concurrency // 32), max(1, cores // 4)))


if __name__ == "__main__":
    if sys.argv[1:2] != ["--serve"]:
        sys.exit("usage: python -m unroll.benchmarks.gpu_serve_load --serve PORT SECONDS")
    sys.exit(_serve_nothing(int(sys.argv[2]), float(sys.argv[3])))
