"""The torch runtime's GPU paths (issue 37, item 1), each in the part that runs without a GPU: the batch sizes whose
CUDA graphs are captured at load and the padding of smaller batches (the capture itself is CUDA's: here a replay on
the same static buffers runs the real module), half precision behind the card's fp16 gate (bfloat16 on the CPU, on
the real models), and the Python backend's DLPack path through the real tritonserver (answers identical to the
NumPy path)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

import unroll
from unroll.card import from_onnx, write_to_onnx
from unroll.data import mnist_split
from unroll.serving import torch_runtime
from unroll.serving.runtimes import open_session
from unroll.serving.torch_runtime import _Graphs, _outputs, capture_sizes, padded_batch, parity_feeds

CLASSIFIER, DENOISER = "sdnet-mnist", "csc-denoiser"


def test_the_captured_batch_sizes_come_from_the_config_and_a_batch_pads_up_to_the_next() -> None:
    assert capture_sizes(32) == [1, 32]
    assert capture_sizes(32, [4, 8, 8, 64, 0]) == [1, 4, 8, 32]  # outside 1..max dropped
    assert capture_sizes(0, [1, 2]) == []  # no batching: nothing to pad, each shape as it comes
    sizes = capture_sizes(16, [1, 2, 4, 8, 16])
    assert [padded_batch(n, sizes) for n in range(1, 17)] == [1, 2, 4, 4, 8, 8, 8, 8] + [16] * 8
    assert padded_batch(17, sizes) == 17 and padded_batch(3, []) == 3  # past the max: its own size


class _Replays:
    """:class:`_Graphs`'s capture without CUDA: the replay runs the real module on the same static input buffers,
    answering fresh outputs each time (CUDA's answer the same static tensors; both are sliced and cloned)."""

    def __init__(self, call) -> None:
        self.call, self.captured = call, []

    def __call__(self, static_in: list[torch.Tensor]):
        self.captured.append([tuple(a.shape) for a in static_in])
        return lambda: self.call(*static_in)


def test_graphs_captured_at_load_serve_every_smaller_batch_padded_and_sliced(demo_onnx_dir: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    card = from_onnx(demo_onnx_dir / f"{CLASSIFIER}.onnx")
    ins = card.input_names
    call = _outputs(unroll.load(CLASSIFIER), card)
    capture = _Replays(call)
    sizes = capture_sizes(8, [1, 2, 4, 8])
    graphs = _Graphs(capture, sizes, call, torch.device("cpu"))
    with torch.inference_mode():
        for b in sizes:  # what torch_session does at load for a card with a fixed input shape
            feeds = parity_feeds(card, ins, b)
            graphs.prepare([torch.from_numpy(feeds[k]) for k in ins])
        assert [c[0][0] for c in capture.captured] == sizes
        _, _, x, _ = mnist_split()
        lam = np.full(len(x), card.lam.default, np.float32)
        a, b = torch.from_numpy(x[:8]), torch.from_numpy(lam[:8])
        graphs.run([a, b])  # fills every row of the size-8 buffers
        for n in range(1, 9):  # 3, 5, 6, 7 run padded (to 4, 8, 8, 8) over the rows of the previous call
            rows = [torch.from_numpy(x[8 + n:8 + 2 * n]), torch.from_numpy(lam[:n])]
            got = graphs.run(rows)
            want = call(*rows)
            assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in want]
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        assert len(capture.captured) == len(sizes)  # steady state: no capture
        # the fallback: a batch past the max, and a shape never met, are captured on first use (at their own size)
        graphs.run([torch.from_numpy(x[:9]), torch.from_numpy(lam[:9])])
        assert capture.captured[-1][0] == (9, 1, 28, 28)
        monkeypatch.setattr(torch_runtime, "MAX_GRAPHS", 1)
        graphs.run([torch.from_numpy(x[:3, :, :20, :20]).contiguous(), torch.from_numpy(lam[:3])])
        assert capture.captured[-1][0] == (4, 1, 20, 20)  # lazily captured at the padded size
        assert len(graphs._cache) == len(sizes) + 1  # the lazy one before it dropped; the load-time ones stay
        before = len(capture.captured)
        graphs.run([torch.from_numpy(x[:5]), torch.from_numpy(lam[:5])])
        assert len(capture.captured) == before


def _with_card(src: Path, out: Path, **update) -> Path:
    import onnx

    graph = onnx.load(src)
    write_to_onnx(graph, from_onnx(graph).model_copy(update=update))
    onnx.save(graph, out)
    return out


def test_half_precision_serves_only_behind_the_cards_fp16_gate(demo_onnx_dir: Path, tmp_path: Path) -> None:
    """bfloat16 on the CPU (float16 on a GPU, the same gate): the digit classifier passes its card's fp16 gate on its
    gate data and serves bfloat16; with a tolerance no half precision meets (through the card's ``gates``) it is
    refused with the reason and FP32 serves, answering exactly as the FP32 session."""
    graph = demo_onnx_dir / f"{CLASSIFIER}.onnx"
    _, _, x, _ = mnist_split()
    card = from_onnx(graph)
    feeds = {"image": x[:16], "lam": np.full(16, card.lam.default, np.float32)}
    fp32 = open_session(graph, "torch", 2)
    assert fp32.precision == "fp32" and fp32.precision_note is None
    half = open_session(graph, "torch", 2, bf16=True)
    assert half.precision == "bf16", half.precision_note
    assert "passed the card's fp16 gate on card.data.validation" in half.precision_note
    assert "top1_agreement" in half.precision_note
    got, want = half(feeds)["logits"], fp32(feeds)["logits"]
    assert not np.array_equal(got, want)  # bfloat16 maths, not FP32
    np.testing.assert_array_equal(got.argmax(1), want.argmax(1))
    np.testing.assert_allclose(got, want, atol=0.1 * np.abs(want).max())

    strict = _with_card(graph, tmp_path / f"{CLASSIFIER}.onnx", gates={**card.gates, "fp16": {"rel_err": 1e-9}})
    refused = open_session(strict, "torch", 2, bf16=True)
    assert refused.precision == "fp32"
    note = refused.precision_note
    assert "bfloat16 asked for on cpu" in note and "refused" in note and "rel_err" in note, note
    assert note.endswith("serving FP32")
    for name, a in refused(feeds).items():
        np.testing.assert_array_equal(a, fp32(feeds)[name])


def test_the_torch_runtimes_precision_and_batch_sizes_in_the_gpu_configs(demo_onnx_dir: Path,
                                                                        tmp_path: Path) -> None:
    """``--precision fp16`` on the GPU target: the module's, from the FP32 graph (no NAME.fp16.onnx); the preferred
    batch sizes are the ones captured at load; inputs stay where Triton holds them. A model with no PyTorch module
    serves its graph in FP32 and says so. INT8, or FP16 on the CPU target, is refused."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    from unroll.serving.repository import TORCH_NOTE_KEY, RepositoryError, write_repository

    rule = from_onnx(demo_onnx_dir / f"{CLASSIFIER}.onnx").lam.auto
    repo = tmp_path / "repo"
    write_repository("gpu", [CLASSIFIER, rule], repo, precision="fp16", onnx_dir=demo_onnx_dir, runtime="torch",
                     plan_dir=tmp_path / "no-plans", max_batch_size=24)

    def config(name: str) -> tuple[mc.ModelConfig, str]:
        text = (repo / name / "config.pbtxt").read_text()
        lines = "\n".join(ln for ln in text.splitlines() if not ln.startswith("#"))
        return text_format.Parse(lines, mc.ModelConfig()), text

    cfg, text = config(CLASSIFIER)
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert params["inference_precision"] == "fp16" and params["FORCE_CPU_ONLY_INPUT_TENSORS"] == "no"
    assert list(cfg.dynamic_batching.preferred_batch_size) == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(cfg.max_batch_size, list(cfg.dynamic_batching.preferred_batch_size)) == [1, 2, 4, 8, 16, 24]
    assert "card's fp16 gate" in text and "--precision fp16" in text
    assert params["unroll_source_onnx"] == f"{CLASSIFIER}.onnx"
    cfg, _ = config(rule)
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert params["inference_precision"] == "f32" and "in FP32" in params[TORCH_NOTE_KEY]
    assert "FORCE_CPU_ONLY_INPUT_TENSORS" not in params and not cfg.dynamic_batching.preferred_batch_size
    with pytest.raises(RepositoryError, match="FP32, or in half precision"):
        write_repository("gpu", [CLASSIFIER], repo, precision="int8", onnx_dir=demo_onnx_dir, runtime="torch")
    with pytest.raises(RepositoryError, match="on the cpu target"):
        write_repository("cpu", [CLASSIFIER], repo, precision="fp16", onnx_dir=demo_onnx_dir, runtime="torch")


@pytest.mark.triton
def test_through_the_real_tritonserver_the_dlpack_path_answers_as_the_numpy_path(demo_onnx_dir: Path,
                                                                                 tmp_path: Path) -> None:
    """The torch runtime's tensors cross the Python backend by DLPack (PyTorch tensors in and out, joined by the
    dynamic batcher as tensors): each answer is the in-process session's NumPy answer, bit for bit; the digit
    classifier in bfloat16 behind its gate (passed, said in Triton's log), the denoiser in FP32."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    from unroll.serving.repository import write_repository
    from unroll.serving.triton import free_ports, start

    repo = tmp_path / "repo"
    write_repository("cpu", [DENOISER], repo, onnx_dir=demo_onnx_dir, runtime="torch")
    write_repository("cpu", [CLASSIFIER], repo, onnx_dir=demo_onnx_dir, runtime="torch", bf16=True)
    assert 'string_value: "bf16"' in (repo / CLASSIFIER / "config.pbtxt").read_text()
    classify = open_session(demo_onnx_dir / f"{CLASSIFIER}.onnx", "torch", 2, bf16=True)
    denoise = open_session(demo_onnx_dir / f"{DENOISER}.onnx", "torch", 2)
    card = from_onnx(demo_onnx_dir / f"{CLASSIFIER}.onnx")
    _, _, x, _ = mnist_split()
    rng = np.random.default_rng(3)

    def inputs(feeds: dict[str, np.ndarray]) -> list:
        ins = []
        for name, a in feeds.items():
            a = a.reshape(len(a), 1) if a.ndim == 1 else a  # [B] graph inputs are dims [1] in the config
            t = httpclient.InferInput(name, list(a.shape), "FP32")
            t.set_data_from_numpy(np.ascontiguousarray(a))
            ins.append(t)
        return ins

    def infer(client, model: str, feeds: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        res = client.infer(model, inputs(feeds), outputs=[httpclient.InferRequestedOutput(o) for o in outputs])
        return {o: res.as_numpy(o) for o in outputs}

    log = tmp_path / "triton.log"
    with start(repo, *free_ports(3), log_file=log, timeout_s=180, extra_args=["--exit-timeout-secs=2"]) as triton:
        client = httpclient.InferenceServerClient(triton.url, concurrency=8)
        outs = card.output_names
        for n in (1, 3, 8):  # one request at a time: each runs as sent
            feeds = {"image": x[n:2 * n], "lam": np.full(n, card.lam.default, np.float32)}
            got = infer(client, CLASSIFIER, feeds, outs)
            want = classify(feeds)
            for o in outs:
                np.testing.assert_array_equal(got[o].reshape(want[o].shape), want[o])
        lam_only = infer(client, CLASSIFIER, {"image": x[:2]}, outs)  # λ from the config's default, as a tensor
        want = classify({"image": x[:2], "lam": np.full(2, card.lam.default, np.float32)})
        np.testing.assert_array_equal(lam_only["logits"], want["logits"])
        noisy = rng.uniform(0, 1, (2, 1, 40, 48)).astype(np.float32)
        sigma = np.full(2, 25 / 255, np.float32)
        got = infer(client, DENOISER, {"noisy": noisy, "sigma": sigma}, ["denoised"])["denoised"]
        np.testing.assert_array_equal(got, denoise({"noisy": noisy, "sigma": sigma})["denoised"])
        # a burst while tritonserver is paused (as tests/test_triton.py's): on SIGCONT every request is queued at
        # once and the dynamic batcher joins them: tensors joined on the device and split back in the backend
        before = _batch_counts(client)
        singles = [{"image": x[i:i + 1], "lam": np.full(1, card.lam.default, np.float32)} for i in range(24)]
        answers = _burst(triton, grpcclient, CLASSIFIER, singles)
        joined = classify({"image": x[:24], "lam": np.full(24, card.lam.default, np.float32)})["logits"]
        np.testing.assert_allclose(answers, joined, rtol=1e-2, atol=1e-2)  # bfloat16, whatever the grouping
        np.testing.assert_array_equal(answers.argmax(1), joined.argmax(1))
        deadline = time.monotonic() + 10  # statistics are recorded just after the responses: read until settled
        while True:
            grown = {b: c - before.get(b, 0) for b, c in _batch_counts(client).items() if c > before.get(b, 0)}
            if sum(b * c for b, c in grown.items()) >= len(singles) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert max(grown) > 1, grown  # requests were joined
        client.close()
    text = log.read_text()
    assert f"{CLASSIFIER}: bfloat16 asked for on cpu; passed the card's fp16 gate" in text, text[-3000:]


def _batch_counts(client) -> dict[int, int]:
    stats = client.get_inference_statistics(CLASSIFIER)["model_stats"][0]
    return {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats["batch_stats"]}


def _burst(triton, grpcclient, model: str, feeds: list[dict[str, np.ndarray]]) -> np.ndarray:
    """``feeds`` sent at once over gRPC while tritonserver is paused (:func:`served.paused_burst`); the logits."""
    from served import paused_burst

    requests = []
    for f in feeds:
        ins = []
        for name, a in f.items():
            a = a.reshape(len(a), 1) if a.ndim == 1 else a
            t = grpcclient.InferInput(name, list(a.shape), "FP32")
            t.set_data_from_numpy(np.ascontiguousarray(a))
            ins.append(t)
        requests.append(ins)
    clients = [grpcclient.InferenceServerClient(triton.grpc_url) for _ in range(4)]
    try:
        return np.concatenate(paused_burst(triton.pid, clients, model, requests, "logits"))
    finally:
        for c in clients:
            c.close()
