"""What the solver output costs a client: the deployment served with the score against the same deployment without it.

Two repositories, written as ``unroll serve`` writes them (every model whose card declares ``ood``, with its
companions, the default configuration: threads, spinning, batching): *with*, the exported graphs; *without*, each
model's graph with the solver output (residual, code size) and every node only it needs removed, under the same name
and card less ``ood``. Each *run* starts a tritonserver and a gateway on one of them and sends, per model, one test
digit at concurrency 1 for ``run_s`` seconds per path (Triton's v2 HTTP endpoint with tensors, asking for the
logits and, where served, the solver output; the same asking for the logits alone, *score not asked*; the gateway's
``/v1/classify`` with the PNG), timing each request on a kept-alive connection (the load engine, one request at a
time: :mod:`.paired_latency`), and the CPU each process used.

A *cycle* is three runs: *without*, *with*, and *without* once more (*again*: the A/A arm, an identical deployment
started anew), in an order that rotates from cycle to cycle. Two models served side by side in one server differ here
by tens of microseconds that move with each start (which process lands on which core), as much as the score adds; a
fresh server per run turns that into noise between runs, which the interval then carries. Per cycle, the added
latency is the *with* run's p50 less the *without* run's; over the cycles, its mean with a Student-t 95 % interval.
The A/A arm, the *again* run less the *without* run, must show the design clean (its interval holds zero) before a
verdict can be met; the verdict is on the interval's upper end.

Shown beside, as explanation and never judged: the graph's added time in-process (ONNX Runtime with the served
threads and spinning, after the servers stopped), the extra output's hand-over (request pairs on one served model,
asked for both outputs against asked for its logits), and the gateway's own code for the score in-process.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx

from unroll import artifacts, pipeline
from unroll.benchmarks import paired_latency
from unroll.benchmarks.loadgen import v2_infer
from unroll.benchmarks.processes import cpu_by_pid, cpu_ms_per_request
from unroll.benchmarks.serve_load import Workload, classify_workload
from unroll.benchmarks.serve_triton import triton_server
from unroll.card import from_onnx, write_to_onnx
from unroll.errors import BenchError
from unroll.registry import get_spec
from unroll.serving.gateway.process import gateway_process
from unroll.serving.gateway.settings import Settings
from unroll.serving.repository import INTRA_OP_SPINNING, write_repository

PATHS = ("triton", "triton_unasked", "gateway")
PATH_LABELS = {"triton": "Triton HTTP (tensors)", "triton_unasked": "Triton HTTP (tensors), score not asked",
               "gateway": "gateway (PNG)"}
#: The three runs of a cycle: the deployment without the score, with it, and without it once more (the A/A arm).
ARMS = ("without", "with", "again")
#: The served sessions' intra-op threads (``unroll serve``'s default repository options).
SERVED_THREADS = pipeline.RepoOptions().threads
#: Unmeasured requests per path at the start of each run (connections, caches, ONNX Runtime's first runs).
WARMUP = 100


def declaring_ood(models: Sequence[str]) -> list[str]:
    """Those of ``models`` whose card declares a residual output (``ood``)."""
    return [m for m in models if get_spec(m).card.ood is not None]


def plain_copy(onnx_dir: Path, name: str, out_dir: Path | None = None, suffix: str = "") -> str:
    """Write ``name``'s graph without its solver output (the residual and code size, and every node only they need)
    into ``out_dir`` (default ``onnx_dir``) as ``NAME{suffix}.onnx`` with its report, its card without ``ood``;
    returns the copy's name. With no suffix it is the same model without the score, for another repository."""
    out_dir = out_dir or onnx_dir
    copy = name + suffix
    if copy == name and out_dir.resolve() == onnx_dir.resolve():
        raise BenchError(f"{name}: a copy under the same name needs another folder")
    model = onnx.load(str(artifacts.graph(name, onnx_dir=onnx_dir)))
    card = from_onnx(model)
    if card.ood is None:
        raise BenchError(f"{name}: its card declares no residual output (ood)")
    keep = [o.name for o in model.graph.output if o.name != card.ood.output]
    plain = onnx.utils.Extractor(model).extract_model([i.name for i in model.graph.input], keep)
    plain_card = card.model_copy(update={"name": copy, "ood": None})
    write_to_onnx(plain, plain_card)
    onnx.save(plain, str(artifacts.graph(copy, onnx_dir=out_dir)))
    report = json.loads(artifacts.graph_report(name, onnx_dir=onnx_dir).read_text())
    report.update(model=copy, card=plain_card.model_dump(mode="json"),
                  derived_from=f"{name} without its {card.ood.output!r} output",
                  outputs=[o for o in report["outputs"] if o["name"] in keep])
    artifacts.graph_report(copy, onnx_dir=out_dir).write_text(json.dumps(report, indent=2))
    return copy


