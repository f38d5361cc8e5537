"""What the solver outputs cost a served request: each model whose card declares ``ood``, served as ``unroll serve``
serves it, beside a copy of the same graph without the residual and code-size branch, in one tritonserver behind one
gateway.

``ab`` at concurrency 1 posts one test digit to Triton's v2 HTTP endpoint (tensors; the model with the residual is asked
for both outputs, the copy for its logits; and, a third path, the model with the residual asked for its logits alone:
what a client that does not want the score pays, as the backend builds only the outputs a client names) and to the
gateway's ``/v1/classify`` (the PNG; the gateway adds the score, the verdict and the header for the model with the
residual), in rounds that alternate which graph goes first, so drift on a shared machine falls on both. Per graph and
path: the median of the rounds' p50, CPU ms per request by process kind and Triton's own time for the model's work (its
statistics' compute input + infer + output). The added latency is the residual's added model time as a share of the
request's p50 without it; the direct ratio of the two p50s (median over rounds of each back-to-back pair) is kept beside
it, but on a shared 2-core machine a whole request's p50 moves by several percent from one run to the next, more than
the residual adds.

So each path is also measured in pairs (:mod:`~unroll.benchmarks.paired_latency`: one request to each side back to
back, thousands of times, the median of the differences with its confidence interval). Two copies of the same plain
graph (an A/A pair) show how far two served models that do the same work can differ here: tens of microseconds that
move over a run (which process lands on which core), as large as what the residual adds. So the added latency judged
is built from comparisons free of that: Triton direct, the graph's own added time (in-process, ONNX Runtime as served)
plus the hand-over of the extra output, measured in pairs on the same served model (asked for both outputs against
asked for its logits); score not asked, the graph's time alone (the output is not handed over); the gateway, both of
those and the gateway's own work for the score (its code on the graph's real outputs, in-process, with the served card
against the same card without ``ood``). The served pairs of the two graphs are kept beside, not judged.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx

from unroll import artifacts, pipeline
from unroll.benchmarks import paired_latency, serve_ab
from unroll.benchmarks.processes import cpu_by_pid, cpu_ms_per_request
from unroll.benchmarks.serve_load import Workload, classify_workload
from unroll.benchmarks.serve_triton import STAT_KEYS, stats_delta, triton_server, triton_stats
from unroll.card import from_onnx, write_to_onnx
from unroll.errors import BenchError
from unroll.registry import get_spec
from unroll.serving.gateway.process import gateway_process
from unroll.serving.gateway.settings import Settings
from unroll.serving.repository import write_repository

#: The copy's name: the model's, with this suffix; the A/A pair's second copy has :data:`TWIN`.
PLAIN = "-plain"
TWIN = "-plain-twin"
PATHS = ("triton", "triton_unasked", "gateway")
PATH_LABELS = {"triton": "Triton HTTP (tensors)", "triton_unasked": "Triton HTTP (tensors), score not asked",
               "gateway": "gateway (PNG)"}
#: Triton's statistics that time the model's own work (inputs in, execution, outputs out), per request.
COMPUTE = tuple(k for k in STAT_KEYS if k != "queue")


def declaring_ood(models: Sequence[str]) -> list[str]:
    """Those of ``models`` whose card declares a residual output (``ood``)."""
    return [m for m in models if get_spec(m).card.ood is not None]


def plain_copy(onnx_dir: Path, name: str, suffix: str = PLAIN) -> str:
    """Write ``NAME-plain.onnx`` (``NAME{suffix}``) beside ``NAME.onnx``: the same graph with the solver output
    (residual, code size) and every node only it needs removed, its card without ``ood``; returns the copy's name."""
    model = onnx.load(str(artifacts.graph(name, onnx_dir=onnx_dir)))
    card = from_onnx(model)
    if card.ood is None:
        raise BenchError(f"{name}: its card declares no residual output (ood)")
    keep = [o.name for o in model.graph.output if o.name != card.ood.output]
    plain = onnx.utils.Extractor(model).extract_model([i.name for i in model.graph.input], keep)
    plain_card = card.model_copy(update={"name": name + suffix, "ood": None, "iters": None})
    write_to_onnx(plain, plain_card)
    onnx.save(plain, str(artifacts.graph(name + suffix, onnx_dir=onnx_dir)))
    report = json.loads(artifacts.graph_report(name, onnx_dir=onnx_dir).read_text())
    report.update(model=name + suffix, card=plain_card.model_dump(mode="json"),
                  derived_from=f"{name} without its {card.ood.output!r} output",
                  outputs=[o for o in report["outputs"] if o["name"] in keep])
    artifacts.graph_report(name + suffix, onnx_dir=onnx_dir).write_text(json.dumps(report, indent=2))
    return name + suffix


