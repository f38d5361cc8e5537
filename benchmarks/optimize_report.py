"""The evidence of an ``unroll optimize`` choice as Markdown: candidates, gate, timings, the configuration sweep."""

from __future__ import annotations

from unroll.pipeline.choice import describe_quality


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}"


def _config(c: dict) -> str:
    return (f"{c['instances']}×{c['threads']} thr, batch ≤{c['max_batch_size']}, delay {c['queue_delay_us']} µs, "
            f"spin {'on' if c['spinning'] else 'off'}")


def candidates_table(record: dict) -> list[str]:
    rows = record["candidates"]
    labels = list(dict.fromkeys(lb for r in rows for lb in r.get("timings", {})))
    head = ["candidate", "status", "gate (vs FP32 reference)"]
    head += [f"{lb} p50 / p99 ms" for lb in labels] + [f"{lb} CPU ms/call" for lb in labels] + ["score"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    chosen = record["choice"]
    for r in sorted(rows, key=lambda r: r.get("score", float("inf"))):
        c = r["candidate"]
        mark = " **(chosen)**" if all(c.get(k, False) == chosen.get(k, False)
                                      for k in ("runtime", "precision", "static_shapes", "bf16")) else ""
        gate = r.get("gate") or {}
        metrics = ", ".join(f"{k} {v:.3g}" for k, v in (gate.get("metrics") or {}).items()
                            if isinstance(v, (int, float)) and k in gate.get("tolerances", {}))
        status = r.get("status", "")
        if r.get("reason"):
            status += f": {r['reason']}"
        t = r.get("timings", {})
        cells = [r["key"] + mark, status, metrics or "–"]
        cells += [f"{_ms(t[lb]['p50_ms'])} / {_ms(t[lb]['p99_ms'])}" if lb in t else "–" for lb in labels]
        cells += [_ms(t[lb]["cpu_ms"]) if lb in t else "–" for lb in labels]
        cells.append(f"{r['score']:.2f}" if "score" in r else "–")
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    out += [f"| {s['candidate']} | skipped: {s['reason']} |" + " – |" * (len(head) - 2) for s in record["skipped"]]
    return out


def sweep_lines(sweep: dict) -> list[str]:
    if sweep["status"] != "measured":
        return [f"Configuration sweep skipped: {sweep['reason']}. The hand-set configuration is kept: "
                f"{_config(sweep['hand_set'])}."]
    budget = sweep.get("latency_budget_ms")
    out = [f"Request: {sweep['request']}; perf_analyzer at concurrency {', '.join(map(str, sweep['concurrency']))}. "
           f"Objective: {sweep['objective']} (budget: {f'{budget:.2f} ms' if budget else 'none'}; "
           f"{sweep.get('latency_budget_source', '')}).", "",
           "| configuration | " + " | ".join(f"c{c} req/s · p50 / p99 ms · server CPU ms/req · batch"
                                             for c in sweep["concurrency"]) + " | objective req/s |",
           "|---|" + "---|" * len(sweep["concurrency"]) + "---|"]
    for p in sweep["points"]:
        tags = [t for t, c in (("hand-set", sweep["hand_set"]), ("chosen", sweep["chosen"])) if c == p["config"]]
        name = _config(p["config"]) + (f" **({', '.join(tags)})**" if tags else "")
        if p.get("error"):
            out.append(f"| {name} | refused by Triton: {p['error']} |" + " |" * (len(sweep["concurrency"]) - 1)
                       + " 0 |")
            continue
        cells = [f"{lv['throughput_rps']:.0f} · {_ms(lv['p50_ms'])} / {_ms(lv['p99_ms'])} · "
                 f"{_ms(lv['server_cpu_ms_per_request'])} · {_ms(lv['avg_batch'])}" for lv in p["levels"]]
        out.append(f"| {name} | " + " | ".join(cells) + f" | {p['objective']:.0f} |")
    gain = sweep.get("gain")
    verdict = (f"The chosen configuration reaches {gain:.2f}× the hand-set one's objective in this run."
               if gain and sweep["chosen"] != sweep["hand_set"] else
               "The hand-set configuration is already the best: no change raised the objective by more than "
               f"{100 * 0.05:.0f} % in this run.")
    return [*out, "", verdict + (" (The time budget ended the sweep early.)" if sweep.get("truncated") else "")]


def markdown(record: dict) -> str:
    c = record["choice"]
    lines = [f"# `unroll optimize {record['model']}` ({record['target']})", "",
             f"{record['machine'].get('cpu', '')}, measured {record['written_utc']} UTC in {record['elapsed_s']:.0f} s "
             f"(budget {record['time_budget_min']:g} min{', cut short by it' if record['truncated'] else ''}).", "",
             f"**Chosen:** {c['runtime']}{' (static shapes)' if c['static_shapes'] else ''}, "
             f"{'bf16 maths on the fp32 graph' if c.get('bf16') else c['precision']}, "
             f"{_config(c)}. `unroll repo` serves it (`--no-optimized` ignores it).", "",
             f"**Precision:** {describe_quality(record.get('quality'))}; allowed: "
             f"{', '.join(record.get('precisions_allowed') or ['not recorded'])} (INT8 only when `--precision` "
             "names it).", "",
             "## Candidates", "",
             f"Each candidate is checked against the {record['reference']} on the card's gate data "
             f"({record['gate_data']}) before it is timed; a candidate beyond its gate is refused. Timings: in "
             "process, p50/p99 of one call; CPU: this process's CPU time per call (all threads); score: mean p50 "
             "relative to the fastest (1.00 = fastest).", "",
             *candidates_table(record), "",
             "## Triton configuration sweep", "", *sweep_lines(record["sweep"]), "",
             *versus_lines(record.get("served_vs_compile")), ""]
    return "\n".join(lines)


def versus_lines(versus: dict | None) -> list[str]:
    if not versus:
        return []
    out = ["## Served vs torch.compile", "", f"{versus['method']}; {versus['threads']} threads.", "",
           "| case | served (Triton direct) p50 ms | client | torch.compile p50 ms | compile ÷ served "
           "| served ≥ compile |",
           "|---|---|---|---|---|---|"]
    out += [f"| {r['case']} | skipped: {r['skipped']} | | | | |" if "skipped" in r else
            f"| {r['case']} | {r['served_p50_ms']:.2f} | {r['client']} | {r['compile_p50_ms']:.2f} | "
            f"{r['compile_over_served']:.2f}× | {'yes' if r['compile_over_served'] >= 1 else '**no**'} |"
            for r in versus["rows"]]
    return out
