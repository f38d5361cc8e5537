"""Serve Triton's loopback-only Prometheus metrics on the pod's address: GET /metrics, nothing else.

Inside an unroll pod, `unroll serve` binds every Triton port (HTTP, gRPC, metrics) to 127.0.0.1 so that only the
gateway reaches Triton. Prometheus scrapes the pod IP, so this sidecar (same pod, same loopback) answers
``GET /metrics`` with the body of ``--upstream`` (Triton's metrics endpoint) and every other request with 404:
Triton's inference and model-control APIs stay unreachable from outside the pod. 503 while Triton is down.
Standard library only, so it runs from the serving image without installing anything.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PATH = "/metrics"


def make_handler(upstream: str, timeout_s: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "unroll-metrics-bridge"

        def _send(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.split("?", 1)[0] != PATH:
                self._send(404, b"only GET /metrics is served here\n")
                return
            try:
                with urllib.request.urlopen(upstream, timeout=timeout_s) as r:
                    body = r.read()
                    content_type = r.headers.get("Content-Type", "text/plain; version=0.0.4")
            except (urllib.error.URLError, OSError) as e:
                self._send(503, f"Triton metrics unavailable: {e}\n".encode())
                return
            self._send(200, body, content_type)

        do_HEAD = do_GET

        def log_message(self, format: str, *args: object) -> None:  # scrapes every 15 s: keep the log quiet
            pass

    return Handler


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (the pod's)")
    p.add_argument("--port", type=int, default=9102)
    p.add_argument("--upstream", default="http://127.0.0.1:8002/metrics", help="Triton's metrics URL")
    p.add_argument("--timeout-s", type=float, default=5.0, help="how long to wait for Triton per scrape")
    a = p.parse_args(argv)
    server = ThreadingHTTPServer((a.host, a.port), make_handler(a.upstream, a.timeout_s))
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    print(f"metrics bridge: GET http://{a.host}:{a.port}{PATH} -> {a.upstream}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