def _targets(triton_http: str, gateway: str, name: str, sample: Workload, outputs: list[str]) -> dict[str, tuple]:
    """Per path: (url, body, content type, headers) for ``sample``'s first digit sent to the graph ``name``, asking
    Triton for ``outputs`` (``triton``) or for the first of them alone (``triton_unasked``)."""
    url = f"http://{triton_http}/v2/models/{name}/infer"
    body, headers = serve_ab.triton_body(sample.arrays[0], outputs)
    first, first_headers = serve_ab.triton_body(sample.arrays[0], outputs[:1])
    return {"triton": (url, body, "application/octet-stream", headers),
            "triton_unasked": (url, first, "application/octet-stream", first_headers),
            "gateway": (f"{gateway}/v1/classify?model={name}", sample.images[0], "image/png", {})}


def graph_cost(onnx_dir: Path, name: str, feeds: dict[str, np.ndarray], rounds: int = 10) -> dict[str, float]:
    """The graph's own part of the cost, in-process: ONNX Runtime with one thread (as the served session), batch 1,
    ``name`` and its plain copy in alternating rounds, median ms each and the difference (what a served request pays
    beyond it is the backend handing over one more output). ``feeds``: the image; λ, where the graph takes it, at the
    card's default as a served request without one."""
    import onnxruntime as ort

    from unroll.benchmarks.common import time_call

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sessions = {g: ort.InferenceSession(str(artifacts.graph(m, onnx_dir=onnx_dir)), options,
                                        providers=["CPUExecutionProvider"]) for g, m in (("with", name),
                                                                                         ("without", name + PLAIN))}
    card = get_spec(name).card
    if card.lam is not None:
        feeds = {**feeds, card.lam.input: np.full(len(next(iter(feeds.values()))), card.lam.default, np.float32)}
    times: dict[str, list[float]] = {g: [] for g in sessions}
    for r in range(rounds):
        for g in (list(sessions) if r % 2 == 0 else list(sessions)[::-1]):
            times[g].append(time_call(lambda g=g: sessions[g].run(None, feeds), budget_s=0.3)["median_ms"])
    out = {f"{g}_ms": float(np.median(t)) for g, t in times.items()}
    outputs = dict(zip([o.name for o in sessions["with"].get_outputs()], sessions["with"].run(None, feeds),
                       strict=True))
    return {**out, "added_ms": float(np.median([w - o for w, o in zip(times["with"], times["without"],
                                                                       strict=True)])),
            "gateway_score": gateway_score_cost(onnx_dir, name, outputs)}


