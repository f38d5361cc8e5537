"""OpenTelemetry tracing through a real gateway (uvicorn processes) in front of a real tritonserver, both exporting to
an OTLP/HTTP receiver in this test: one request's trace holds the gateway's spans (server span with the request id,
receive, queue, decode, the Triton call, encode) and Triton's (request, model, compute), Triton's under the gateway's
Triton-call span; a client's ``traceparent`` is continued. With the ``OTEL_*`` variables unset nothing is exported
(neither by the gateway nor by Triton for that request) and no tracer provider or SDK is loaded.

The receiver decodes both OTLP/HTTP encodings: protobuf (the Python SDK's) and JSON (Triton's OpenTelemetry C++
exporter sends JSON, with hex ids)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from served import png

from unroll.data import mnist_split
from unroll.pipeline import graphs_of
from unroll.serving.gateway.process import gateway_popen
from unroll.serving.gateway.settings import Settings
from unroll.serving.tracing_env import TRITON_SERVICE_NAME, enabled, traces_url, triton_trace_args
from unroll.serving.triton import free_ports, start

MODEL = "sdnet-mnist"
GATEWAY = "unroll-gateway"
SERVER, CLIENT = 2, 3  # OTLP span kinds

pytestmark = pytest.mark.triton
#: Triton 2.45 never exports a few of the traces it is sent (measured: 3 to 8 of 100 requests with a propagated
#: context, at rate=0 or 1 and any export interval, all of its spans missing): a request whose Triton part does not
#: land is tried again, this many times at most.
TRIES = 5


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent: str
    kind: int
    attributes: dict = field(default_factory=dict)
    links: list[str] = field(default_factory=list)


def _value(v: dict):
    for key in ("stringValue", "intValue", "boolValue", "doubleValue"):
        if key in v:
            return int(v[key]) if key == "intValue" else v[key]
    return None


def _from_json(body: bytes) -> list[Span]:
    out = []
    for rs in json.loads(body).get("resourceSpans", []):
        res = {a["key"]: _value(a["value"]) for a in rs.get("resource", {}).get("attributes", [])}
        for ss in rs.get("scopeSpans", []):
            for s in ss.get("spans", []):
                kind = s.get("kind", 0)
                out.append(Span(res.get("service.name", ""), s["name"], s["traceId"].lower(), s["spanId"].lower(),
                                s.get("parentSpanId", "").lower(), kind if isinstance(kind, int) else 0,
                                {a["key"]: _value(a["value"]) for a in s.get("attributes", [])},
                                [ln["spanId"].lower() for ln in s.get("links", [])]))
    return out


def _from_protobuf(body: bytes) -> list[Span]:
    from google.protobuf.json_format import MessageToDict
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    out = []
    for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
        service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
        for ss in rs.scope_spans:
            for s in ss.spans:
                attrs = {a.key: _value(MessageToDict(a.value)) for a in s.attributes}
                out.append(Span(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.kind,
                                attrs, [ln.span_id.hex() for ln in s.links]))
    return out


class Receiver:
    """An OTLP/HTTP trace receiver on a free loopback port: ``POST /v1/traces``, protobuf or JSON."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.errors: list[str] = []
        self.posts = 0
        lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as exporters expect (Triton's loses a batch on a closed one)

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                ok = self.path == "/v1/traces"
                if ok:
                    json_body = "json" in (self.headers.get("Content-Type") or "")
                    try:
                        spans = _from_json(body) if json_body else _from_protobuf(body)
                    except Exception as e:  # the test fails on it (Served.receiver.errors), with the body
                        receiver.errors.append(f"{type(e).__name__}: {e}: {body[:2000]!r}")
                        spans = []
                    with lock:
                        receiver.spans.extend(spans)
                        receiver.posts += 1
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", self.headers.get("Content-Type") or "application/x-protobuf")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}" if "json" in (self.headers.get("Content-Type") or "") else b"\n\x00")

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def trace(self, trace_id: str) -> list[Span]:
        return [s for s in list(self.spans) if s.trace_id == trace_id]

    def wait(self, cond, timeout_s: float = 20.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = cond()
            if got:
                return got
            time.sleep(0.1)
        return cond()


@dataclass
class Served:
    receiver: Receiver
    traced: httpx.Client
    untraced: httpx.Client
    traced_log: Path
    grpc: str


@pytest.fixture(scope="module")
def served(demo_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One tritonserver started with the trace flags the OTEL variables ask for, a gateway with them (JSON logs at
    info) and a gateway without them, all exporting to one receiver."""
    from unroll.serving.repository import write_repository

    root = tmp_path_factory.mktemp("tracing")
    write_repository("cpu", graphs_of([MODEL], demo_onnx_dir), root / "repo", onnx_dir=demo_onnx_dir)
    receiver = Receiver()
    otel = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
            "OTEL_BSP_SCHEDULE_DELAY": "100"}
    http, grpc, metrics = free_ports(3)
    settings = Settings(triton_url=f"127.0.0.1:{grpc}")
    # concurrent requests batch: one call in flight; no background catalog look (every 2 s by default) before the
    # first request, which must discover the catalog itself (its log line names that request's trace)
    one_at_a_time = Settings(triton_url=f"127.0.0.1:{grpc}", batch_max_in_flight=1, catalog_refresh_s=3600)
    mp = pytest.MonkeyPatch()
    try:
        for k in [k for k in os.environ if k.startswith("OTEL_")]:
            mp.delenv(k)
        for k, v in otel.items():
            mp.setenv(k, v)
        args = triton_trace_args()
        assert f"--trace-config=opentelemetry,url={traces_url()}" in args and traces_url().endswith("/v1/traces")
        with start(root / "repo", http, grpc, metrics, log_file=root / "triton.log", timeout_s=180,
                   extra_args=["--exit-timeout-secs=2", *args]), \
                gateway_popen(one_at_a_time, root / "traced.log", ready_path="/healthz",
                              args=("--log-level", "info", "--log-format", "json")) as (traced, _):
            mp.delenv("OTEL_TRACES_EXPORTER")  # the endpoint stays: only the exporter's name turns tracing on
            with gateway_popen(settings, root / "untraced.log", ready_path="/healthz") as (untraced, _), \
                    httpx.Client(base_url=traced, timeout=60) as t, httpx.Client(base_url=untraced, timeout=60) as u:
                yield Served(receiver, t, u, root / "traced.log", f"127.0.0.1:{grpc}")
    finally:
        mp.undo()
        receiver.close()
    assert not receiver.errors, receiver.errors


def _digit() -> bytes:
    _, _, x, _ = mnist_split()
    return png((x[0, 0] * 255).round().astype("uint8"))


def _classify(client: httpx.Client, headers: dict[str, str] | None = None) -> httpx.Response:
    r = client.post(f"/v1/classify?model={MODEL}", content=_digit(),
                    headers={"Content-Type": "image/png", **(headers or {})})
    assert r.status_code == 200, r.text
    return r


def _root(receiver: Receiver, rid: str) -> Span | None:
    return next((s for s in list(receiver.spans) if s.service == GATEWAY and s.kind == SERVER
                 and s.attributes.get("unroll.request_id") == rid), None)


def _complete(receiver: Receiver, rid: str) -> list[Span] | None:
    """The trace of the request ``rid`` once Triton's compute span and the gateway's server span are both in."""
    root = _root(receiver, rid)
    if root is None:
        return None
    spans = receiver.trace(root.trace_id)
    done = any(s.service == TRITON_SERVICE_NAME and s.name == "compute" for s in spans)
    return spans if done else None


def _explain(receiver: Receiver, rid: str) -> list:
    """What did land, for a failure's message: the request's trace (or every span, without its server span)."""
    root = _root(receiver, rid)
    spans = receiver.trace(root.trace_id) if root is not None else list(receiver.spans)
    return [root is not None, receiver.posts,
            [(s.service, s.name, s.trace_id[:8], s.attributes.get("triton.request_id")) for s in spans]]


def _traced(served: Served, headers: dict[str, str] | None = None) -> tuple[list[str], list[Span]]:
    """Classify through the traced gateway until a request's trace holds Triton's part too (:data:`TRIES` at most;
    every try's server span must land): the ids of the requests sent and the last one's trace."""
    rids: list[str] = []
    for i in range(TRIES):
        given = {k: v.format(i) for k, v in (headers or {}).items()}
        rids.append(rid := _classify(served.traced, given).headers["X-Request-Id"])
        assert served.receiver.wait(functools.partial(_root, served.receiver, rid), 10), _explain(served.receiver, rid)
        spans = served.receiver.wait(functools.partial(_complete, served.receiver, rid), 5)
        if spans:
            return rids, spans
    pytest.fail(f"Triton exported none of {TRIES} traces: {_explain(served.receiver, rids[-1])}")


def test_one_trace_holds_the_gateway_and_triton_spans(served: Served) -> None:
    rids, spans = _traced(served)
    rid = rids[-1]
    root = _root(served.receiver, rid)
    assert root.name == "POST /v1/classify" and root.parent == ""
    assert root.attributes["http.response.status_code"] == 200 and root.attributes["http.route"] == "/v1/classify"
    by_id = {s.span_id: s for s in spans}

    def under_root(s: Span) -> bool:
        while s.parent and s.parent in by_id:
            s = by_id[s.parent]
        return s is root

    gateway = [s for s in spans if s.service == GATEWAY]
    names = {s.name for s in gateway}
    assert {"receive", "queue", "decode", f"triton.infer {MODEL}", "encode"} <= names, names
    assert all(under_root(s) for s in spans), [(s.service, s.name, s.parent) for s in spans]
    # the stages are the server span's children (the batcher's wait and the Triton call below it)
    for stage in ("receive", "queue", "decode", "encode"):
        assert next(s for s in gateway if s.name == stage).parent == root.span_id, stage
    call = next(s for s in gateway if s.name == f"triton.infer {MODEL}")
    assert call.kind == CLIENT and call.attributes["unroll.model"] == MODEL

    triton = [s for s in spans if s.service == TRITON_SERVICE_NAME]
    request = next(s for s in triton if s.name == "InferRequest")
    assert request.parent == call.span_id  # Triton's request span under the gateway's Triton call
    model = next(s for s in triton if s.name == MODEL)
    assert model.parent == request.span_id and model.attributes["triton.request_id"] == rid
    assert next(s for s in triton if s.name == "compute").parent == model.span_id

    # the catalog is discovered inside this (the gateway's first) request: its log line names the trace
    records = [json.loads(ln) for ln in served.traced_log.read_text().splitlines() if ln.startswith("{")]
    discovered = [rec for rec in records if "Triton serves" in rec.get("message", "")]
    first = _root(served.receiver, rids[0])
    assert discovered and discovered[0]["request_id"] == rids[0] and discovered[0]["trace_id"] == first.trace_id


def test_a_client_trace_is_continued(served: Served) -> None:
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e473{}", "00f067aa0ba902b7"
    rids, spans = _traced(served, {"traceparent": f"00-{trace_id}-{parent}-01", "X-Request-Id": "traced-client-{}"})
    rid = rids[-1]
    assert rid == f"traced-client-{len(rids) - 1}"  # the client's id kept
    assert {s.trace_id for s in spans} == {trace_id.format(len(rids) - 1)}
    assert _root(served.receiver, rid).parent == parent
    assert any(s.service == TRITON_SERVICE_NAME and s.attributes.get("triton.request_id") == rid for s in spans)


def _batches(receiver: Receiver, rids: list[str], explain: bool = False) -> Any:
    """Once every request's spans are in and each ``batch.wait`` is answered by a ``batch`` span whose trace has
    Triton's compute (as parent, or through a link): the wait spans by id and the batches of several requests."""
    roots = [_root(receiver, rid) for rid in rids]
    if None in roots:
        return [rid for rid, r in zip(rids, roots, strict=True) if r is None] if explain else None
    spans = list(receiver.spans)
    traces = {r.trace_id for r in roots}
    waits = {s.span_id: s for s in spans if s.name == "batch.wait" and s.trace_id in traces}
    batches = [s for s in spans if s.name == "batch" and (s.parent in waits or set(s.links) & set(waits))]
    covered = {s.parent for s in batches} | {link for s in batches for link in s.links}
    if len(waits) < len(rids) or not set(waits) <= covered:
        return ([(w.name, w.attributes) for w in waits.values()], [(b.name, b.attributes, b.links) for b in batches],
                len(covered)) if explain else None
    return waits, [b for b in batches if b.attributes["unroll.batch.requests"] > 1]


def _with_triton(receiver: Receiver, batches: list[Span]) -> list[Span]:
    computed = {s.trace_id for s in list(receiver.spans) if s.service == TRITON_SERVICE_NAME and s.name == "compute"}
    return [b for b in batches if b.trace_id in computed]


def _triton_under(receiver: Receiver, trace_id: str, parent: str) -> bool:
    return any(s.service == TRITON_SERVICE_NAME and s.parent == parent for s in receiver.trace(trace_id))


def test_a_batch_is_parented_by_its_first_request_and_linked_to_the_others(served: Served) -> None:
    """Concurrent requests that the batcher sends as one Triton call: the ``batch`` span (and Triton's spans under
    it) sits in one request's trace, below its ``batch.wait``, with a link to every other request's ``batch.wait``."""
    receiver = served.receiver
    for attempt in range(TRIES):
        rids = [f"batched-{attempt}-{i}" for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda rid: _classify(served.traced, {"X-Request-Id": rid}), rids))
        landed = receiver.wait(functools.partial(_batches, receiver, rids))
        assert landed, _batches(receiver, rids, explain=True)
        waits, joined = landed
        joined = receiver.wait(functools.partial(_with_triton, receiver, joined), 5) if joined else []
        if joined:
            break
    else:
        pytest.fail(f"8 concurrent requests never shared a batch whose Triton part landed in {TRIES} tries")
    for batch in joined:
        assert len(batch.links) == batch.attributes["unroll.batch.requests"] - 1
        assert batch.trace_id == waits[batch.parent].trace_id
        linked = [waits[link] for link in batch.links]  # each a waiting request's span, each in its own trace
        assert len({w.trace_id for w in linked} | {batch.trace_id}) == len(linked) + 1
        spans = receiver.trace(batch.trace_id)
        call = next(s for s in spans if s.parent == batch.span_id and s.name == f"triton.infer {MODEL}")
        assert call.attributes["unroll.batch.items"] == batch.attributes["unroll.batch.items"]
        # Triton exports each span as it ends: its request span, the call's child, ends after "compute" has landed
        assert receiver.wait(functools.partial(_triton_under, receiver, batch.trace_id, call.span_id), 10)


def test_tracing_off_exports_nothing(served: Served) -> None:
    receiver = served.receiver
    seen = -1
    while seen != len(receiver.spans):  # what the traced tests sent has landed (exports every 0.1 s)
        seen = len(receiver.spans)
        time.sleep(1.0)
    r = _classify(served.untraced, {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
    rid = r.headers["X-Request-Id"]
    time.sleep(1.5)  # 15 export intervals of the gateway's and Triton's batch span processors
    assert len(receiver.spans) == seen, [(s.service, s.name) for s in receiver.spans[seen:]]
    assert not any(s.attributes.get("triton.request_id") == rid for s in receiver.spans)


_OFF_PROBE = """
import json, sys
from fastapi.testclient import TestClient
from unroll.serving.gateway import create_app, tracing
from unroll.serving.gateway.settings import Settings
app = create_app(Settings(triton_url=sys.argv[1]))
with TestClient(app) as client:
    codes = [client.get("/healthz").status_code,
             client.post("/v1/classify?model=sdnet-mnist", content=open(sys.argv[2], "rb").read(),
                         headers={"Content-Type": "image/png"}).status_code]
trace_api = sys.modules.get("opentelemetry.trace")
print(json.dumps({"codes": codes, "enabled": tracing.enabled(),
                  "provider": type(trace_api.get_tracer_provider()).__name__ if trace_api else None,
                  "sdk": sorted(m for m in sys.modules if m.startswith("opentelemetry.sdk")),
                  "middleware": [m.cls.__name__ for m in app.user_middleware]}))
"""


def test_tracing_off_loads_no_sdk_and_installs_no_provider(served: Served, tmp_path: Path) -> None:
    """Unset OTEL variables: an app that served a classification (its every stage) imported no OpenTelemetry SDK,
    set no tracer provider and has no tracing middleware."""
    assert not enabled({}) and not enabled({"OTEL_TRACES_EXPORTER": "none"}) and triton_trace_args({}) == []
    assert not enabled({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"})
    image = tmp_path / "digit.png"
    image.write_bytes(_digit())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "UNROLL_"))}
    out = subprocess.run([sys.executable, "-c", _OFF_PROBE, served.grpc, str(image)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["codes"] == [200, 200] and not got["enabled"] and got["sdk"] == [], got
    assert "TracingMiddleware" not in got["middleware"] and got["provider"] in (None, "ProxyTracerProvider"), got
