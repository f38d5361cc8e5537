"""The results of ``unroll bench serve`` as targets (ratios within one run) and as Markdown tables."""

from __future__ import annotations

from unroll.benchmarks.common import load_note
from unroll.benchmarks.serve_load import PATH_LABELS, PERF_ANALYZER_CONCURRENCY
from unroll.benchmarks.serve_triton import FLOOR_MODEL

TARGET_OVERHEAD_MS = 2.0
TARGET_BATCHING_SPEEDUP = 1.5
#: Triton direct (perf_analyzer, one digit, concurrency 1) p50 ≤ in-process ONNX Runtime p50 + this.
TARGET_DIRECT_OVERHEAD_MS = 0.5
#: Triton direct at the batching concurrency ≥ this share of ONNX Runtime's in-process batched ceiling.
TARGET_CEILING_SHARE = 0.7
#: Issue 24's request-path targets (the sweep's levels: the gateway and Triton direct driven by the same engine).
TARGET_GATEWAY_CPU_MS = 0.8
TARGET_GATEWAY_OVER_DIRECT_MS = 1.0
TARGET_GATEWAY_THROUGHPUT_SHARE = 0.6
TARGET_DENOISE_SHARE_MS = 5.0


def targets(payload: dict) -> list[dict]:
    """The issue's targets, measured vs target (``met`` is None when this run could not measure one)."""
    runs = payload["runs"]
    first = next(iter(payload["config"]["workloads"]))  # the classifier's single-sample requests
    what = payload["config"]["workloads"][first]

    def cell(path: str, c: int = 1) -> dict | None:
        return next((r for r in runs if r["workload"] == first and r["path"] == path and r["concurrency"] == c),
                    None)

    out = []
    gw, ort_ = cell("gateway"), cell("onnxruntime")
    over = gw["latency_ms"]["p50"] - ort_["latency_ms"]["p50"] if gw and ort_ else None
    out.append({"target": f"gateway + Triton adds ≤ {TARGET_OVERHEAD_MS:g} ms p50 over in-process ONNX Runtime "
                          f"(one {what['input']} for {what['model']}, concurrency 1)",
                "measured": None if over is None else f"{over:+.2f} ms (gateway p50 {gw['latency_ms']['p50']:.2f} ms, "
                                                      f"ONNX Runtime p50 {ort_['latency_ms']['p50']:.2f} ms)",
                "value": over, "met": None if over is None else over <= TARGET_OVERHEAD_MS})
    b = payload.get("batching")
    sp = b.get("speedup") if b else None
    out.append({"target": f"dynamic batching ≥ {TARGET_BATCHING_SPEEDUP:g}× the throughput of no batching "
                          f"(concurrency {b['concurrency'] if b else '-'})",
                "measured": None if sp is None else f"{sp:.2f}× ({b['on']['throughput_rps']:.0f} vs "
                                                    f"{b['off']['throughput_rps']:.0f} req/s)",
                "value": sp, "met": None if sp is None else sp >= TARGET_BATCHING_SPEEDUP})
    out += _direct_targets(payload)
    out += request_path_targets(payload)
    all_runs = runs + _batching_runs(b) + (payload.get("other_spinning") or {}).get("runs", [])
    n_err = sum(r["errors"] for r in all_runs)
    bad = sorted({f"{r['workload']} {r['path']} c={r['concurrency']}" for r in all_runs if r["errors"]})
    out.append({"target": "zero errors at every level", "value": n_err, "met": n_err == 0,
                "measured": f"{n_err} errors" + (f" ({', '.join(bad[:6])})" if bad else "")})
    return out


def _floor_note(pa_: dict) -> str:
    """"; floor …": the do-nothing Python-backend model's p50 at concurrency 1, when it was measured."""
    f = pa_.get("floor")
    if not f:
        return ""
    return (f"; a do-nothing Python-backend model on the same tritonserver build: p50 {f['latency_ms']['p50']:.2f} "
            f"ms, so the floor for this target is ONNX Runtime + {f['latency_ms']['p50']:.2f} ms")