def deployments(names: list[str], onnx_dir: Path, root: Path) -> dict[str, Path]:
    """The two repositories (module doc): ``with`` as the pipeline writes it (exports first where missing or stale),
    ``without`` the same with each of ``names`` rewritten from its plain copy; the A/A arm serves ``without`` again."""
    repos = {"with": root / "repo-with", "without": root / "repo-without"}
    options = pipeline.RepoOptions(optimized=False)  # the defaults `unroll serve` uses without an optimize choice
    pipeline.run(pipeline.plan(names, onnx_dir=onnx_dir, repo=repos["with"], options=options), progress=None)
    plain_dir = root / "onnx-without"
    plain_dir.mkdir()
    for name in names:
        plain_copy(onnx_dir, name, plain_dir)
    shutil.copytree(repos["with"], repos["without"], symlinks=True)
    write_repository("cpu", names, repos["without"], onnx_dir=plain_dir, **options.writer_kwargs())
    return {"with": repos["with"], "without": repos["without"], "again": repos["without"]}


def order(cycle: int) -> list[str]:
    """The arms of ``cycle``: rotated by one each cycle, reversed every other, so each arm takes each place."""
    k = cycle % len(ARMS)
    arms = list(ARMS[k:] + ARMS[:k])
    return arms[::-1] if (cycle // len(ARMS)) % 2 else arms


def _endpoints(triton_http: str, gateway: str, name: str, sample: Workload, served: list[str]
               ) -> dict[str, paired_latency.Endpoint]:
    """Per path, the request for ``sample``'s first digit to ``name``, asking Triton for the ``served`` outputs
    (``triton``) or for the first of them alone (``triton_unasked``)."""
    both, first = (v2_infer(name, sample.arrays[0], outputs) for outputs in (served, served[:1]))
    return {"triton": paired_latency.Endpoint(f"http://{triton_http}{both.path}", both.body, both.headers),
            "triton_unasked": paired_latency.Endpoint(f"http://{triton_http}{first.path}", first.body, first.headers),
            "gateway": paired_latency.Endpoint(f"{gateway}/v1/classify?model={name}", sample.images[0],
                                               {"Content-Type": "image/png"})}


def _one_run(repo: Path, log_dir: Path, names: list[str], run_s: float, with_score: bool,
             handover_s: float = 0.0) -> dict[str, dict]:
    """One run (module doc): per model and path, p50/mean ms, the requests, CPU ms per request by process kind; with
    ``handover_s``, the extra output's hand-over in request pairs on each model (a *with* run only)."""
    out: dict[str, dict] = {}
    with triton_server(repo, log_dir / "triton.log") as (http, grpc), \
            gateway_process(Settings(triton_url=grpc.removeprefix("grpc://")), log_dir / "gateway.log") as gateway:
        for name in names:
            card = get_spec(name).card
            served = [card.output, card.ood.output] if with_score else [card.output]
            ends = _endpoints(http, gateway, name, classify_workload(name, n=1), served)
            row: dict = {}
            for path, endpoint in ends.items():
                before: dict = {}
                ms = paired_latency.latencies(endpoint, run_s, warmup=WARMUP,
                                              on_measure_start=lambda b=before: b.update(cpu_by_pid()))
                cpu = cpu_ms_per_request(before, cpu_by_pid(), len(ms)) or {}
                row[path] = {"p50_ms": float(np.median(ms)), "mean_ms": float(np.mean(ms)), "requests": len(ms),
                             "cpu_ms_per_request": {k: round(v, 4) for k, v in cpu.items() if k != "client"}}
            if handover_s:
                row["handover"] = paired_latency.added(ends["triton_unasked"], ends["triton"], handover_s)
            out[name] = row
    return out


def measure(models: Sequence[str], onnx_dir: Path = artifacts.ONNX_DIR, cycles: int = 8, run_s: float = 1.5,
            tick: Callable[[str], None] = lambda m: None, handover_s: float = 4.0) -> dict[str, dict]:
    """Per model that declares ``ood``: per path the runs' p50 and CPU per request for each arm, the added latency and
    the A/A difference over ``cycles`` cycles (module doc), and the explanation (graph, hand-over, gateway code)."""
    names = declaring_ood(models)
    if not names:
        return {}
    if cycles < 2:
        raise BenchError("the served cost needs at least 2 cycles for an interval")
    runs: list[dict] = []
    handover: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="unroll-ood-served-") as tmp:
        root = Path(tmp)
        repos = deployments(names, onnx_dir, root)
        for cycle in range(cycles):
            for arm in order(cycle):
                tick(f"served cost: cycle {cycle + 1}/{cycles}, the deployment {arm} the score")
                first_with = arm == "with" and cycle == 0
                result = _one_run(repos[arm], root, names, run_s, arm == "with", handover_s if first_with else 0.0)
                if first_with:
                    handover = {n: result[n].pop("handover") for n in names}
                runs.append({"cycle": cycle, "arm": arm, "models": result})
        out = {name: summarize(name, runs, cycles, run_s) | {"handover": handover[name]} for name in names}
        for name in names:
            out[name]["graph"] = graph_cost(onnx_dir, root / "onnx-without", name,
                                            classify_workload(name, n=1).arrays[0])
    return out


