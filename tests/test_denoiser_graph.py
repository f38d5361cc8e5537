"""The denoiser's exported graph (issue 16) and the per-model CPU runtimes (serving/cpu_runtime.py).

The synthesis convolutions (codes → 4 polyphase channels) are exported in taps form (a 1×1 convolution to the
4·k² tap products, then shifted sums), because CPU convolutions run a 4-channel output far below their peak; the
graph must keep no such narrow ``Conv`` and still match PyTorch on a real image. Both CPU runtimes must
give the same outputs on the same graph.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

import unroll
from unroll import data
from unroll.errors import RuntimeUnavailable
from unroll.registry import get_spec
from unroll.serving import runtimes
from unroll.serving.runtimes import open_session
from unroll.solvers.shrink import textbook_mode

DENOISER, CLASSIFIER = "csc-denoiser", "sdnet-mnist"
MAX_ABS_ERR = 1e-4  # the export's parity tolerance (unroll.export.onnx_export.MAX_ABS_ERR)
#: ONNX Runtime's NCHWc block on AVX-512 (8 on AVX2): a Conv with fewer output channels is padded up to it.
NCHWC_BLOCK = 16
OPENVINO = pytest.mark.skipif(not runtimes.available("openvino"),
                              reason="openvino not installed (pip install openvino)")


def _real_noisy(sigma255: float = 25.0, size: tuple[int, int] = (131, 150)) -> dict[str, np.ndarray]:
    """The denoiser card's first test image, cropped to an odd, non-square size, with seeded noise."""
    card = get_spec(DENOISER).card
    image_name, img = next(iter(data.dataset(card.data.test).load().items()))
    img = np.ascontiguousarray(img[: size[0], : size[1]], dtype=np.float32)
    noisy = data.add_noise(img, sigma255, data.noise_seed(image_name, sigma255)).astype(np.float32)
    return {card.input.name: noisy[None, None], card.sigma.input: np.array([sigma255 / card.sigma.scale], np.float32)}


def _conv_out_channels(model: onnx.ModelProto) -> dict[str, list[int]]:
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    out: dict[str, list[int]] = {"Conv": [], "ConvTranspose": []}
    for n in model.graph.node:
        if n.op_type in out:
            w = inits[n.input[1]]
            # Conv weight [out, in, k, k]; ConvTranspose weight [in, out, k, k] (group 1)
            out[n.op_type].append(int(w.shape[0] if n.op_type == "Conv" else w.shape[1]))
    return out


@pytest.fixture(scope="module")
def denoiser_graph(demo_onnx_dir: Path) -> Path:
    return demo_onnx_dir / f"{DENOISER}.onnx"


def test_synthesis_is_in_taps_form_and_no_narrow_conv_is_left(denoiser_graph: Path) -> None:
    model = onnx.load(str(denoiser_graph))
    channels = _conv_out_channels(model)
    net = unroll.load(DENOISER)
    taps = 4 * net.kernel_size ** 2
    # every synthesis (n_steps − 1 inside the loop, plus the decoder) writes the 4 phases' tap products
    assert channels["ConvTranspose"] == []
    assert sorted(channels["Conv"]) == sorted([net.num_atoms] * net.n_steps + [taps] * net.n_steps)
    assert min(channels["Conv"]) >= NCHWC_BLOCK


def test_graph_matches_pytorch_on_a_real_image(denoiser_graph: Path) -> None:
    feeds = _real_noisy()
    got = open_session(denoiser_graph, "onnxruntime")(feeds)["denoised"]
    with torch.inference_mode():
        ref = unroll.load(DENOISER)(*(torch.from_numpy(v) for v in feeds.values())).numpy()
    assert got.shape == ref.shape == feeds["noisy"].shape
    assert np.abs(got - ref).max() <= MAX_ABS_ERR
    # and it really denoises (not a trivially equal pair of broken outputs)
    clean = next(iter(data.dataset(get_spec(DENOISER).card.data.test).load().values()))[:131, :150]
    assert np.abs(got[0, 0] - clean).mean() < 0.7 * np.abs(feeds["noisy"][0, 0] - clean).mean()


def test_pytorch_and_textbook_export_keep_conv2d(tmp_path: Path) -> None:
    """Only the fused export swaps in the taps form: the textbook ("naive") export keeps the plain 3×3 synthesis
    convolutions (4 output channels each)."""
    from unroll.export.onnx_export import _torch_export

    net = unroll.load(DENOISER)
    x, s = torch.rand(1, 1, 32, 32), torch.tensor([0.1])
    path = str(tmp_path / "textbook.onnx")
    with textbook_mode():
        _torch_export(net, (x, s), path, ["noisy", "sigma"], ["denoised"], {}, 17)
    channels = _conv_out_channels(onnx.load(path))
    assert channels["ConvTranspose"] == [] and channels["Conv"].count(4) == net.n_steps