def _direct_targets(payload: dict) -> list[dict]:
    """Triton direct (perf_analyzer) vs in-process ONNX Runtime: latency at concurrency 1, and throughput at the
    batching level (its own level, else the batching comparison's "on" side when perf_analyzer measured it) vs
    the batched ceiling. Empty for results from before perf_analyzer was part of the benchmark."""
    pa_ = payload.get("perf_analyzer")
    if pa_ is None:  # results from before perf_analyzer was part of the benchmark
        return []
    first = next(iter(payload["config"]["workloads"]))
    what = payload["config"]["workloads"][first]
    ceiling = payload.get("ort_ceiling") or {}
    best = ceiling.get("best")
    ort1 = next((r for r in payload["runs"] if r["workload"] == first and r["path"] == "onnxruntime"
                 and r["concurrency"] == 1), None)
    ort_p50 = ort1["latency_ms"]["p50"] if ort1 else next(
        (r["p50_ms"] for r in ceiling.get("rows", []) if r["batch"] == 1), None)
    pa_runs = {r["concurrency"]: r for r in pa_["runs"]
               if r["workload"] == first and r.get("request", "tensors") == "tensors"}
    why = pa_.get("missing") or "not measured"
    out = []
    d1 = pa_runs.get(1)
    over = d1["latency_ms"]["p50"] - ort_p50 if d1 and ort_p50 is not None else None
    out.append({"target": f"Triton direct (perf_analyzer) ≤ in-process ONNX Runtime + {TARGET_DIRECT_OVERHEAD_MS:g} ms "
                          f"p50 (one {what['input']} for {what['model']}, concurrency 1)",
                "measured": why if over is None else f"{over:+.2f} ms (Triton direct p50 {d1['latency_ms']['p50']:.2f} "
                                                     f"ms, ONNX Runtime p50 {ort_p50:.2f} ms{_floor_note(pa_)})",
                "value": over, "met": None if over is None else over <= TARGET_DIRECT_OVERHEAD_MS})
    b = payload.get("batching") or {}
    c = b.get("concurrency", max(PERF_ANALYZER_CONCURRENCY))
    dc = pa_runs.get(c) or (b.get("on") if b.get("path") == "perf-analyzer" else None)
    share = dc["throughput_rps"] / best["items_per_s"] if dc and best else None
    out.append({"target": f"Triton direct at concurrency {c} ≥ {TARGET_CEILING_SHARE:.0%} of ONNX Runtime's in-process "
                          f"batched ceiling ({ceiling.get('threads', '-')} threads, best batch size)",
                "measured": (why if dc is None else "no ceiling measured") if share is None else
                f"{share:.0%} ({dc['throughput_rps']:.0f} vs {best['items_per_s']:.0f}/s at batch {best['batch']})",
                "value": share, "met": None if share is None else share >= TARGET_CEILING_SHARE})
    return out


def targets_table(rows: list[dict]) -> list[str]:
    """The targets as a Markdown table: target, measured, met (serve.md and the README's and docs' block)."""
    lines = ["| target | measured | met |", "|---|---|---|"]
    for t in rows:
        met = "n/a" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['target']} | {t['measured'] or 'not measured'} | {met} |")
    return lines


def _batching_runs(b: dict | None) -> list[dict]:
    """Every measured level of the batching comparison (each round's on and off)."""
    return [r[tag] for r in b["rounds"] for tag in ("on", "off")] if b else []


def _f(x: float | None, d: int = 2) -> str:
    return "-" if x is None or x != x else f"{x:.{d}f}"


def _batching(cfg: dict) -> str:
    db = cfg.get("dynamic_batching")
    if db is None:
        return f"max_batch_size {cfg.get('max_batch_size', '-')}, no dynamic batching"
    return (f"max_batch_size {cfg.get('max_batch_size', '-')}, dynamic batching (max queue delay "
            f"{int(db.get('max_queue_delay_microseconds', 0))} µs)")


