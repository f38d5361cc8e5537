"""Whether OpenTelemetry tracing is on, read from the standard ``OTEL_*`` variables only, and Triton's flags to match.

Tracing is off unless ``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, ``console``, or any installed
``opentelemetry_traces_exporter`` entry point; ``none``, unset or ``OTEL_SDK_DISABLED=true``: off). The OpenTelemetry
SDK reads the rest itself: ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (and their
``_HEADERS``, ``_TIMEOUT``), ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER`` (+``_ARG``),
``OTEL_PROPAGATORS``, ``OTEL_BSP_*``. ``otlp`` is OTLP over HTTP with protobuf (what Triton speaks too); the gRPC
protocol is refused with the reason.

This module imports nothing from OpenTelemetry: ``unroll serve`` and the gateway ask it first, and only a process with
tracing on imports the SDK (:mod:`unroll.serving.gateway.tracing`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

EXPORTER_ENV = "OTEL_TRACES_EXPORTER"
#: Where OTLP/HTTP sends traces when neither endpoint variable is set (the SDK's and Triton's default).
DEFAULT_TRACES_URL = "http://localhost:4318/v1/traces"
#: Triton's spans carry this ``service.name`` (the gateway's is ``OTEL_SERVICE_NAME``, else ``unroll-gateway``).
TRITON_SERVICE_NAME = "triton-inference-server"


def exporters(environ: Mapping[str, str] | None = None) -> list[str]:
    """The exporters ``OTEL_TRACES_EXPORTER`` names (lower case, ``none`` dropped); ``[]``: tracing is off."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [n.strip().lower() for n in env.get(EXPORTER_ENV, "").split(",")]
    return [n for n in names if n and n != "none"]


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the standard variables turn tracing on (:func:`exporters` names one)."""
    return bool(exporters(environ))


def otlp_protocol(environ: Mapping[str, str] | None = None) -> str:
    """``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, else ``OTEL_EXPORTER_OTLP_PROTOCOL``, else ``http/protobuf``; anything
    else is a ``ValueError`` (the gateway and Triton export OTLP over HTTP only)."""
    env = os.environ if environ is None else environ
    proto = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
             or "http/protobuf").strip().lower()
    if proto != "http/protobuf":
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={proto}: unroll exports traces as http/protobuf only "
                         "(Triton's OpenTelemetry exporter is OTLP/HTTP too); point it at the collector's HTTP port")
    return proto


def traces_url(environ: Mapping[str, str] | None = None) -> str:
    """Where OTLP/HTTP traces go, as the SDK resolves it: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` as it is, else
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` + ``/v1/traces``, else :data:`DEFAULT_TRACES_URL`."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip():
        return env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"].strip()
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    return base.rstrip("/") + "/v1/traces" if base else DEFAULT_TRACES_URL


def triton_trace_args(environ: Mapping[str, str] | None = None) -> list[str]:
    """tritonserver flags that export its spans where the gateway's go, when the variables turn ``otlp`` tracing on
    (``[]`` otherwise: Triton traces nothing, as before).

    ``rate=0``: Triton traces only the requests that carry a propagated context (Triton traces every such request,
    whatever the rate), i.e. the ones the gateway sampled; its spans then sit under the gateway's Triton-call span in
    the same trace. ``level=TIMESTAMPS`` gives its request, model and compute spans. Triton reads ``OTEL_BSP_*`` and
    ``OTEL_RESOURCE_ATTRIBUTES`` from its environment itself."""
    env = os.environ if environ is None else environ
    if "otlp" not in exporters(env) and "otlp_proto_http" not in exporters(env):
        return []
    otlp_protocol(env)
    url = traces_url(env)
    if "," in url:
        raise ValueError(f"OTLP traces endpoint {url!r}: Triton's --trace-config cannot take a ',' in it")
    return ["--trace-config=mode=opentelemetry", "--trace-config=rate=0", "--trace-config=count=-1",
            "--trace-config=level=TIMESTAMPS", f"--trace-config=opentelemetry,url={url}",
            f"--trace-config=opentelemetry,resource=service.name={TRITON_SERVICE_NAME}"]