def test_onnxruntime_session_api(denoiser_graph: Path) -> None:
    run = open_session(denoiser_graph, "onnxruntime", threads=1)
    out = run(_real_noisy(size=(40, 33)))
    assert list(out) == ["denoised"] and out["denoised"].shape == (1, 1, 40, 33) and run.runtime == "onnxruntime"
    with pytest.raises(RuntimeUnavailable, match="unknown CPU runtime 'tensorflow'"):
        open_session(denoiser_graph, "tensorflow")
    with pytest.raises(ValueError, match="threads"):
        open_session(denoiser_graph, "onnxruntime", threads=0)


@OPENVINO
def test_openvino_agrees_with_onnxruntime_on_a_real_image(denoiser_graph: Path) -> None:
    feeds = _real_noisy()
    ort_out = open_session(denoiser_graph, "onnxruntime")(feeds)
    ov = open_session(denoiser_graph, "openvino")
    ov_out = ov(feeds)
    assert list(ov_out) == list(ort_out) == ["denoised"] and ov.runtime == "openvino"
    # FP32 inference precision is forced: OpenVINO's bfloat16 default on AVX-512 BF16 CPUs is off by ~5e-3
    assert np.abs(ov_out["denoised"] - ort_out["denoised"]).max() <= 1e-5
    # another shape and batch on the same compiled model (dynamic H, W and batch)
    two = {k: np.concatenate([v, v[..., ::-1, :].copy()]) if v.ndim == 4 else np.concatenate([v, v * 2])
           for k, v in _real_noisy(size=(64, 80)).items()}
    np.testing.assert_allclose(ov(two)["denoised"], open_session(denoiser_graph, "onnxruntime")(two)["denoised"],
                               atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="unknown input"):
        ov({**feeds, "bogus": feeds["sigma"]})


@OPENVINO
def test_openvino_agrees_on_a_real_digit(demo_onnx_dir: Path) -> None:
    from unroll.benchmarks.models_inputs import case_inputs, lam_default

    feeds = {k: v.numpy() for k, v in case_inputs(CLASSIFIER, 4, lam_default(CLASSIFIER, demo_onnx_dir)).items()}
    path = demo_onnx_dir / f"{CLASSIFIER}.onnx"
    a, b = open_session(path, "onnxruntime")(feeds), open_session(path, "openvino")(feeds)
    assert list(a) == list(b) == ["logits", "solver_fit"]  # the solver's signals too (card.ood)
    for k in a:
        np.testing.assert_allclose(b[k], a[k], atol=1e-4, rtol=0)
    assert (b["logits"].argmax(1) == a["logits"].argmax(1)).all()


def test_benchmark_tables_name_a_missing_openvino(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without OpenVINO the benchmark cells say so (and the fastest runtime is ONNX Runtime)."""
    from unroll.benchmarks import export_speed, models_markdown

    monkeypatch.setattr(runtimes, "available", lambda runtime: runtime == "onnxruntime")
    why = runtimes.unavailable_reason("openvino")
    assert why == "openvino not installed (pip install openvino)"
    with pytest.raises(RuntimeUnavailable, match="openvino not installed"):
        open_session("unused.onnx", "openvino")
    t = {"median_ms": 10.0}
    row = {"model": DENOISER, "case": "256×256", "timings": {"pytorch eager": {"median_ms": 20.0},
                                                              "onnxruntime fused": t, "onnxruntime naive": t},
           "skipped": {"openvino fused": f"skipped: {why}"}}
    row["speedup_vs_eager"] = {k: 20.0 / v["median_ms"] for k, v in row["timings"].items()}
    assert export_speed.fastest(row) == "onnxruntime"
    md = export_speed.markdown({"machine": {"cpu": "x", "threads_used": 2, "versions": {}}, "rows": [row]})
    assert f"| 10.00 (2.00×) | skipped: {why} | onnxruntime | - | yes | - |" in md
    assert models_markdown._cell(None, None, f"skipped: {why}") == f"skipped: {why}"
    assert models_markdown._cell(None, None, "export failed: boom") == "-"


@OPENVINO
def test_openvino_static_shapes_match_the_dynamic_graph(denoiser_graph: Path) -> None:
    """One static-shape model per input shape (what the denoiser's card serves) gives the dynamic graph's outputs,
    on a real image at two sizes and a batch of two σ."""
    dynamic = open_session(denoiser_graph, "openvino")
    static = open_session(denoiser_graph, "openvino", static_shapes=True)
    for size in ((131, 150), (64, 64)):
        feeds = _real_noisy(size=size)
        np.testing.assert_allclose(static(feeds)["denoised"], dynamic(feeds)["denoised"], atol=1e-5)
    two = _real_noisy(size=(64, 64))
    two = {"noisy": np.concatenate([two["noisy"]] * 2), "sigma": np.array([10 / 255, 40 / 255], np.float32)}
    out = static(two)["denoised"]
    np.testing.assert_allclose(out, dynamic(two)["denoised"], atol=1e-5)
    assert not np.allclose(out[0], out[1])  # each item its own σ

