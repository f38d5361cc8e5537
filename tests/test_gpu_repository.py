"""GPU-target Triton configs, checked here without a GPU, and served by the real gateway through a CPU stand-in.

* Precision lives in the graph: a ``--precision fp16`` GPU config serves ``NAME.fp16.onnx`` with
  ``precision_mode`` FP32 (ONNX Runtime's TensorRT provider then builds a strongly typed network), never the
  FP32 graph with ``precision_mode`` FP16 (weak typing, removed in TensorRT 11).
* Plans are cross-checked against the JSON ``unroll build`` writes beside them. Building a real plan needs an
  NVIDIA GPU and TensorRT, which this machine lacks, so these tests put a dummy plan file next to a JSON in the
  format of ``export/trt_build.py`` (profiles, max_batch_size, precision, passed, io, checksums); only the
  config logic is tested with them, nothing serves them.
* The served test writes the GPU configs with the test-only ``cpu_stand_in`` switch (same inputs, dims,
  ``max_batch_size``, no ``input_defaults``, the TensorRT profile, labels; the platform swapped for the Python
  backend running the same graph with ONNX Runtime, refusing inputs outside the profile as TensorRT does),
  starts the bundled tritonserver and the real gateway on them, and goes through the request path over HTTP.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import threading
from pathlib import Path

import httpx
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tritonclient.http as httpclient
from google.protobuf import text_format
from PIL import Image
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from unroll.card import from_onnx
from unroll.serving.gateway.errors import ApiError
from unroll.serving.gateway.triton_client import model_info
from unroll.serving.imaging import images
from unroll.serving.profile import PROFILE_KEY, ServedProfile
from unroll.serving.repository import RepositoryError, write_repository
from unroll.serving.repository_check import PLAN_JSON, validate_model, validate_repository

CLASSIFIER, RULE, DENOISER = "sdnet-mnist", "sdnet-mnist-autolam", "csc-denoiser"
DEMO = [CLASSIFIER, RULE, DENOISER]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _copy_exports(src: Path, dst: Path, names=DEMO) -> Path:
    """A private copy of the session's exports (tests add graphs and plans next to them)."""
    dst.mkdir(parents=True, exist_ok=True)
    for n in names:
        for suffix in (".onnx", ".report.json"):
            shutil.copyfile(src / f"{n}{suffix}", dst / f"{n}{suffix}")
    return dst


