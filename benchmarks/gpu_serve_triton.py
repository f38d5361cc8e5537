"""The GPU serving check's requests and references: Triton's HTTP/REST protocol with binary tensors (the bodies of
``loadgen.v2_infer``, sent with httpx or by the load engine as they are), Triton's
statistics, the workloads (``serve_load``'s, as ``unroll bench serve`` measures them), the parity gate through Triton
on the card's gate data (``gpu_check``'s cases and gate), and the in-process timings of the same model and batch."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from tritonclient.utils import triton_to_np_dtype

import unroll
from unroll import tasks
from unroll.benchmarks.gpu_check_cases import build_cases
from unroll.benchmarks.gpu_check_device import time_runner
from unroll.benchmarks.gpu_check_run import gate_check, parity, tolerance_for
from unroll.benchmarks.loadgen import Payload, v2_infer
from unroll.benchmarks.serve_load import (
    Workload,
    as_batch,
    classify_workload,
    denoise_workload,
    image_feeds,
    image_output,
)
from unroll.registry import get_spec
from unroll.serving.triton import RESTRICTED_HEADER

CLASSIFY_SAMPLES, QUICK_CLASSIFY_SAMPLES, DENOISE_IMAGES = 64, 16, 2


def parse_response(body: bytes, header_length: int | None) -> dict[str, np.ndarray]:
    """The outputs of a Triton HTTP inference response (binary or JSON data)."""
    head = json.loads(body[:header_length] if header_length else body)
    out, pos = {}, header_length or 0
    for o in head["outputs"]:
        size = o.get("parameters", {}).get("binary_data_size")
        if size is None:
            out[o["name"]] = np.asarray(o["data"], triton_to_np_dtype(o["datatype"])).reshape(o["shape"])
        else:
            out[o["name"]] = np.frombuffer(body[pos:pos + size], triton_to_np_dtype(o["datatype"])).reshape(o["shape"])
            pos += size
    return out


class TritonHttp:
    """The served tritonserver's HTTP endpoint, with the key ``unroll serve`` locked its APIs with."""

    def __init__(self, url: str, key: str) -> None:
        import httpx

        self.url, self.key = url, key
        self.client = httpx.Client(base_url=f"http://{url}", headers={RESTRICTED_HEADER: key}, timeout=120)

    def get(self, path: str) -> dict:
        r = self.client.get(path)
        r.raise_for_status()
        return r.json()

    def version(self) -> str:
        return self.get("/v2").get("version", "?")

    def config(self, model: str) -> dict:
        return self.get(f"/v2/models/{model}/config")

    def runtimes(self, models: tuple[str, ...]) -> dict[str, str]:
        """Each model's runtime and instance kind, as its config says."""
        out = {}
        for m in models:
            cfg = self.config(m)
            params = {k: v.get("string_value") for k, v in cfg.get("parameters", {}).items()}
            kinds = sorted({g.get("kind", "?") for g in cfg.get("instance_group", [])})
            out[m] = f"{params.get('cpu_runtime', cfg.get('backend'))} ({', '.join(kinds)})"
        return out

    def stats(self, model: str) -> dict | None:
        try:
            return self.get(f"/v2/models/{model}/stats")["model_stats"][0]
        except (OSError, ValueError, KeyError, IndexError, Exception):  # noqa: BLE001 (a level without statistics)
            return None

    def infer(self, model: str, feeds: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        p = v2_infer(model, feeds, outputs)
        r = self.client.post(p.path, content=p.body, headers=p.headers)
        if r.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {r.status_code}: {r.text[:300]}")
        length = r.headers.get("Inference-Header-Content-Length")
        return parse_response(r.content, int(length) if length else None)

    def requests(self, w: Workload, path: str) -> list[Payload]:
        """``w``'s samples as the load engine sends them on ``path`` (under the gateway's or Triton's base URL)."""
        if path == "gateway":
            return [Payload(w.gateway_path, png, {"Content-Type": "image/png"}) for png in w.images]
        feeds = image_feeds(w) if path == "triton-image" else [{k: as_batch(v) for k, v in a.items()}
                                                                for a in w.arrays]
        output = image_output(w) if path == "triton-image" else w.output
        return [v2_infer(w.model, f, [output], headers={RESTRICTED_HEADER: self.key}) for f in feeds]


def batch_histogram(before: dict | None, after: dict | None) -> dict[str, int] | None:
    """Executions per batch size Triton formed between two statistics snapshots (its ``batch_stats``)."""
    if before is None or after is None:
        return None

    def counts(s: dict) -> dict[int, int]:
        return {int(b["batch_size"]): int(b.get("compute_infer", {}).get("count", 0)) for b in s.get("batch_stats", [])}

    b, a = counts(before), counts(after)
    return {str(k): a[k] - b.get(k, 0) for k in sorted(a) if a[k] - b.get(k, 0) > 0}


def workloads(models: tuple[str, ...], sizes: tuple[int, ...], quick: bool) -> list[Workload]:
    """The classifiers' test digits and the denoisers' photos at each size (``serve_load``'s workloads)."""
    out = []
    for m in models:
        if get_spec(m).task == tasks.CLASSIFICATION:
            out.append(classify_workload(m, QUICK_CLASSIFY_SAMPLES if quick else CLASSIFY_SAMPLES))
        else:
            out += [denoise_workload(m, s, DENOISE_IMAGES) for s in sizes]
    return out


def _cuda_graph(module: Any, args: list[Any]) -> Any:
    """A replay of ``module(*args)`` captured as one CUDA graph (static inputs: the timing's own)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            module(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        module(*args)
    return graph.replay


def inprocess_times(w: Workload | None, device: str, batch: int, quick: bool,
                    timed_only: tuple[str, int] | None = None) -> list[dict]:
    """The same model in this process on ``device`` at batch 1 and ``batch`` (eager; on CUDA also a CUDA graph's
    replay); ``w=None``: ``timed_only``'s model (a model registered without weights, which the torch runtime serves
    not) with random weights at batch 1, at its side."""
    import torch

    if w is None:
        assert timed_only is not None
        name, side = timed_only
        card = get_spec(name).card
        model = unroll.load(name, pretrained=False)
        feeds = {card.input.name: np.random.default_rng(0).random((1, card.input.shape[0], side, side), np.float32)}
        label, note = f"{side}×{side}", "not served: no committed weights (random init), in-process only"
    else:
        name, label, note = w.model, w.label, ""
        card = get_spec(name).card
        model = unroll.load(name)
        feeds = w.arrays[0]
    model = model.to(device).eval()
    rows = []
    for b in sorted({1, batch}):
        args = [torch.from_numpy(np.repeat(feeds[k], b, axis=0).reshape(b, *feeds[k].shape[1:])).to(device)
                for k in card.input_names if k in feeds]
        with torch.inference_mode():
            runs = {"eager": lambda args=args: model(*args)}
            if device == "cuda":
                try:
                    runs["cuda-graph"] = _cuda_graph(model, args)
                except RuntimeError as e:
                    rows.append({"model": name, "label": label, "batch": b, "mode": "cuda-graph",
                                 "error": str(e).splitlines()[0]})
            for mode, run in runs.items():
                t = time_runner(run, device, 3 if quick else 20, 30 if quick else 300, 0.5 if quick else 2.0)
                rows.append({"model": name, "label": label, "batch": b, "mode": mode, "note": note, **t,
                             "images_per_s": b * 1e3 / t["p50_ms"]})
    return rows


def parity_rows(triton: TritonHttp, models: tuple[str, ...], quick: bool) -> list[dict]:
    """Each model's gate cases (``gpu_check``'s: the card's gate data) through Triton direct, against the CPU FP32
    model within the card's FP32 tolerance."""
    rows = []
    for case in build_cases(list(models), quick=quick):
        card = get_spec(case.model).card
        names = [card.input.name, *([card.sigma.input] if card.sigma is not None else [])]
        feeds = {k: as_batch(a.numpy()) for k, a in zip(names, case.args, strict=False)}
        limit = int(triton.config(case.model).get("max_batch_size") or case.batch) or case.batch
        chunks = [triton.infer(case.model, {k: v[i:i + limit] for k, v in feeds.items()}, [card.output])[card.output]
                  for i in range(0, case.batch, limit)]
        out = np.concatenate(chunks).reshape(case.reference.shape)
        metrics = parity(case, out)
        tol, source = tolerance_for(case, "fp32")
        bad = gate_check(metrics, tol)
        rows.append({"model": case.model, "label": case.label, "batch": case.batch, "note": case.note,
                     "metrics": metrics, "tolerance": tol, "tolerance_source": source, "passed": not bad,
                     "violations": bad})
    return rows