def gateway_score_cost(onnx_dir: Path, name: str, outputs: dict[str, np.ndarray], rounds: int = 10,
                       calls: int = 2000) -> dict[str, float]:
    """What the gateway does for the score, in-process: its own code (:mod:`unroll.serving.gateway.ood`: the fields,
    the header, the answer's JSON) on the served graph's real outputs for one digit, with the served card and with
    the same card without ``ood`` (whose answer says there is no score), alternating rounds of ``calls`` calls;
    median µs per call each and the difference, in ms."""
    import json as json_module
    import timeit

    from unroll.serving.gateway import ood as gateway_ood
    from unroll.serving.gateway.classify import _from_logits

    card = from_onnx(onnx.load(str(artifacts.graph(name, onnx_dir=onnx_dir))))
    cards = {"with": card, "without": card.model_copy(update={"ood": None})}
    # the gateway's own top label and MSP (the same on both sides: outside the timing)
    preds, msp = _from_logits(outputs[card.output][0], 1, card, name)
    lam = card.lam.default if card.lam is not None else None

    def answer(c: object) -> str:
        body: dict = {"model": name, "predictions": preds, "latency_ms": 1.0}
        body.update(gateway_ood.fields(c, c, lam, outputs, msp))
        gateway_ood.header(body)
        return json_module.dumps(body)

    times: dict[str, list[float]] = {g: [] for g in cards}
    for r in range(rounds):
        for g in (list(cards) if r % 2 == 0 else list(cards)[::-1]):
            times[g].append(timeit.timeit(lambda g=g: answer(cards[g]), number=calls) / calls * 1e3)
    return {**{f"{g}_ms": float(np.median(t)) for g, t in times.items()},
            "added_ms": float(np.median([w - o for w, o in zip(times["with"], times["without"], strict=True)]))}


def measure(models: Sequence[str], onnx_dir: Path = artifacts.ONNX_DIR, rounds: int = 3, round_s: float = 3.0,
            tick: Callable[[str], None] = lambda m: None, paired_s: float = 8.0) -> dict[str, dict]:
    """Per model (those that declare ``ood``): per path, the p50 and CPU ms per request with and without the residual,
    the added model time, and the added latency measured in pairs for ``paired_s`` seconds. The repository is
    written by the pipeline (exports first where missing or stale)."""
    names = declaring_ood(models)
    if not names:
        return {}
    if serve_ab.find() is None:
        raise BenchError(serve_ab.missing_reason())
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="unroll-ood-served-") as tmp:
        root = Path(tmp)
        repo = root / "repo"
        options = pipeline.RepoOptions(optimized=False)  # both graphs with the defaults, FP32
        pipeline.run(pipeline.plan(names, onnx_dir=onnx_dir, repo=repo, options=options), progress=None)
        copies = root / "onnx"
        copies.mkdir()
        for name in names:
            for f in (artifacts.graph(name, onnx_dir=onnx_dir), artifacts.graph_report(name, onnx_dir=onnx_dir)):
                (copies / f.name).symlink_to(f.resolve())
            write_repository("cpu", [plain_copy(copies, name, suffix) for suffix in (PLAIN, TWIN)], repo,
                             onnx_dir=copies)
        with triton_server(repo, root / "triton.log") as (http, grpc), \
                gateway_process(Settings(triton_url=grpc.removeprefix("grpc://")), root / "gw.log") as gateway:
            for name in names:
                tick(f"served cost of {name}'s residual")
                out[name] = _measure_pair(http, gateway, name, rounds, round_s, paired_s)
        for name in names:
            out[name]["graph"] = graph_cost(copies, name, classify_workload(name, n=1).arrays[0])
            judge(out[name])
    return out


def judge(m: dict) -> None:
    """Per path, the added latency judged (``judged``: ms, share of the ``ab`` p50 without it, and how it was
    measured), from the comparisons that the A/A pair does not show to be unresolvable (module docstring)."""
    parts = {"triton": (m["graph"]["added_ms"] + m["handover"]["added_ms"],
                        "graph in-process + hand-over of the output (pairs, same served model)"),
             "triton_unasked": (m["graph"]["added_ms"], "graph in-process (no output handed over)"),
             "gateway": (m["graph"]["added_ms"] + m["handover"]["added_ms"] + m["graph"]["gateway_score"]["added_ms"],
                         "graph in-process + hand-over (pairs, same served model, Triton HTTP) + the gateway's "
                         "score, in-process")}
    for path, (ms, how) in parts.items():
        m[path]["judged"] = {"added_ms": ms, "added": ms / m[path]["without"]["p50_ms"], "how": how}


