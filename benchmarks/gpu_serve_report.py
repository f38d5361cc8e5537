"""The GPU serving check's results: ``gpu_serve.json`` (everything measured) and ``gpu_serve.md`` (the tables)."""

from __future__ import annotations

from pathlib import Path

from unroll.benchmarks import gpu_serve_decode as decode
from unroll.benchmarks.common import write_results

STEM = "gpu_serve"
PATH_LABELS = {"triton-tensors": "Triton direct, tensors", "triton-image": "Triton direct, image bytes",
               "gateway": "gateway (PNG)"}


def _f(v: object, fmt: str = ".2f") -> str:
    return "–" if v is None else format(v, fmt)


def _batches(h: dict | None) -> str:
    if not h:
        return "–"
    top = sorted(h.items(), key=lambda kv: -kv[1])[:4]
    return ", ".join(f"{k}×{v}" for k, v in top) + (" …" if len(h) > 4 else "")


def markdown(r: dict) -> str:
    m = r["machine"]
    gen = r["load_generator"]
    lines = [
        "# Served on a GPU: Triton and the gateway, measured from outside",
        "",
        f"Device **{m.get('gpu', m['device'])}** (driver {m.get('driver', '–')}), torch {m['torch']} (CUDA "
        f"{m.get('cuda_build') or '–'}), tritonserver {m.get('tritonserver', '–')}, Python {m['python']}; "
        f"{m['cores']} cores ({m.get('cpu', '?')}), {m['gateway_workers']} gateway workers; "
        f"measured {m['date_utc']} UTC{' (quick run)' if r['quick'] else ''}; {r['elapsed_s']:.0f} s in all.",
        f"Served as: {', '.join(f'{k}: {v}' for k, v in m.get('served_as', {}).items())}.",
        "",
        f"Load: the project's load engine (`benchmarks/loadgen.py`, closed loop, asyncio + h11, one keep-alive "
        f"connection per request in flight, over several client processes): {gen['req_per_s_per_process']:,.0f} "
        f"requests/s per client process against a server that does nothing (its ceiling on this machine"
        + (f", {gen['cpu_ms_per_request']:.3f} client CPU ms per request" if gen.get("cpu_ms_per_request") else "")
        + "); a level whose client CPU share nears 100 % was limited by the client.",
        "",
        "## Levels",
        "",
        "| workload | path | in flight | req/s | p50 ms | p99 ms | errors | mean batch | batches formed (size×count) "
        "| GPU util % | CPU ms/req gateway / tritonserver / stubs / client | client CPU |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: |",
    ]
    for x in r["levels"]:
        lat, cpu, t, g = x["latency_ms"], x["cpu_ms_per_request"], x["triton"] or {}, x["gpu"] or {}
        lines.append(
            f"| {x['workload']} | {PATH_LABELS.get(x['path'], x['path'])} | {x['concurrency']} | "
            f"{x['throughput']:,.0f} | {_f(lat['p50'])} | {_f(lat['p99'])} | {x['errors']} | "
            f"{_f(t.get('avg_batch'), '.1f')} | {_batches(x['batches'])} | {_f(g.get('gpu_util_mean'), '.0f')} | "
            f"{' / '.join(_f(cpu.get(k), '.3f') for k in ('gateway', 'tritonserver', 'backends', 'client'))} | "
            f"{x['client_cpu_share'] * 100:.0f} % of {x['client_processes']} |")
    lines += ["", "## In-process, the same model and batch on the same device", "",
              "| model | input | batch | mode | p50 ms | p99 ms | images/s | note |", "| --- | --- | ---: | --- | ---: "
              "| ---: | ---: | --- |"]
    for x in r["inprocess"]:
        lines.append(f"| {x['model']} | {x['label']} | {x['batch']} | {x['mode']} | {_f(x.get('p50_ms'), '.3f')} | "
                     f"{_f(x.get('p99_ms'), '.3f')} | {_f(x.get('images_per_s'), ',.0f')} | "
                     f"{x.get('note') or x.get('error', '')} |")
    lines += ["", "## Parity: the card's gate data through Triton vs the CPU FP32 model", "",
              "| model | case | max abs | rel. error | tolerance | passed |", "| --- | --- | ---: | ---: | --- | --- |"]
    for x in r["parity"]:
        tol = ", ".join(f"{k} {v:g}" for k, v in x["tolerance"].items())
        verdict = "yes" if x["passed"] else "NO: " + "; ".join(x["violations"])
        lines.append(f"| {x['model']} | {x['label']} | {x['metrics']['max_abs']:.2e} | {x['metrics']['rel_err']:.2e} "
                     f"| {tol} ({x['tolerance_source']}) | {verdict} |")
    if "decode" in r:
        lines += decode.markdown(r["decode"])
    return "\n".join(lines) + "\n"


def write(out: Path, result: dict) -> tuple[Path, Path]:
    return write_results(STEM, result, markdown(result), out)