def _fp16_graph(onnx_dir: Path, name: str) -> Path:
    """A real FP16 graph (ONNX Runtime's float16 converter, I/O kept FP32, the card carried along, its
    out-of-distribution rule measured on its own outputs): what ``unroll quantize --precision fp16`` writes, without
    running its accuracy gate."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from unroll import gates
    from unroll.card import from_onnx, write_to_onnx
    from unroll.export.ood_calibration import recalibrate

    fp32 = onnx.load(str(onnx_dir / f"{name}.onnx"))
    m16 = convert_float_to_float16(fp32, keep_io_types=True)
    card = from_onnx(fp32)
    if card.ood is not None and card.ood.calibrated:
        card, _ = recalibrate(card, fp32, m16, gates.gate_cases(card), "fp16")
        write_to_onnx(m16, card)
    out = onnx_dir / f"{name}.fp16.onnx"
    onnx.save(m16, str(out))
    return out


def _cfg(model_dir: Path) -> mc.ModelConfig:
    return text_format.Parse((model_dir / "config.pbtxt").read_text(), mc.ModelConfig())


def _profile(cfg: mc.ModelConfig) -> ServedProfile:
    return ServedProfile.from_json(cfg.parameters[PROFILE_KEY].string_value)


# ---------------------------------------------------------------- precision: in the graph, strongly typed


def test_gpu_fp16_config_serves_the_fp16_graph_strongly_typed(demo_onnx_dir: Path, tmp_path: Path) -> None:
    onnx_dir = _copy_exports(demo_onnx_dir, tmp_path / "onnx", [CLASSIFIER, DENOISER])
    with pytest.raises(RepositoryError, match=f"unroll quantize {DENOISER} --precision fp16"):
        write_repository("gpu", [DENOISER], tmp_path / "none", precision="fp16", onnx_dir=onnx_dir)
    with pytest.raises(RepositoryError, match=f"unroll quantize {CLASSIFIER} --precision int8"):
        write_repository("gpu", [CLASSIFIER], tmp_path / "none", precision="int8", onnx_dir=onnx_dir)

    fp16 = {n: _fp16_graph(onnx_dir, n) for n in (CLASSIFIER, DENOISER)}
    out = tmp_path / "gpu16"
    write_repository("gpu", [CLASSIFIER, DENOISER], out, precision="fp16", onnx_dir=onnx_dir)
    for name, graph in fp16.items():
        served = out / name / "1" / "model.onnx"
        assert served.read_bytes() == graph.read_bytes()  # the FP16 graph, not the FP32 one cast by TensorRT
        assert any(i.data_type == onnx.TensorProto.FLOAT16 for i in onnx.load(str(served)).graph.initializer)
        cfg = _cfg(out / name)
        assert cfg.platform == "onnxruntime_onnx" and cfg.parameters["unroll_source_onnx"].string_value == graph.name
        acc = cfg.optimization.execution_accelerators.gpu_execution_accelerator[0]
        # FP32 = neither trt_fp16_enable nor trt_int8_enable: ORT's TensorRT provider builds strongly typed
        assert acc.name == "tensorrt" and acc.parameters["precision_mode"] == "FP32"
        assert f"model.onnx is {graph.name}" in (out / name / "config.pbtxt").read_text()  # the header says so
    assert validate_repository(out).keys() == {CLASSIFIER, DENOISER}

    # the old config (FP32 graph, TensorRT asked to cast it to FP16: weakly typed) no longer validates
    text = (out / DENOISER / "config.pbtxt").read_text()
    (out / DENOISER / "config.pbtxt").write_text(text.replace('value: "FP32"', 'value: "FP16"', 1))
    with pytest.raises(RepositoryError, match="precision_mode FP16 makes ONNX Runtime's TensorRT provider build a "
                                              "weakly typed network"):
        validate_model(out / DENOISER)


# ---------------------------------------------------------------- λ and the served profile on GPU configs


def test_gpu_configs_require_lam_and_carry_the_served_profile(demo_onnx_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    write_repository("gpu", DEMO, out, onnx_dir=demo_onnx_dir)
    cpu = tmp_path / "cpu"
    write_repository("cpu", [DENOISER], cpu, onnx_dir=demo_onnx_dir)
    assert PROFILE_KEY not in _cfg(cpu / DENOISER).parameters  # ONNX Runtime on the CPU takes any shape

    mnist = _cfg(out / CLASSIFIER)
    assert "input_defaults" not in mnist.parameters and not any(i.optional for i in mnist.input)  # gateway sends λ
    card = from_onnx(demo_onnx_dir / f"{DENOISER}.onnx")
    den = _cfg(out / DENOISER)
    prof = _profile(den)
    (_, b1, b2), (h0, h1, h2), (w0, w1, w2) = card.trt_profile.batch, card.trt_profile.dims["1"], \
        card.trt_profile.dims["2"]
    assert den.max_batch_size == b2 == prof.max_batch and prof.hw("noisy") == ((h0, w0), (h2, w2))
    assert prof.inputs["noisy"].opt == (b1, 1, h1, w1) and prof.inputs["sigma"].max == (b2,)
    acc = den.optimization.execution_accelerators.gpu_execution_accelerator[0]
    assert acc.parameters["trt_profile_max_shapes"] == f"noisy:{b2}x1x{h2}x{w2},sigma:{b2}"  # the same profile

    # a hand edit that makes max_batch_size exceed the engine's profile is caught by validation
    text = (out / DENOISER / "config.pbtxt").read_text()
    (out / DENOISER / "config.pbtxt").write_text(text.replace(f"max_batch_size: {b2}\n", f"max_batch_size: {b2 + 8}\n"))
    with pytest.raises(RepositoryError, match=f"max_batch_size {b2 + 8} exceeds the TensorRT profile's max batch {b2}"):
        validate_repository(out)


def test_the_gateway_reads_the_profile_and_refuses_images_outside_it() -> None:
    prof = ServedProfile.from_json(json.dumps({"source": "test", "inputs": {
        "noisy": {"min": [1, 1, 32, 24], "opt": [2, 1, 64, 64], "max": [4, 1, 96, 128]},
        "sigma": {"min": [1], "opt": [2], "max": [4]}}}))
    cfg = {"max_batch_size": 8, "parameters": {PROFILE_KEY: {"string_value": prof.to_json()}}, "input": []}
    info = model_info("m", {"inputs": [], "outputs": []}, cfg)
    assert info.profile == prof and info.batch_limit == 4  # never past the profile's max batch
    assert model_info("m", {}, {"max_batch_size": 8}).batch_limit == 8  # CPU config: no profile
    hw = prof.hw("noisy")
    images.check_profile_size(128, 96, hw, "m")  # W×H at the limit: fine
    with pytest.raises(ApiError) as big:
        images.check_profile_size(129, 50, hw, "m")
    assert big.value.status == 413 and "96×128" in big.value.message  # names the largest H×W
    with pytest.raises(ApiError) as small:
        images.check_profile_size(30, 31, hw, "m")
    assert small.value.status == 422 and "32×24" in small.value.message


# ---------------------------------------------------------------- plans: cross-checked against their JSON


def _dummy_plan(onnx_dir: Path, plan_dir: Path, changes: dict | None = None, name: str = DENOISER,
                precision: str = "fp32", batch=(1, 2, 4), hw=((16, 16), (64, 64), (512, 768))) -> Path:
    """A dummy plan file and a JSON in export/trt_build.py's format (a real plan needs a GPU; see the module doc)."""
    plan_dir.mkdir(parents=True, exist_ok=True)
    plan = plan_dir / f"{name}.{precision}.plan"
    plan.write_bytes(b"dummy bytes: no GPU here to build a TensorRT engine; only the config logic is tested")
    graph = onnx_dir / (f"{name}.onnx" if precision == "fp32" else f"{name}.{precision}.onnx")
    shapes = [(b, 1, h, w) for b, (h, w) in zip(batch, hw, strict=True)]
    report = {
        "model": name, "precision": precision, "onnx": str(graph), "onnx_sha256": _sha(graph),
        "plan": str(plan), "plan_sha256": _sha(plan), "tensorrt": "10.x (dummy)",
        "profiles": [{"noisy": {k: list(s) for k, s in zip(("min", "opt", "max"), shapes, strict=True)},
                      "sigma": {k: [b] for k, b in zip(("min", "opt", "max"), batch, strict=True)}}],
        "max_batch_size": batch[2], "passed": True, "failures": [],
        "io": [{"name": "noisy", "mode": "input", "dtype": "float32", "shape": [-1, 1, -1, -1]},
               {"name": "sigma", "mode": "input", "dtype": "float32", "shape": [-1]},
               {"name": "denoised", "mode": "output", "dtype": "float32", "shape": [-1, 1, -1, -1]}],
    }
    report.update(changes or {})
    plan.with_suffix(".json").write_text(json.dumps(report))
    return plan


