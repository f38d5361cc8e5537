"""Iterations per request (``iters=K``): the card lists the counts, export writes one verified graph per count, and
the gateway routes a request to the graph of its count through a real tritonserver.

Each count's graph must compute what PyTorch computes with the solver layers unrolled to that count (and the counts
must differ from one another, or the dial would be a no-op); a count the card does not list is refused.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from readme_blocks import generated
from served import check_topk, png, softmax

import unroll
from unroll.card import IterCard, from_onnx
from unroll.data import mnist_split
from unroll.errors import IterationsError
from unroll.pipeline import graphs_of
from unroll.solvers.iterations import iteration_count, set_iterations

MODEL = "sdnet-mnist"


def test_iter_card_counts_and_names() -> None:
    card = IterCard(default=2, served=(8, 1, 4, 4))
    assert card.counts == (1, 2, 4, 8) and card.served == (1, 4, 8)
    assert card.graph("m", 2) == "m" and card.graph("m", 4) == "m-iters4"
    with pytest.raises(ValueError, match="at least 1"):
        IterCard(served=(0, 2))


def test_untied_solver_cannot_be_reunrolled() -> None:
    with pytest.raises(IterationsError, match="learned weights for each"):
        set_iterations(unroll.load("csc-denoiser"), 2)


def test_graphs_of_lists_one_sibling_per_other_count() -> None:
    assert graphs_of([MODEL]) == [MODEL, f"{MODEL}-autolam", f"{MODEL}-iters1", f"{MODEL}-iters4", f"{MODEL}-iters8"]
    assert graphs_of(["csc-denoiser"]) == ["csc-denoiser"]


def _torch_logits(k: int, x: np.ndarray, lam: float | None = None) -> np.ndarray:
    model = set_iterations(unroll.load(MODEL), k)
    with torch.no_grad():
        lam_t = None if lam is None else torch.full((len(x),), lam)
        return model(torch.from_numpy(x), lam_t).numpy()


def test_each_count_graph_matches_pytorch_with_that_many_iterations(demo_onnx_dir) -> None:
    _, _, x, _ = mnist_split()
    x = x[:16]
    main = from_onnx(demo_onnx_dir / f"{MODEL}.onnx")
    assert main.iters is not None and main.iters.default == iteration_count(unroll.load(MODEL)) == 2
    outputs = {}
    for k in main.iters.counts:
        graph = demo_onnx_dir / f"{main.iters.graph(MODEL, k)}.onnx"
        card = from_onnx(graph)
        assert card.iters.default == k and card.companion_of == (None if k == 2 else MODEL)
        sess = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
        got = sess.run(None, {"image": x, "lam": np.full(len(x), main.lam.default, np.float32)})[0]
        want = _torch_logits(k, x)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
        outputs[k] = got
    for a in outputs:  # the dial changes the answer
        for b in outputs:
            if a < b:
                assert np.abs(outputs[a] - outputs[b]).max() > 1e-3, (a, b)


@pytest.fixture(scope="module")
def gateway(demo_gateway):
    """The session's gateway and tritonserver: every graph the demo models' cards name, other iteration counts
    included."""
    return demo_gateway


def _digit(i: int) -> tuple[bytes, np.ndarray]:
    _, _, x, _ = mnist_split()
    pixels = np.rint(x[i, 0] * 255).astype(np.uint8)
    return png(pixels), (pixels.astype(np.float32) / 255.0)[None, None]


def test_gateway_routes_each_count_to_its_graph(gateway) -> None:
    catalog = gateway.get("/v1/models").json()
    listed = {m["name"]: m for m in catalog["models"]}
    assert listed[MODEL]["params"]["iters"] == "1 | 2 | 4 | 8 (trained: 2)"
    others = {m["name"]: m["reason"] for m in catalog["not_served"]}
    assert f"{MODEL}-iters4" not in listed and others[f"{MODEL}-iters4"].startswith(f"{MODEL}'s graph for iters=4")
    body, x = _digit(7)
    for k in (1, 2, 4, 8):
        r = gateway.post(f"/v1/classify?model={MODEL}&top_k=3&iters={k}", content=body,
                         headers={"Content-Type": "image/png"})
        assert r.status_code == 200, r.text
        assert r.json()["iters"] == k and r.json()["model"] == MODEL
        check_topk(r.json(), softmax(_torch_logits(k, x)[0]), 3, tuple(str(i) for i in range(10)))
    default = gateway.post(f"/v1/classify?model={MODEL}", content=body, headers={"Content-Type": "image/png"})
    assert default.json()["iters"] == 2
    r = gateway.post(f"/v1/classify?model={MODEL}&top_k=3&iters=4&lam=0.3", content=body,
                     headers={"Content-Type": "image/png"})
    assert r.status_code == 200 and r.json()["lam"] == pytest.approx(0.3)
    check_topk(r.json(), softmax(_torch_logits(4, x, 0.3)[0]), 3, tuple(str(i) for i in range(10)))
    r = gateway.post(f"/v1/classify?model={MODEL}&iters=8&lam=auto", content=body,
                     headers={"Content-Type": "image/png"})
    assert r.status_code == 200 and r.json()["iters"] == 8, r.text


@pytest.mark.parametrize(("query", "message"), [
    ("iters=3", "serves 1, 2, 4, 8 iterations (trained: 2; got 3)"),
    ("iters=0", "at least 1"),
    ("iters=two", "whole number"),
    ("iters=2%20", "digits 0-9 only"), ("iters=%2B2", "digits 0-9 only"), ("iters=%D9%A2", "digits 0-9 only"),
    ("iters=2_0", "digits 0-9 only"),
])
def test_gateway_refuses_a_count_the_card_does_not_list(gateway, query: str, message: str) -> None:
    body, _ = _digit(0)
    r = gateway.post(f"/v1/classify?model={MODEL}&{query}", content=body, headers={"Content-Type": "image/png"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_parameter"
    assert message in r.json()["error"]["message"]


def test_gateway_refuses_iters_for_a_model_without_them(gateway) -> None:
    noisy = np.random.default_rng(0).integers(0, 256, (32, 32), dtype=np.uint8)
    r = gateway.post("/v1/denoise?model=csc-denoiser&sigma=25&iters=2", content=png(noisy),
                     headers={"Content-Type": "image/png"})
    assert r.status_code == 422 and "serves one iteration count only" in r.json()["error"]["message"]
    r = gateway.post("/v1/denoise?model=csc-denoiser&sigma=25", content=png(noisy),
                     headers={"Content-Type": "image/png"})
    assert r.status_code == 200 and "X-Iters" not in r.headers


def test_bench_iters_measures_each_count_through_the_gateway(demo_onnx_dir, tmp_path) -> None:
    """`unroll bench iters` on a few digits: one row per served count, accuracy equal to PyTorch's at that count,
    requests answered through the gateway (none failed) with their CPU per request, and the files written."""
    from unroll.benchmarks import iterations

    payload = iterations.run([MODEL], ["gaussian_noise"], n_test=50, duration_s=1, onnx_dir=demo_onnx_dir,
                             out_dir=tmp_path)
    rows = payload["models"][MODEL]["counts"]
    assert [r["iters"] for r in rows] == [1, 2, 4, 8] and payload["models"][MODEL]["trained"] == 2
    _, _, x, y = mnist_split()
    for r in rows:
        want = float((_torch_logits(r["iters"], x[:50]).argmax(1) == y[:50]).mean())
        assert r["clean"] == pytest.approx(want)
        assert r["requests"] > 0 and r["latency_ms"]["p50"] > 0 and r["cpu_ms_per_request"]["gateway"] > 0
        assert r["client_cpu_ms_per_request"] > 0  # the load engine's own
    assert {p.name for p in tmp_path.iterdir()} >= {"iterations.json", "iterations.md", "iterations.png"}


def test_readme_quotes_the_committed_iteration_results() -> None:
    import json
    from pathlib import Path

    from unroll.benchmarks import iterations

    committed = Path(iterations.__file__).parent / "results" / "iterations.json"
    for block in generated(iterations.README_BEGIN, iterations.README_END):
        assert block == iterations.readme_block(json.loads(committed.read_text())).strip()