def summarize(name: str, runs: list[dict], cycles: int, run_s: float) -> dict:
    """One model's account of the runs: per path and arm the runs' p50s and CPU per request (medians over runs),
    and per cycle the added latency (*with* − *without*) and the A/A difference (*again* − *without*) with their
    means and intervals (:func:`paired_latency.mean_ci`) and their shares of the *without* p50; then the verdict."""
    result: dict = {"cycles": cycles, "run_s": run_s, "concurrency": 1, "warmup_requests": WARMUP,
                    "orders": [order(c) for c in range(cycles)]}
    for path in PATHS:
        p50 = {arm: [next(r["models"][name][path]["p50_ms"] for r in runs if r["cycle"] == c and r["arm"] == arm)
                     for c in range(cycles)] for arm in ARMS}
        row: dict = {}
        for arm in ARMS:
            mine = [r["models"][name][path] for r in runs if r["arm"] == arm]
            kinds = mine[0]["cpu_ms_per_request"]
            row[arm] = {"p50_ms": float(np.median(p50[arm])), "p50_ms_per_cycle": p50[arm],
                        "requests": int(sum(m["requests"] for m in mine)),
                        "cpu_ms_per_request": {k: float(np.median([m["cpu_ms_per_request"][k] for m in mine]))
                                               for k in kinds}}
        base = row["without"]["p50_ms"]
        for key, arm in (("added", "with"), ("aa", "again")):
            diff = [a - b for a, b in zip(p50[arm], p50["without"], strict=True)]
            ms, (lo, hi) = float(np.mean(diff)), paired_latency.mean_ci(np.array(diff))
            row[key] = {"ms": ms, "ci_ms": [lo, hi], "share": ms / base, "ci": [lo / base, hi / base],
                        "per_cycle_ms": diff}
        row["verdict"] = judge(row)
        result[path] = row
    return result