def test_a_plan_is_served_only_as_its_json_describes_it(demo_onnx_dir: Path, tmp_path: Path) -> None:
    onnx_dir = _copy_exports(demo_onnx_dir, tmp_path / "onnx", [DENOISER])
    plans = tmp_path / "trt"

    def write(**kw) -> Path:
        out = tmp_path / "repo"
        write_repository("gpu", [DENOISER], out, onnx_dir=onnx_dir, plan_dir=plans, **kw)
        return out / DENOISER

    _dummy_plan(onnx_dir, plans)
    model = write()
    cfg = _cfg(model)
    assert cfg.platform == "tensorrt_plan" and (model / "1" / "model.plan").exists()
    assert not cfg.optimization.execution_accelerators.gpu_execution_accelerator
    assert json.loads((model / PLAN_JSON).read_text())["passed"] is True
    prof = _profile(cfg)
    assert prof.hw("noisy") == ((16, 16), (512, 768)) and prof.source == f"plan {DENOISER}.fp32.plan"
    assert cfg.max_batch_size == 4  # the plan's profile, not the card's trt_profile
    assert validate_repository(model.parent, onnx_dir=onnx_dir).keys() == {DENOISER}

    with pytest.raises(RepositoryError, match="max_batch_size 16 exceeds the max batch 4 of the optimization profile"):
        write(max_batch_size=16)
    refusals = {
        "passed: False": {"passed": False, "failures": ["psnr_loss_db 0.4 > 0.01"]},
        "describes a fp16 engine": {"precision": "fp16"},
        "the plan is stale": {"onnx_sha256": "0" * 64},
        "min batch": {"profiles": [{"noisy": {"min": [2, 1, 16, 16], "opt": [2, 1, 64, 64], "max": [4, 1, 64, 64]},
                                    "sigma": {"min": [2], "opt": [2], "max": [4]}}]},
        "plan input 'noisy' is float16": {"io": [
            {"name": "noisy", "mode": "input", "dtype": "float16", "shape": [-1, 1, -1, -1]},
            {"name": "sigma", "mode": "input", "dtype": "float32", "shape": [-1]},
            {"name": "denoised", "mode": "output", "dtype": "float32", "shape": [-1, 1, -1, -1]}]},
        "exactly one optimization profile": {"profiles": []},
    }
    for message, override in refusals.items():
        _dummy_plan(onnx_dir, plans, override)
        with pytest.raises(RepositoryError, match=message):
            write()
    _dummy_plan(onnx_dir, plans)
    (plans / f"{DENOISER}.fp32.json").unlink()
    with pytest.raises(RepositoryError, match=f"has no {DENOISER}.fp32.json beside it"):
        write()
    (plans / f"{DENOISER}.fp32.plan").unlink()
    _dummy_plan(onnx_dir, plans, {"passed": False, "failures": ["rel_err"]})
    (plans / f"{DENOISER}.fp32.plan").unlink()  # a failed build leaves the JSON and no plan
    with pytest.raises(RepositoryError, match="failed its parity gate"):
        write()

    # validation re-checks a written repository against the plan's JSON
    _dummy_plan(onnx_dir, plans)
    model = write()
    report = json.loads((model / PLAN_JSON).read_text())
    (model / PLAN_JSON).write_text(json.dumps({**report, "passed": False}))
    with pytest.raises(RepositoryError, match="the engine failed its parity gate"):
        validate_repository(model.parent, onnx_dir=onnx_dir)
    (model / PLAN_JSON).write_text(json.dumps(report))
    (model / "1" / "model.plan").write_bytes(b"another engine")
    with pytest.raises(RepositoryError, match="model.plan is not the plan trt_plan.json describes"):
        validate_repository(model.parent, onnx_dir=onnx_dir)
    with pytest.raises(RepositoryError, match="stands in for GPU configs"):
        write_repository("cpu", [DENOISER], tmp_path / "x", onnx_dir=onnx_dir, cpu_stand_in=True)
    with pytest.raises(RepositoryError, match="cannot be stood in for"):
        write(cpu_stand_in=True)


