"""The Grafana dashboard (``deploy/grafana/unroll-dashboard.json``) queries only what the services export.

The shape test reads the JSON alone: a dashboard Grafana imports (panels with PromQL targets, unique ids, a
Prometheus datasource variable that every panel and query uses). The scrape test starts a real tritonserver and the
real gateway on ``sdnet-mnist``, sends one good and one bad classify request (so a 200 and a 400 are counted) and a
head too large for the HTTP layer (so a refusal is counted), scrapes
the gateway's ``/metrics`` and Triton's metrics port, and checks every metric name in every query (and in the
template variables) against the sample names of the two scrapes, with their types: counters and histogram series
only inside ``rate``/``increase``, gauges never, buckets only under ``histogram_quantile`` by ``le``, and every label
a selector matches on or a query groups by carried by its metrics (``job``/``instance`` come from Prometheus).
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import httpx
import numpy as np
import pytest
from served import png

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "unroll-dashboard.json"
MODEL = "sdnet-mnist"

#: PromQL's aggregation operators and the functions a dashboard may call (an unknown name is a typo).
FUNCTIONS = {
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values", "group",
    "rate", "irate", "increase", "delta", "idelta", "deriv", "histogram_quantile", "clamp_min", "clamp_max", "clamp",
    "abs", "ceil", "floor", "round", "sqrt", "exp", "ln", "log2", "log10", "scalar", "vector", "time", "timestamp",
    "label_replace", "label_join", "absent", "absent_over_time", "avg_over_time", "max_over_time",
    "min_over_time", "sum_over_time", "count_over_time", "quantile_over_time", "last_over_time", "changes", "resets",
    "predict_linear", "sort", "sort_desc",
}
#: Words that stand alone in PromQL and are no metric.
KEYWORDS = {"and", "or", "unless", "bool", "offset", "Inf", "NaN", "inf", "nan"}
#: Grafana's own variables, which need no definition in the dashboard.
GRAFANA_VARS = {"__rate_interval", "__interval", "__range", "__interval_ms", "__range_s"}
COUNTING = ("rate", "irate", "increase")
#: Labels Prometheus adds to every series it scrapes (the services do not export them).
SCRAPE_LABELS = {"job", "instance"}


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dash: dict) -> list[dict]:
    """Every panel, those inside collapsed rows too."""
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def _targets(dash: dict) -> list[str]:
    """Every panel query's PromQL expression."""
    return [t["expr"] for p in _panels(dash) for t in p.get("targets", [])]


def _variable_lookups(dash: dict) -> list[tuple[str, str]]:
    """(metric, label) of each query variable's ``label_values(METRIC, label)``."""
    out = []
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*(\w+)\s*\)", q.strip())
            assert m, f"variable {var['name']}: expected label_values(METRIC, label), got {q!r}"
            out.append((m.group(1), m.group(2)))
    return out