def _measure_pair(http: str, gateway: str, name: str, rounds: int, round_s: float, paired_s: float) -> dict:
    card = get_spec(name).card
    sample = classify_workload(name, n=1)  # the first test digit: its tensor and its PNG
    graphs = {"with": (name, [card.output, card.ood.output]), "without": (name + PLAIN, [card.output])}
    targets = {g: _targets(http, gateway, m, sample, outs) for g, (m, outs) in graphs.items()}
    runs: dict[tuple[str, str], list[dict]] = {(g, p): [] for g in graphs for p in PATHS}
    for g in graphs:
        for p in PATHS:
            url, body, ctype, headers = targets[g][p]
            serve_ab.run(url, body, ctype, 1, 1, headers)  # warm-up
    for r in range(rounds):
        order = list(graphs) if r % 2 == 0 else list(graphs)[::-1]
        for p in PATHS:
            for g in order:
                url, body, ctype, headers = targets[g][p]
                before, stats = cpu_by_pid(), triton_stats(http, graphs[g][0])
                run = serve_ab.run(url, body, ctype, 1, round_s, headers)
                run["cpu_ms_per_request"] = cpu_ms_per_request(before, cpu_by_pid(), run["requests"])
                split = stats_delta(stats, triton_stats(http, graphs[g][0])) or {}
                run["compute_ms"] = sum(split.get(f"{k}_ms", float("nan")) for k in COMPUTE)
                if run["failed"]:
                    raise BenchError(f"{graphs[g][0]} via {p}: {run['failed']} of {run['requests']} requests failed")
                runs[(g, p)].append(run)
    result: dict = {"rounds": rounds, "round_s": round_s, "concurrency": 1}
    for p in PATHS:
        row: dict = {}
        p50 = {g: [r["latency_ms"]["p50"] for r in runs[(g, p)]] for g in graphs}
        cpu = {g: [sum(v for k, v in r["cpu_ms_per_request"].items() if k != "client") for r in runs[(g, p)]]
               for g in graphs}
        for g in graphs:
            row[g] = {"p50_ms": float(np.median(p50[g])), "requests": int(sum(r["requests"] for r in runs[(g, p)])),
                      "cpu_ms_per_request": float(np.median(cpu[g])),
                      "compute_ms": float(np.median([r["compute_ms"] for r in runs[(g, p)]]))}
        # each round's two runs are back to back: their ratio is free of the drift between rounds
        ratios = [w / o - 1 for w, o in zip(p50["with"], p50["without"], strict=True)]
        row["added_p50"] = float(np.median(ratios))
        row["added_p50_rounds"] = [round(v, 4) for v in ratios]
        row["added_cpu"] = float(np.median([w / o - 1 for w, o in zip(cpu["with"], cpu["without"], strict=True)]))
        # Triton's own timing of the model's execution: what the residual adds to the graph, free of the noise that
        # moves a whole request's p50 by several percent here; as a share of the request's p50 without it
        # (median over the rounds of each back-to-back pair's difference, as for the p50s: free of drift too)
        compute = {g: [r["compute_ms"] for r in runs[(g, p)]] for g in graphs}
        row["added_compute_ms"] = float(np.median([w - o for w, o in zip(compute["with"], compute["without"],
                                                                          strict=True)]))
        row["added_latency"] = row["added_compute_ms"] / row["without"]["p50_ms"]
        row["paired"] = paired_latency.added(_endpoint(targets["without"][p]), _endpoint(targets["with"][p]),
                                             paired_s)
        result[p] = row
    twin = _targets(http, gateway, name + TWIN, sample, [card.output])["triton"]
    result["twin"] = paired_latency.added(_endpoint(targets["without"]["triton"]), _endpoint(twin), paired_s)
    # the extra output's hand-over on one served model: asked for both outputs against asked for its logits
    result["handover"] = paired_latency.added(_endpoint(targets["with"]["triton_unasked"]),
                                              _endpoint(targets["with"]["triton"]), paired_s)
    return result


def _endpoint(target: tuple) -> paired_latency.Endpoint:
    url, body, ctype, headers = target
    return paired_latency.Endpoint(url, body, {**headers, "Content-Type": ctype})