# ---------------------------------------------------------------- the real gateway in front of GPU configs


def _png(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.triton
@pytest.mark.slow
def test_gateway_serves_gpu_configs_through_a_cpu_stand_in(demo_onnx_dir: Path, tmp_path: Path) -> None:
    from unroll.data import mnist_split
    from unroll.serving.gateway.process import gateway_process
    from unroll.serving.gateway.settings import Settings
    from unroll.serving.triton import free_ports, start

    repo = tmp_path / "repo"
    # max_batch_size 2: an RGB image (3 channels = 3 items for the gray denoiser) and a burst of 6 classify requests
    # are more than one batch
    write_repository("gpu", DEMO, repo, onnx_dir=demo_onnx_dir, max_batch_size=2, cpu_stand_in=True)
    validate_repository(repo)
    cards = {n: from_onnx(demo_onnx_dir / f"{n}.onnx") for n in DEMO}
    lam0 = cards[CLASSIFIER].lam.default
    mnist = _cfg(repo / CLASSIFIER)
    assert "input_defaults" not in mnist.parameters and not any(i.optional for i in mnist.input)
    prof = _profile(_cfg(repo / DENOISER))
    (_, _), (max_h, max_w) = prof.hw("noisy")
    assert prof.max_batch == 2

    sess = {n: ort.InferenceSession(str(demo_onnx_dir / f"{n}.onnx"), providers=["CPUExecutionProvider"])
            for n in (CLASSIFIER, DENOISER)}
    _, _, xte, _ = mnist_split()
    digits = np.rint(xte[:6, 0] * 255).astype(np.uint8)
    x = digits[:, None].astype(np.float32) / 255.0

    def softmax_top(logits: np.ndarray) -> tuple[int, float]:
        p = np.exp(logits - logits.max())
        return int(p.argmax()), float(p.max() / p.sum())

    http, grpc, metrics = free_ports(3)
    with start(repo, http, grpc, metrics, log_file=tmp_path / "triton.log", timeout_s=120,
               extra_args=["--exit-timeout-secs=2"]) as server, \
            gateway_process(Settings(triton_url=f"127.0.0.1:{grpc}"), tmp_path / "gateway.log") as base, \
            httpx.Client(base_url=base, timeout=60) as client:
        served = {m["name"]: m for m in client.get("/v1/models").json()["models"]}
        assert served[DENOISER]["trt_profile"]["noisy"]["max"] == [2, 1, max_h, max_w]

        # classify without lam: 200, the card's λ, exactly what the graph gives with it
        def classify(i: int, **params) -> httpx.Response:
            return client.post("/v1/classify", params={"model": CLASSIFIER, "invert": "false", **params},
                               files={"image": ("d.png", _png(digits[i]), "image/png")})

        for lam, params in ((lam0, {}), (0.3, {"lam": 0.3})):
            r = classify(0, **params)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["lam"] == pytest.approx(lam)
            want = sess[CLASSIFIER].run(None, {"image": x[:1], "lam": np.full(1, lam, np.float32)})[0][0]
            top, score = softmax_top(want)
            assert body["predictions"][0]["index"] == top and body["predictions"][0]["score"] == pytest.approx(
                score, abs=1e-4)
            assert body["predictions"][0]["label"] == cards[CLASSIFIER].labels[top]

        # a burst larger than max_batch_size: every request served, each with its own answer
        results: dict[int, httpx.Response] = {}

        def one(i: int) -> None:
            with httpx.Client(base_url=base, timeout=60) as c:
                results[i] = c.post("/v1/classify", params={"model": CLASSIFIER, "invert": "false"},
                                    files={"image": ("d.png", _png(digits[i]), "image/png")})

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(digits))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        want = sess[CLASSIFIER].run(None, {"image": x, "lam": np.full(len(x), lam0, np.float32)})[0]
        for i in range(len(digits)):
            assert results[i].status_code == 200, results[i].text
            assert results[i].json()["predictions"][0]["index"] == softmax_top(want[i])[0]

        # denoise inside the profile: same size and mode, the graph's result; an RGB image is 3 batch items > 2
        rng = np.random.default_rng(0)
        rgb = rng.integers(0, 256, (48, 40, 3), dtype=np.uint8)
        r = client.post("/v1/denoise", params={"model": DENOISER, "sigma": 25},
                        files={"image": ("n.png", _png(rgb), "image/png")})
        assert r.status_code == 200, r.text
        got = np.asarray(Image.open(io.BytesIO(r.content)))
        assert got.shape == rgb.shape
        planes = rgb.transpose(2, 0, 1)[:, None].astype(np.float32) / 255.0
        den = sess[DENOISER].run(None, {"noisy": planes, "sigma": np.full(3, 25 / 255, np.float32)})[0]
        expected = np.rint(np.clip(den[:, 0], 0, 1) * 255).transpose(1, 2, 0)
        assert np.abs(got.astype(int) - expected).max() <= 1

        # larger than the profile's largest H×W: the denoiser's card declares tiling, so the gateway cuts it into
        # windows that fit the profile and the answer is the whole image's, not a 413 or Triton's error as a 502
        assert cards[DENOISER].tiling is not None
        tall = rng.integers(0, 256, (max_h + 8, 64), dtype=np.uint8)
        r = client.post("/v1/denoise", params={"model": DENOISER, "sigma": 25},
                        files={"image": ("big.png", _png(tall), "image/png")})
        assert r.status_code == 200, r.text
        whole = sess[DENOISER].run(None, {"noisy": tall[None, None].astype(np.float32) / 255.0,
                                          "sigma": np.full(1, 25 / 255, np.float32)})[0][0, 0]
        diff = np.abs(np.asarray(Image.open(io.BytesIO(r.content)), int) - np.rint(np.clip(whole, 0, 1) * 255))
        assert diff.max() <= 1 and (diff == 0).mean() > 0.999
        # ...an image the engine itself refuses (the stand-in holds requests to the profile, as TensorRT)
        triton = httpclient.InferenceServerClient(server.url)
        noisy = np.zeros((1, 1, max_h + 8, 64), np.float32)
        inputs = [httpclient.InferInput("noisy", list(noisy.shape), "FP32"),
                  httpclient.InferInput("sigma", [1, 1], "FP32")]
        inputs[0].set_data_from_numpy(noisy)
        inputs[1].set_data_from_numpy(np.full((1, 1), 0.1, np.float32))
        with pytest.raises(InferenceServerException, match="outside the TensorRT optimization profile"):
            triton.infer(DENOISER, inputs)
        triton.close()
        # smaller than the minimum: a clear 422
        r = client.post("/v1/denoise", params={"model": DENOISER, "sigma": 25},
                        files={"image": ("small.png", _png(np.zeros((8, 8), np.uint8)), "image/png")})
        assert r.status_code == 422 and r.json()["error"]["code"] == "image_too_small"