def _skeleton(expr: str) -> str:
    """The expression without label values, range durations and label lists (by/on/...), matchers kept as ``{}``."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"\[[^\]]*\]", "", s)
    return re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", s)


def _selectors(expr: str) -> list[tuple[str, list[str], bool]]:
    """(metric name, label names its matchers use, whether it is the direct argument of rate/increase)."""
    out = []
    s = _skeleton(expr)
    for m in re.finditer(r"(?<![\w$.:])([a-zA-Z_:][\w:]*)\s*(\{[^}]*\})?", s):
        name, matchers = m.group(1), m.group(2) or ""
        if name in KEYWORDS or s[m.end():].lstrip().startswith("("):
            continue
        counted = re.search(rf"\b({'|'.join(COUNTING)})\(\s*$", s[:m.start()]) is not None
        out.append((name, re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", matchers), counted))
    return out


def _functions(expr: str) -> set[str]:
    return set(re.findall(r"(?<![\w$.:])([a-zA-Z_]\w*)\s*\(", _skeleton(expr)))


def test_dashboard_is_a_grafana_dashboard_on_a_prometheus_datasource() -> None:
    dash = _dashboard()
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = [v for v in variables.values() if v["type"] == "datasource"]
    assert [v["query"] for v in ds] == ["prometheus"], "one Prometheus datasource variable"
    ds_ref = {"type": "prometheus", "uid": f"${{{ds[0]['name']}}}"}

    panels = _panels(dash)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {ids}"
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) >= 10
    for p in graphs:
        where = f"panel {p['id']} {p['title']!r}"
        assert p["datasource"] == ds_ref, where
        assert p["targets"], f"{where} has no targets"
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), f"{where}: refIds repeat"
        for t in p["targets"]:
            assert t["datasource"] == ds_ref and t["expr"].strip(), where
        assert p.get("description"), f"{where} says nothing about what it shows"
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and 0 <= g["x"] and g["x"] + g["w"] <= 24, where
    cells = [(p["gridPos"]["y"] + dy, p["gridPos"]["x"] + dx) for p in panels
             for dy in range(p["gridPos"]["h"]) for dx in range(p["gridPos"]["w"])]
    assert len(cells) == len(set(cells)), "panels overlap"

    _variable_lookups(dash)
    for expr in _targets(dash):
        for pair in ("()", "[]", "{}"):
            depth = 0
            for ch in expr:
                depth += (ch == pair[0]) - (ch == pair[1])
                assert depth >= 0, expr
            assert depth == 0, expr
        assert _functions(expr) <= FUNCTIONS, f"unknown function in {expr}: {_functions(expr) - FUNCTIONS}"
        used = set(re.findall(r"\$\{?(\w+)", expr))
        assert used <= set(variables) | GRAFANA_VARS, f"undefined variable in {expr}"
        if "_bucket" in expr:
            assert re.search(r"histogram_quantile\(\s*0?\.\d+\s*,\s*sum by \(le\b", expr), expr


def _samples(text: str) -> list[tuple[str, dict[str, str]]]:
    """(name, labels) of each sample in a Prometheus text exposition, the name as Prometheus stores it
    (prometheus_client's parser would add ``_total`` to the names of Triton's counters, which Prometheus does not)."""
    out = []
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, labels = re.match(r"([a-zA-Z_:][\w:]*)(\{.*\})?", line).groups()
            out.append((name, dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels or ""))))
    return out


def _exported(text: str) -> dict[str, tuple[str, set[str]]]:
    """Sample name → (its family's ``# TYPE``, the label names its samples carry)."""
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    out: dict[str, tuple[str, set[str]]] = {}
    for name, labels in _samples(text):
        family = next((name.removesuffix(x) for x in ("", "_total", "_bucket", "_sum", "_count", "_created")
                       if name.removesuffix(x) in types), name)
        _, carried = out.setdefault(name, (types.get(family, "untyped"), set()))
        carried.update(labels)
    return out


def _problems(dash: dict, exported: dict[str, tuple[str, set[str]]]) -> list[str]:
    """What in the dashboard's queries does not fit what the services export (:func:`_exported`)."""
    problems = []
    for name, label in _variable_lookups(dash):
        if label not in exported.get(name, ("", set()))[1]:
            problems.append(f"variable label_values({name}, {label}): no such metric or label")
    seen: set[str] = set()
    for expr in _targets(dash):
        selectors = _selectors(expr)
        for name, labels, counted in selectors:
            seen.add(name)
            if name not in exported:
                problems.append(f"{name}: exported by neither the gateway nor Triton ({expr})")
                continue
            kind, carried = exported[name]
            if counted != (kind in ("counter", "histogram")):
                why = "rate() of a gauge" if counted else "a counter without rate()"
                problems.append(f"{name} is a {kind}: {why} ({expr})")
            if missing := set(labels) - carried:
                problems.append(f"{name} has no label {sorted(missing)} ({expr})")
        grouped = {g.strip() for by in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr) for g in by.split(",")}
        carried = set().union(*(exported.get(name, ("", set()))[1] for name, _, _ in selectors))
        if missing := grouped - carried - SCRAPE_LABELS:
            problems.append(f"grouped by {sorted(missing)}, which no metric of the query carries ({expr})")
    if len(seen) < 20:
        problems.append(f"the query parser found only {sorted(seen)}")
    return problems


@pytest.mark.triton
def test_every_metric_the_dashboard_queries_is_exported(demo_triton, tmp_path: Path) -> None:
    from unroll.serving.gateway.process import gateway_process
    from unroll.serving.gateway.settings import Settings

    triton = demo_triton  # the session's tritonserver (the demo models)
    digit = np.zeros((28, 28), np.uint8)
    digit[6:22, 13:16] = 255  # a "1"
    url = f"/v1/classify?model={MODEL}&top_k=3"
    with gateway_process(Settings(triton_url=triton.grpc_url), tmp_path / "gateway.log") as base, \
            httpx.Client(base_url=base, timeout=60) as client:
        good = client.post(url, content=png(digit), headers={"Content-Type": "image/png"})
        bad = client.post(url, content=b"not an image", headers={"Content-Type": "image/png"})
        assert (good.status_code, bad.status_code) == (200, 400), (good.text, bad.text)
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as raw:  # refused by the HTTP layer: 431, counted
            raw.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n")
            assert raw.recv(64).startswith(b"HTTP/1.1 431")
        gateway_text = client.get("/metrics").text
        triton_text = httpx.get(triton.metrics_url, timeout=10).text

    statuses = {(labels["route"], labels["status"]) for name, labels in _samples(gateway_text)
                if name == "unroll_gateway_requests_total"}
    assert {("/v1/classify", "200"), ("/v1/classify", "400")} <= statuses
    gateway, served = _exported(gateway_text), _exported(triton_text)
    assert {"nv_inference_queue_duration_us", "nv_inference_exec_count"} <= set(served)
    assert "process_cpu_seconds_total" in gateway, "a one-process gateway exports process_* (the CPU panel's input)"

    problems = _problems(_dashboard(), {**served, **gateway})
    assert not problems, "\n".join(problems)