def _cpu_markdown(payload: dict) -> list[str]:
    """CPU milliseconds per request by process, at concurrency 1 and the highest level of each path."""
    rows = [r for r in payload["runs"] if r.get("cpu_ms_per_request") and r["requests"]]
    if not rows:
        return []
    lines = ["", "## CPU per request (ms of CPU time per answered request, by process)", "",
             "Measured from `/proc` over each level (user + system time of every process this run started: the "
             "gateway's workers summed, tritonserver, the Python-backend stubs). `client` is the load engine's own "
             "process (its count where the results hold it: CPU over the whole level, warm-up included, per request "
             "sent), which for in-process ONNX Runtime includes the inference. The figure carries between machines; "
             "latency on a small shared machine does not.", "",
             "| workload | path | conc. | req/s | gateway | tritonserver | stubs | server side | client |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (_, path), group in _by_workload_path(rows).items():
        levels = sorted({r["concurrency"] for r in group})
        for r in (x for x in group if x["concurrency"] in {levels[0], levels[-1]}):
            c = r["cpu_ms_per_request"]
            server = c["gateway"] + c["tritonserver"] + c["backends"]
            client = r.get("client_cpu_ms_per_request", c["client"])
            lines.append(f"| {r['model']}: {r['input']} | {PATH_LABELS[path]} | {r['concurrency']} | "
                         f"{_f(r['throughput_rps'], 1)} | {_f(c['gateway'], 3)} | {_f(c['tritonserver'], 3)} | "
                         f"{_f(c['backends'], 3)} | {_f(server, 3)} | {_f(client, 3)} |")
    return lines


def _by_workload_path(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        out.setdefault((r["workload"], r["path"]), []).append(r)
    return out


def direct_path(gateway_protocol: str) -> str:
    """The Triton-direct path the gateway's share is measured against: its own protocol to Triton."""
    return "triton-http" if gateway_protocol == "http" else "triton-grpc"


def _direct_markdown(payload: dict) -> list[str]:
    """Triton direct from perf_analyzer (or why not), ONNX Runtime's batched ceiling, the queue-delay comparison."""
    pa_ = payload.get("perf_analyzer")
    if pa_ is None:
        return []
    lines = ["", "## Triton direct, measured by perf_analyzer (gRPC, real inputs)", ""]
    if not pa_.get("available"):
        lines.append(f"Not measured: {pa_.get('missing')}.")
    else:
        lines += ["Triton's own client (`perf_analyzer` from tritonclient 2.47.0, synchronous requests, "
                  "`--input-data` from the same real samples). Latency in ms from the client; the server split "
                  "is perf_analyzer's (Triton's statistics over its measurement windows); batch = average batch "
                  "Triton formed over the run. † = no stable measurement (perf_analyzer's stability demand dropped). "
                  f"`{FLOOR_MODEL}`: a do-nothing Python-backend model (output = input, zero-copy) with the "
                  "classifier's input, on the no-batching server: Triton + gRPC + the Python backend's own cost.",
                  "Request: the float tensors, or the PNG file itself (`image_bytes`, decoded, fitted, tiled and, for "
                  "a denoiser, encoded back to PNG inside Triton).",
                  "", "| model | input | request | conc. | req/s | p50 | p90 | p95 | p99 | queue | in | infer | out | "
                  "batch |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in pa_["runs"] + ([pa_["floor"]] if pa_.get("floor") else []):
            L, sv = r["latency_ms"], r["server"]
            lines.append(f"| {r['model']} | {r['input']} | {r.get('request', 'tensors')} | "
                         f"{r['concurrency']}{'' if r.get('stable', True) else '†'} "
                         f"| {_f(r['throughput_rps'], 1)} | {_f(L['p50'])} | {_f(L['p90'])} | {_f(L['p95'])} | "
                         f"{_f(L['p99'])} | {_f(sv.get('queue_ms'))} | {_f(sv.get('compute_input_ms'))} | "
                         f"{_f(sv.get('compute_infer_ms'))} | {_f(sv.get('compute_output_ms'))} | "
                         f"{_f(sv.get('avg_batch'))} |")
    ceiling = payload.get("ort_ceiling")
    if ceiling:
        lines += ["", f"## ONNX Runtime's in-process batched ceiling ({ceiling['model']}, {ceiling['input']}, "
                      f"{ceiling.get('threads', '-')} threads)", "",
                  "| batch | items/s | p50 per run (ms) |", "|---|---|---|"]
        for r in ceiling["rows"]:
            mark = " (best)" if r["batch"] == ceiling["best"]["batch"] else ""
            lines.append(f"| {r['batch']}{mark} | {_f(r['items_per_s'], 0)} | {_f(r['p50_ms'])} |")
    qd = payload.get("queue_delay")
    if qd:
        lines += ["", f"## Dynamic batching queue delay ({qd['model']}, {qd['client']}; the default is "
                      f"{qd['default_us']} µs, serving/repository.py)", "",
                  "| max queue delay (µs) | conc. | req/s | p50 | p99 | queue | infer | batch |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in qd["rows"]:
            L, sv = r["latency_ms"], r["server"] or {}
            lines.append(f"| {r['delay_us']}{' (default)' if r['delay_us'] == qd['default_us'] else ''} | "
                         f"{r['concurrency']} | {_f(r['throughput_rps'], 1)} | {_f(L['p50'])} | {_f(L['p99'])} | "
                         f"{_f(sv.get('queue_ms'))} | {_f(sv.get('compute_infer_ms'))} | {_f(sv.get('avg_batch'))} |")
    return lines


def markdown(payload: dict) -> str:
    m, cfg, srv = payload["machine"], payload["config"], payload.get("servers", {})
    own = direct_path(srv.get("gateway_triton_protocol", "grpc"))
    b = payload.get("batching")
    classifier = (b or {}).get("model") or next(iter(cfg["workloads"].values()))["model"]
    gw_cfg = srv.get("config", {}).get(classifier, {})
    lines = [f"# Serving under load ({m['cpu']}, {m['logical_cores']} cores, onnxruntime "
             f"{m['versions'].get('onnxruntime')}, tritonclient {m['versions'].get('tritonclient')})", "",
             f"Client: {cfg['client']}. {cfg['duration_s']:g} s per level after {cfg['warmup_s']:g} s warm-up; "
             "client, gateway and Triton on the same machine. Latency from the "
             "client in ms. Triton split: mean ms per request from its statistics API over the level "
             "(queue, compute input, infer, output); batch = average batch size Triton formed. Gateway share = "
             f"gateway latency − {PATH_LABELS[own]} latency at the same concurrency (p50). "
             f"Triton {classifier}: {_batching(gw_cfg)}; in-process ONNX Runtime uses the same session options "
             f"as Triton's model ({cfg['threads']} threads, "
             f"{'spinning' if cfg.get('spinning') else 'no spinning'}). {load_note(m)}", ""]
    lines += ["## Targets", "", *targets_table(payload["targets"])]
    for key, w in cfg["workloads"].items():
        rows = [r for r in payload["runs"] if r["workload"] == key]
        if not rows:
            continue
        lines += ["", f"## {w['model']}: {w['input']}", "",
                  "| path | conc. | req/s | p50 | p90 | p95 | p99 | max | errors | queue | in | infer | out | batch "
                  "| gateway share |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            L, s = r["latency_ms"], r["server"] or {}
            gs = r.get("gateway_share_ms", {})
            share = _f(gs.get("p50")) + ("†" if gs.get("vs") not in (None, own) else "")
            lines.append(f"| {PATH_LABELS[r['path']]} | {r['concurrency']} | {_f(r['throughput_rps'], 1)} | "
                         f"{_f(L['p50'])} | {_f(L['p90'])} | {_f(L['p95'])} | {_f(L['p99'])} | {_f(L['max'])} | "
                         f"{r['errors']} | {_f(s.get('queue_ms'))} | {_f(s.get('compute_input_ms'))} | "
                         f"{_f(s.get('compute_infer_ms'))} | {_f(s.get('compute_output_ms'))} | "
                         f"{_f(s.get('avg_batch'))} | {share} |")
        other = {r["gateway_share_ms"]["vs"] for r in rows
                 if r.get("gateway_share_ms", {}).get("vs") not in (None, own)}
        for vs in sorted(other):
            lines += ["", f"† vs {PATH_LABELS[vs]} ({PATH_LABELS[own]} not measured for this input)."]
    lines += spinning_markdown(payload)
    lines += _cpu_markdown(payload)
    lines += _direct_markdown(payload)
    if b:
        client = "perf_analyzer" if b.get("path") == "perf-analyzer" else "Triton gRPC, the load engine"
        lines += ["", f"## Dynamic batching on vs off ({classifier}, {client}, concurrency {b['concurrency']})", "",
                  "| Triton config | req/s | p50 | p99 | avg batch | errors |", "|---|---|---|---|---|---|"]
        for tag, r, c in (("on", b["on"], b["config_on"]), ("off", b["off"], b["config_off"])):
            lines.append(f"| {tag}: {_batching(c)} | {_f(r['throughput_rps'], 1)} | {_f(r['latency_ms']['p50'])} | "
                         f"{_f(r['latency_ms']['p99'])} | {_f((r['server'] or {}).get('avg_batch'))} | "
                         f"{r['errors']} |")
        rounds = b["rounds"]
        best = (payload.get("ort_ceiling") or {}).get("best")
        if best and b["off"]["throughput_rps"]:
            ceil = best["items_per_s"]
            lines += ["", f"Against ONNX Runtime's in-process batched ceiling ({_f(ceil, 0)}/s at batch "
                          f"{best['batch']}, same threads): on {b['on']['throughput_rps'] / ceil:.0%}, off "
                          f"{b['off']['throughput_rps'] / ceil:.0%}; the ceiling is "
                          f"{ceil / b['off']['throughput_rps']:.2f}× no batching, the most batching could give."]
        lines += ["", f"Speed-up: {_f(b['speedup'])}× (the median of {len(rounds)} interleaved round(s) of on, off; "
                      "the rows above are that round; every round: "
                      + ", ".join(f"{_f(r['on']['throughput_rps'], 0)} vs {_f(r['off']['throughput_rps'], 0)} req/s "
                                  f"→ {_f(r['speedup'])}×" for r in rounds) + ")."]
    errs = [(r, e) for r in payload["runs"] + _batching_runs(b) for e in r["error_samples"]]
    if errs:
        lines += ["", "## Error samples", ""]
        lines += [f"- {r['workload']} {r['path']} c={r['concurrency']}: `{e}`" for r, e in errs[:20]]
    lines += ["", "Plots: `serve_latency.png` (p50/p99 vs concurrency), `serve_throughput.png`, `serve_split.png` "
              "(per-layer mean ms).", ""]
    return "\n".join(lines)


def request_path_targets(payload: dict) -> list[dict]:
    """Issue 24's targets: what the gateway costs over Triton direct for the classifier, both driven by the same
    client over HTTP (the sweep's gateway and Triton HTTP levels), and the denoiser's gateway share."""
    first = next(iter(payload["config"]["workloads"]))
    rows = [r for r in payload["runs"] if r["workload"] == first and r["requests"]]

    def row(path: str, c: int | None) -> dict | None:
        return next((r for r in rows if r["path"] == path and r["concurrency"] == c), None)

    top = max((r["concurrency"] for r in rows if r["path"] == "gateway"), default=None)
    gw_top, gw1 = row("gateway", top), row("gateway", 1)
    out = []
    cpu = gw_top["cpu_ms_per_request"]["gateway"] if gw_top and gw_top.get("cpu_ms_per_request") else None
    out.append({"target": f"gateway CPU per classify request at concurrency {top or '-'} ≤ "
                          f"{TARGET_GATEWAY_CPU_MS:g} ms",
                "measured": "not measured" if cpu is None else f"{cpu:.3f} ms ({gw_top['throughput_rps']:.0f} req/s)",
                "value": cpu, "met": None if cpu is None else cpu <= TARGET_GATEWAY_CPU_MS})
    d1 = row("triton-http", 1)
    over = gw1["latency_ms"]["p50"] - d1["latency_ms"]["p50"] if gw1 and d1 else None
    out.append({"target": f"gateway p50 at concurrency 1 ≤ Triton direct + {TARGET_GATEWAY_OVER_DIRECT_MS:g} ms (both "
                          "driven by the load engine over HTTP)",
                "measured": "not measured" if over is None else
                f"{over:+.2f} ms (gateway {gw1['latency_ms']['p50']:.2f} ms, Triton direct "
                f"{d1['latency_ms']['p50']:.2f} ms)",
                "value": over, "met": None if over is None else over <= TARGET_GATEWAY_OVER_DIRECT_MS})
    direct = [r for r in rows if r["path"].startswith("triton")]
    direct += [r for r in (payload.get("perf_analyzer") or {}).get("runs", []) if r["workload"] == first]
    best = max(direct, key=lambda r: r["throughput_rps"], default=None)
    share = gw_top["throughput_rps"] / best["throughput_rps"] if gw_top and best else None
    label = None if best is None else ("perf_analyzer" if best["path"] == "perf-analyzer" else
                                       f"the load engine, {PATH_LABELS[best['path']]}") + f", c={best['concurrency']}"
    out.append({"target": f"gateway throughput at concurrency {top or '-'} ≥ {TARGET_GATEWAY_THROUGHPUT_SHARE:.0%} of "
                          "Triton direct's best",
                "measured": "not measured" if share is None else f"{share:.0%} ({gw_top['throughput_rps']:.0f} vs "
                                                                 f"{best['throughput_rps']:.0f} req/s, {label})",
                "value": share, "met": None if share is None else share >= TARGET_GATEWAY_THROUGHPUT_SHARE})
    out.append(_denoise_share_target(payload))
    return out


def _denoise_share_target(payload: dict) -> dict:
    """The largest denoiser size's gateway share at concurrency 1: against Triton direct with the PNG bytes, which does
    the same work (decode, tiling, encode) as the gateway's path; the share against float tensors beside it."""
    sizes = [k for k in payload["config"]["workloads"] if k.startswith("denoise")]
    big = max(sizes, default=None, key=lambda k: int(k.rsplit("-", 1)[-1]))
    g = next((r for r in payload["runs"] if r["workload"] == big and r["path"] == "gateway" and r["concurrency"] == 1),
             None)
    image, tensor = (g or {}).get("gateway_share_image_ms"), (g or {}).get("gateway_share_ms")
    share_ms = image["p50"] if image else None
    vs_tensors = (f"; vs {PATH_LABELS[tensor['vs']]} with float tensors in and out, which decodes, tiles and encodes "
                  f"nothing: {tensor['p50']:+.2f} ms") if tensor else ""
    return {"target": f"{big or 'denoise'}: gateway share (gateway p50 − Triton direct p50, concurrency 1, the same "
                      f"client) ≤ {TARGET_DENOISE_SHARE_MS:g} ms",
            "measured": "not measured" if share_ms is None else
            f"{share_ms:.2f} ms (gateway {g['latency_ms']['p50']:.2f} ms, {PATH_LABELS[image['vs']]} "
            f"{g['latency_ms']['p50'] - share_ms:.2f} ms{vs_tensors})",
            "value": share_ms, "met": None if share_ms is None else share_ms <= TARGET_DENOISE_SHARE_MS}


def spinning_markdown(payload: dict) -> list[str]:
    """The classifier's gateway and Triton HTTP levels on the default Triton and on one whose ONNX Runtime threads
    spin the other way (a second Triton and gateway), with CPU per request by process."""
    other = payload.get("other_spinning")
    if not other:
        return []
    spin = payload.get("config", {}).get("spinning")
    default = {(r["workload"], r["path"], r["concurrency"]): r for r in payload["runs"]}
    lines = ["", "## Spinning on vs off (the classifier through the gateway and Triton HTTP)", "",
             "Spinning: ONNX Runtime's intra-op threads spin for the next piece of work before they sleep "
             "(`intra_op_spinning` in each model's config, `unroll repo --no-spinning`); the rows marked otherwise ran "
             "on a second Triton and gateway with the other setting, the same engine and levels. CPU: ms per request "
             "by process from `/proc`.", "",
             "| spinning | path | conc. | req/s | p50 | p90 | p99 | errors | gateway CPU | tritonserver CPU | "
             "stubs CPU | client CPU |", "|---" * 12 + "|"]
    for r in other["runs"]:
        pair = ((spin, default.get((r["workload"], r["path"], r["concurrency"]))), (other["spinning"], r))
        for spinning, x in pair:
            if x is None:
                continue
            L, c = x["latency_ms"], x.get("cpu_ms_per_request") or {}
            lines.append(f"| {'on' if spinning else 'off'}{' (default)' if spinning == spin else ''} | "
                         f"{PATH_LABELS[x['path']]} | {x['concurrency']} | {_f(x['throughput_rps'], 1)} | "
                         f"{_f(L['p50'])} | {_f(L['p90'])} | {_f(L['p99'])} | {x['errors']} | "
                         f"{_f(c.get('gateway'), 3)} | {_f(c.get('tritonserver'), 3)} | {_f(c.get('backends'), 3)} | "
                         f"{_f(x.get('client_cpu_ms_per_request', c.get('client')), 3)} |")
    return lines


#: The README's serving-results block sits between these markers; :func:`readme_block` writes it from serve.json.
README_BEGIN, README_END = "<!-- serve: generated from benchmarks/results/serve.json -->", "<!-- /serve -->"


def readme_block(payload: dict) -> str:
    """The README's table of the request-path targets (numbers from the results, never typed by hand)."""
    m = payload["machine"]
    lines = [f"Measured by `unroll bench serve` ([`serve.md`](benchmarks/results/serve.md): every level, CPU per "
             f"request by process, Triton direct with PNG bytes) on {m['cpu']}, {m['logical_cores']} cores shared by "
             f"client, gateway and Triton, {m.get('date_utc', '')} UTC:", "",
             *targets_table(payload["targets"])]
    return "\n".join(lines)