def judge(row: dict, target: float = 0.05) -> dict:
    """Whether one path's added latency meets ``target`` (a share of the request without it): the A/A difference's
    interval must hold zero (the design is clean on this model and path), and the added latency's interval must end
    at or below ``target``; with the reason in words when not."""
    lo, hi = row["aa"]["ci_ms"]
    clean = lo <= 0.0 <= hi
    upper = row["added"]["ci"][1]
    if not clean:
        why = f"the A/A interval ({lo * 1e3:+.0f} … {hi * 1e3:+.0f} µs) does not hold zero: the design is not clean"
    elif upper > target:
        why = f"the interval's upper end, {upper:+.1%}, is above {target:.0%}"
    else:
        why = f"the interval's upper end, {upper:+.1%}, is within {target:.0%}"
    return {"met": clean and upper <= target, "aa_clean": clean, "upper": upper, "target": target, "why": why}


def graph_cost(onnx_dir: Path, plain_dir: Path, name: str, feeds: dict[str, np.ndarray],
               rounds: int = 10) -> dict:
    """The graph's own part of the cost, in-process: ONNX Runtime with the served threads and spinning, batch 1,
    the graph and its plain copy in alternating rounds, median ms each and the difference. ``feeds``: the image; λ,
    where the graph takes it, at the card's default as a served request without one. Explanation, not a verdict:
    it runs after the servers stopped, on a quieter machine."""
    from unroll.benchmarks.common import time_call
    from unroll.serving.cpu_runtime import ort_session

    paths = {"with": artifacts.graph(name, onnx_dir=onnx_dir), "without": artifacts.graph(name, onnx_dir=plain_dir)}
    sessions = {g: ort_session(str(p), SERVED_THREADS, INTRA_OP_SPINNING) for g, p in paths.items()}
    card = get_spec(name).card
    if card.lam is not None:
        feeds = {**feeds, card.lam.input: np.full(len(next(iter(feeds.values()))), card.lam.default, np.float32)}
    times: dict[str, list[float]] = {g: [] for g in sessions}
    for r in range(rounds):
        for g in (list(sessions) if r % 2 == 0 else list(sessions)[::-1]):
            times[g].append(time_call(lambda g=g: sessions[g].run(None, feeds), budget_s=0.3)["median_ms"])
    outputs = dict(zip([o.name for o in sessions["with"].get_outputs()], sessions["with"].run(None, feeds),
                       strict=True))
    return {**{f"{g}_ms": float(np.median(t)) for g, t in times.items()},
            "added_ms": float(np.median([w - o for w, o in zip(times["with"], times["without"], strict=True)])),
            "threads": SERVED_THREADS, "spinning": INTRA_OP_SPINNING,
            "gateway_score": gateway_score_cost(onnx_dir, name, outputs)}


def gateway_score_cost(onnx_dir: Path, name: str, outputs: dict[str, np.ndarray], rounds: int = 10,
                       calls: int = 2000) -> dict[str, float]:
    """What the gateway does for the score, in-process: its own code (:mod:`unroll.serving.gateway.ood`: the fields,
    the header, the answer's JSON) on the served graph's real outputs for one digit, with the served card and with
    the same card without ``ood`` (whose answer says there is no score), alternating rounds of ``calls`` calls;
    median ms per call each and the difference."""
    import json as json_module
    import timeit

    from unroll.serving.gateway import ood as gateway_ood
    from unroll.serving.gateway.classify import predictions_from_logits

    card = from_onnx(onnx.load(str(artifacts.graph(name, onnx_dir=onnx_dir))))
    cards = {"with": card, "without": card.model_copy(update={"ood": None})}
    # the gateway's own top label and MSP (the same on both sides: outside the timing)
    preds, msp = predictions_from_logits(outputs[card.output][0], 1, card, name)
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
