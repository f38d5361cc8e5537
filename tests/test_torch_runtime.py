"""The ``torch`` runtime (issue 37, its CPU half): the registered PyTorch module behind a served graph, in Triton's
Python backend — on the CPU here, the same code that a ``KIND_GPU`` instance runs on ``cuda:N``. It stands in for a
graph only after answering as the graph does; what has no PyTorch module, or another one, is refused by name."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import unroll
from unroll.card import from_onnx, write_to_onnx
from unroll.data import mnist_split
from unroll.errors import RuntimeUnavailable
from unroll.serving.runtimes import open_session
from unroll.serving.torch_runtime import parity_feeds

CLASSIFIER, DENOISER = "sdnet-mnist", "csc-denoiser"


def test_the_module_answers_as_the_graph_and_as_pytorch(demo_onnx_dir: Path) -> None:
    _, _, x, _ = mnist_split()
    run = open_session(demo_onnx_dir / f"{CLASSIFIER}.onnx", "torch", 2)
    assert run.runtime == "torch" and run.device == "cpu" and run.inputs == {"image": [None, 1, 28, 28], "lam": [None]}
    card = from_onnx(demo_onnx_dir / f"{CLASSIFIER}.onnx")
    lam = np.full(8, card.lam.default, np.float32)
    got = run({"image": x[:8], "lam": lam})["logits"]
    with torch.inference_mode():
        want = unroll.load(CLASSIFIER)(torch.from_numpy(x[:8]), torch.from_numpy(lam)).numpy()
    np.testing.assert_array_equal(got, want)  # the module itself, not an approximation of it
    denoise = open_session(demo_onnx_dir / f"{DENOISER}.onnx", "torch", 2)
    feeds = parity_feeds(from_onnx(demo_onnx_dir / f"{DENOISER}.onnx"), ["noisy", "sigma"])
    assert denoise(feeds)["denoised"].shape == feeds["noisy"].shape


def test_an_iteration_companion_runs_its_model_with_its_count_and_a_lambda_rule_is_refused(demo_onnx_dir: Path
                                                                                          ) -> None:
    companions = sorted(p.name for p in demo_onnx_dir.glob(f"{CLASSIFIER}-iters*.onnx"))
    assert companions, sorted(p.name for p in demo_onnx_dir.iterdir())
    open_session(demo_onnx_dir / companions[0], "torch", 2)  # its parity with its own graph is checked on opening
    rule = from_onnx(demo_onnx_dir / f"{CLASSIFIER}.onnx").lam.auto
    with pytest.raises(RuntimeUnavailable, match="companion, a graph of its own"):
        open_session(demo_onnx_dir / f"{rule}.onnx", "torch", 2)


def test_a_graph_from_other_weights_or_without_pytorch_code_is_refused_not_served_by_another(
        demo_onnx_dir: Path, tmp_path: Path) -> None:
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(demo_onnx_dir / f"{CLASSIFIER}.onnx")  # the same card, weights changed: a retrained model
    init = max(graph.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * 1.5, init.name))
    onnx.save(graph, tmp_path / "retrained.onnx")
    with pytest.raises(RuntimeUnavailable, match="does not answer as the served graph"):
        open_session(tmp_path / "retrained.onnx", "torch", 2)
    renamed = tmp_path / "third-party.onnx"  # a graph whose card names no registered model
    graph = onnx.load(demo_onnx_dir / f"{CLASSIFIER}.onnx")
    write_to_onnx(graph, from_onnx(graph).model_copy(update={"name": "someones-digits"}))
    onnx.save(graph, renamed)
    with pytest.raises(RuntimeUnavailable, match="someones-digits has no PyTorch code here"):
        open_session(renamed, "torch", 2)
    with pytest.raises(ValueError, match="takes the torch runtime"):
        open_session(demo_onnx_dir / f"{CLASSIFIER}.onnx", "onnxruntime", 2, device="cuda:0")


@pytest.mark.triton
def test_served_by_the_real_tritonserver_it_answers_as_pytorch(demo_onnx_dir: Path, tmp_path: Path) -> None:
    from served import check_topk, gateway_over_triton, softmax

    from unroll.serving.repository import write_repository

    repo = tmp_path / "repo"
    card = from_onnx(demo_onnx_dir / f"{CLASSIFIER}.onnx")
    write_repository("cpu", [CLASSIFIER, DENOISER, card.lam.auto], repo, onnx_dir=demo_onnx_dir, runtime="torch")
    assert 'string_value: "torch"' in (repo / CLASSIFIER / "config.pbtxt").read_text()
    rule = (repo / card.lam.auto / "config.pbtxt").read_text()  # the λ rule has no module: its card's runtime, said
    assert 'string_value: "torch"' not in rule and "# torch was asked for; onnxruntime serves it" in rule, rule[:800]
    _, _, x, _ = mnist_split()
    model = unroll.load(CLASSIFIER)
    with gateway_over_triton(repo, tmp_path) as client:
        models = {m["name"]: m for m in client.get("/v1/models").json()["models"]}
        assert models[CLASSIFIER]["runtime"] == models[DENOISER]["runtime"] == "torch"
        for i in range(4):
            buf = io.BytesIO()
            Image.fromarray(np.rint(x[i, 0] * 255).astype(np.uint8)).save(buf, "PNG")
            r = client.post(f"/v1/classify?model={CLASSIFIER}&top_k=3", content=buf.getvalue(),
                            headers={"Content-Type": "image/png"})
            assert r.status_code == 200, r.text
            pixels = np.rint(x[i:i + 1] * 255) / 255  # what the PNG carries
            with torch.inference_mode():
                logits = model(torch.from_numpy(pixels.astype(np.float32)),
                               torch.full((1,), card.lam.default)).numpy()[0]
            check_topk(r.json(), softmax(logits), 3, card.labels)
        crop = (np.random.default_rng(1).uniform(0, 1, (48, 48)) * 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(crop).save(buf, "PNG")
        r = client.post(f"/v1/denoise?model={DENOISER}&sigma=25", content=buf.getvalue(),
                        headers={"Content-Type": "image/png", "Accept": "image/png"})
        assert r.status_code == 200, r.text
        assert Image.open(io.BytesIO(r.content)).size == (48, 48)


def test_gpu_configs_for_the_bundled_triton_run_the_module_on_the_gpu_and_say_what_cannot(
        demo_onnx_dir: Path, tmp_path: Path) -> None:
    """``unroll repo --target gpu --runtime torch``: KIND_GPU Python-backend instances running the module, with the
    encoded-image inputs and the optional λ of the CPU configs; a λ rule (no PyTorch module) is served on the CPU by
    its card's runtime, and its config and the CLI's table say so. No INT8; no TensorRT plan is looked for."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc
    from typer.testing import CliRunner

    from unroll.app.cli import app
    from unroll.serving.repository import TORCH_NOTE_KEY, RepositoryError, write_repository

    rule = from_onnx(demo_onnx_dir / f"{CLASSIFIER}.onnx").lam.auto
    repo = tmp_path / "repo"
    write_repository("gpu", [CLASSIFIER, rule], repo, onnx_dir=demo_onnx_dir, runtime="torch",
                     plan_dir=tmp_path / "no-plans")

    def config(name: str) -> mc.ModelConfig:
        text = (repo / name / "config.pbtxt").read_text()
        return text_format.Parse("\n".join(ln for ln in text.splitlines() if not ln.startswith("#")), mc.ModelConfig())

    cfg = config(CLASSIFIER)
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert cfg.backend == "python" and cfg.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU
    assert params["cpu_runtime"] == "torch" and TORCH_NOTE_KEY not in params and "unroll.profile" not in params
    assert {"image_bytes", "invert"} <= {i.name for i in cfg.input} and any(i.optional for i in cfg.input
                                                                              if i.name == "lam")
    assert "--runtime torch" in (repo / CLASSIFIER / "config.pbtxt").read_text()
    cfg = config(rule)
    assert cfg.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
    note = cfg.parameters[TORCH_NOTE_KEY].string_value
    assert "on the CPU" in note and "companion" in note and note in (repo / rule / "config.pbtxt").read_text()
    with pytest.raises(RepositoryError, match="FP32"):  # fp16 is the module's (tests/test_torch_runtime_gpu_paths.py)
        write_repository("gpu", [CLASSIFIER], repo, precision="int8", onnx_dir=demo_onnx_dir, runtime="torch")
    with pytest.raises(RepositoryError, match="CPU runtime"):
        write_repository("gpu", [CLASSIFIER], repo, onnx_dir=demo_onnx_dir, runtime="openvino")
    out = CliRunner().invoke(app, ["repo", "--target", "gpu", "--runtime", "openvino", "--models", CLASSIFIER,
                                   "--onnx-dir", str(demo_onnx_dir), "--out", str(tmp_path / "cli")])
    assert out.exit_code != 0 and "--target gpu takes torch" in out.output, out.output


def test_serve_on_a_gpu_says_how_each_model_runs_and_what_a_machine_without_cuda_lacks(demo_onnx_dir: Path) -> None:
    from unroll.app.serve import serve, served_as
    from unroll.errors import ServeError

    card = from_onnx(demo_onnx_dir / f"{CLASSIFIER}.onnx")
    shown = served_as([card, from_onnx(demo_onnx_dir / f"{card.lam.auto}.onnx")], "gpu")
    assert shown[CLASSIFIER].startswith("torch on the GPU")
    assert "on the CPU" in shown[card.lam.auto] and "companion" in shown[card.lam.auto]
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: `unroll serve --target gpu` would start (scripts/gpu_serve_check.sh)")
    with pytest.raises(ServeError, match="PyTorch sees no CUDA device here") as e:
        serve(target="gpu", onnx_dir=demo_onnx_dir)
    assert "unroll doctor" in str(e.value) and "--triton-url" in str(e.value)
