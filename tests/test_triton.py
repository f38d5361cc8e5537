"""Triton: repository generator, config validation, and a real tritonserver serving the demo models.

One server for the module (the two demo models + sdnet-mnist-autolam, the λ rule sdnet-mnist's card
names, exported into a tmp dir from the committed weights); every server test talks to it over HTTP and
gRPC with ``tritonclient`` and compares against ONNX Runtime run in-process on the same ONNX files.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import typer
from google.protobuf import text_format
from served import paused_burst
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException
from typer.testing import CliRunner

from unroll.app.triton_cli import repo as repo_cmd
from unroll.app.triton_cli import triton as triton_cmd
from unroll.card import CARD_KEY, ModelCard, from_onnx
from unroll.serving import triton
from unroll.serving.repository import RepositoryError, write_repository
from unroll.serving.repository_check import validate_model, validate_repository
from unroll.serving.triton import free_ports

DEMO = ["sdnet-mnist", "sdnet-mnist-autolam", "csc-denoiser"]
TOL = 1e-5


@pytest.fixture(scope="module")
def onnx_dir(demo_onnx_dir: Path) -> Path:
    return demo_onnx_dir


@pytest.fixture(scope="module")
def server(demo_triton: triton.TritonHandle) -> triton.TritonHandle:
    """The session's tritonserver (``DEMO`` and the other graphs their cards name); counts are read before and after."""
    return demo_triton


@pytest.fixture(scope="module")
def sessions(onnx_dir: Path) -> dict[str, ort.InferenceSession]:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return {m: ort.InferenceSession(str(onnx_dir / f"{m}.onnx"), so, providers=["CPUExecutionProvider"])
            for m in DEMO}


@pytest.fixture(scope="module")
def http(server) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url)


@pytest.fixture(scope="module")
def grpc(server) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(server.grpc_url)


def _inputs(mod, arrays: dict[str, np.ndarray]) -> list:
    """tritonclient inputs; a [B] array (lam, sigma) goes as [B, 1] per the config's dims [1]."""
    out = []
    for name, a in arrays.items():
        a = a.reshape(-1, 1) if a.ndim == 1 else a
        i = mod.InferInput(name, list(a.shape), "FP32" if a.dtype == np.float32 else "FP64")
        if mod is httpclient:
            i.set_data_from_numpy(a, binary_data=True)
        else:
            i.set_data_from_numpy(a)
        out.append(i)
    return out


def _http_out(name: str, **kw) -> httpclient.InferRequestedOutput:
    return httpclient.InferRequestedOutput(name, binary_data=True, **kw)


def _images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 1, 28, 28), dtype=np.float32)


# ---------------------------------------------------------------- server: loading, parity, labels


@pytest.mark.triton
def test_models_load_and_server_metadata(server, http, grpc) -> None:
    assert http.is_server_ready() and grpc.is_server_live()
    from unroll.serving.triton import BUNDLED_TRITON_VERSION

    assert http.get_server_metadata()["version"] == BUNDLED_TRITON_VERSION  # what the README and pins say
    index = {m["name"]: m["state"] for m in http.get_model_repository_index()}
    assert {m: index.get(m) for m in DEMO} == {m: "READY" for m in DEMO}
    meta = grpc.get_model_metadata("sdnet-mnist")
    # the float input and λ, and the encoded-image protocol's (tests/test_triton_images.py)
    assert [i.name for i in meta.inputs] == ["image", "lam", "image_bytes", "invert"]
    assert [o.name for o in meta.outputs] == ["logits", "solver_fit", "image_info"]  # solver_fit: the card's ood
    cfg = grpc.get_model_config("csc-denoiser").config
    assert cfg.backend == "python" and cfg.dynamic_batching.max_queue_delay_microseconds >= 0
    with urllib.request.urlopen(server.metrics_url, timeout=5) as r:
        assert b"nv_inference_count" in r.read()


@pytest.mark.triton
def test_every_config_carries_the_card_of_its_onnx(grpc, onnx_dir: Path) -> None:
    for m in DEMO:
        served = grpc.get_model_config(m).config.parameters[CARD_KEY].string_value
        card = ModelCard.from_json(served)
        assert card == from_onnx(onnx_dir / f"{m}.onnx") and card.name == m
    assert ModelCard.from_json(grpc.get_model_config("sdnet-mnist").config.parameters[CARD_KEY].string_value
                               ).lam.auto == "sdnet-mnist-autolam"


@pytest.mark.triton
def test_http_and_grpc_match_onnxruntime(http, grpc, sessions) -> None:
    x = _images(3, seed=1)
    lam = np.array([0.1, 0.3, 0.05], np.float32)
    want = sessions["sdnet-mnist"].run(None, {"image": x, "lam": lam})[0]
    got_http = http.infer("sdnet-mnist", _inputs(httpclient, {"image": x, "lam": lam}),
                          outputs=[_http_out("logits")]).as_numpy("logits")
    got_grpc = grpc.infer("sdnet-mnist", _inputs(grpcclient, {"image": x, "lam": lam})).as_numpy("logits")
    np.testing.assert_allclose(got_http, want, rtol=0, atol=TOL)
    np.testing.assert_allclose(got_grpc, want, rtol=0, atol=TOL)

    noisy = np.random.default_rng(2).random((2, 1, 64, 64), dtype=np.float32)
    sigma = np.array([25 / 255, 10 / 255], np.float32)
    want = sessions["csc-denoiser"].run(None, {"noisy": noisy, "sigma": sigma})[0]
    for client, mod in ((http, httpclient), (grpc, grpcclient)):
        outs = [_http_out("denoised")] if mod is httpclient else None
        got = client.infer("csc-denoiser", _inputs(mod, {"noisy": noisy, "sigma": sigma}), outputs=outs)
        np.testing.assert_allclose(got.as_numpy("denoised"), want, rtol=0, atol=TOL)

    want = sessions["sdnet-mnist-autolam"].run(None, {"image": x})[0]
    got = grpc.infer("sdnet-mnist-autolam", _inputs(grpcclient, {"image": x})).as_numpy("lam")
    assert got.shape == (3, 1)
    np.testing.assert_allclose(got[:, 0], want, rtol=0, atol=TOL)


@pytest.mark.triton
def test_mnist_digits_get_their_labels_through_the_classification_extension(http, grpc, onnx_dir) -> None:
    import json

    if json.loads((onnx_dir / "sdnet-mnist.report.json").read_text())["weights"] != "committed":
        pytest.skip("sdnet-mnist has no committed weights (unroll/weights/sdnet-mnist.pt): labels would be random")
    from unroll.data import mnist_split

    _, _, x_test, y_test = mnist_split()
    x, y = x_test[:20], y_test[:20]
    http_res = http.infer("sdnet-mnist", _inputs(httpclient, {"image": x}),
                          outputs=[_http_out("logits", class_count=1)]).as_numpy("logits")
    grpc_res = grpc.infer("sdnet-mnist", _inputs(grpcclient, {"image": x}),
                          outputs=[grpcclient.InferRequestedOutput("logits", class_count=1)]).as_numpy("logits")
    assert http_res.shape == grpc_res.shape == (20, 1)
    for res in (http_res, grpc_res):
        parsed = [r[0].decode().split(":") for r in res]  # "score:index:label"
        assert all(len(p) == 3 and p[1] == p[2] for p in parsed)  # MNIST labels are the digits
        predicted = np.array([int(p[1]) for p in parsed])
        assert (predicted == y).mean() >= 0.95, (predicted, y)
        assert all(np.isfinite(float(p[0])) for p in parsed)


@pytest.mark.triton
def test_denoiser_serves_several_sizes_in_one_run(grpc, sessions) -> None:
    rng = np.random.default_rng(3)
    for h, w in ((64, 64), (333, 517), (16, 16)):
        noisy = rng.random((1, 1, h, w), dtype=np.float32)
        sigma = np.array([15 / 255], np.float32)
        got = grpc.infer("csc-denoiser", _inputs(grpcclient, {"noisy": noisy, "sigma": sigma})).as_numpy("denoised")
        assert got.shape == (1, 1, h, w)
        want = sessions["csc-denoiser"].run(None, {"noisy": noisy, "sigma": sigma})[0]
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL)


@pytest.mark.triton
def test_lam_is_optional_and_defaults_to_the_trained_value(grpc) -> None:
    x = _images(2, seed=4)
    without = grpc.infer("sdnet-mnist", _inputs(grpcclient, {"image": x})).as_numpy("logits")
    default = grpc.infer("sdnet-mnist", _inputs(grpcclient, {"image": x, "lam": np.full(2, 0.1, np.float32)}))
    other = grpc.infer("sdnet-mnist", _inputs(grpcclient, {"image": x, "lam": np.full(2, 0.5, np.float32)}))
    np.testing.assert_allclose(without, default.as_numpy("logits"), rtol=0, atol=1e-6)
    assert np.abs(without - other.as_numpy("logits")).max() > 1e-4  # lam really reaches the model


# ---------------------------------------------------------------- server: batching and errors


@pytest.mark.triton
def test_concurrent_burst_is_dynamically_batched(server, grpc, sessions) -> None:
    """A burst of single-image requests from four clients is answered correctly, each executed exactly once, and
    Triton's dynamic batcher merges them. Whether requests queue up by themselves depends on scheduling (a server
    that keeps up runs each alone, as on a machine busy with other work), so tritonserver is paused (SIGSTOP, a real
    stall; pausing the model's backend process instead fails the request it holds: "stub not healthy") while the
    burst is sent: on SIGCONT every request is there at once, and the batcher forms batches of them."""
    def batch_counts() -> dict[int, int]:
        stats = grpc.get_inference_statistics("sdnet-mnist").model_stats[0]
        return {b.batch_size: b.compute_infer.count for b in stats.batch_stats}

    n = 32
    x = _images(n, seed=5)
    want = sessions["sdnet-mnist"].run(None, {"image": x, "lam": np.full(n, 0.1, np.float32)})[0]
    clients = [grpcclient.InferenceServerClient(server.grpc_url) for _ in range(4)]
    inputs = [_inputs(grpcclient, {"image": x[i:i + 1]}) for i in range(n)]  # built first: the burst is sends only
    before = batch_counts()
    results = paused_burst(server.pid, clients, "sdnet-mnist", inputs, "logits")
    np.testing.assert_allclose(np.concatenate(results), want, rtol=0, atol=TOL)
    # Triton records an execution's statistics just after sending its responses: the last batch of a burst can be
    # answered before it is counted, so read until the counts settle (a CI run saw 2 of 32 counted)
    deadline = time.monotonic() + 10
    while True:
        after = batch_counts()
        grown = {b: after[b] - before.get(b, 0) for b in after if after[b] > before.get(b, 0)}
        if sum(b * c for b, c in grown.items()) >= n or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert sum(b * c for b, c in grown.items()) == n  # every request executed exactly once
    assert max(grown) > 1, grown  # the queued requests were batched


@pytest.mark.triton
def test_bad_requests_get_tritons_error_and_the_server_keeps_serving(http, grpc) -> None:
    bad = {
        "wrong shape": ("sdnet-mnist", {"image": np.zeros((1, 1, 27, 28), np.float32)}, "shape"),
        "wrong dtype": ("sdnet-mnist", {"image": np.zeros((1, 1, 28, 28), np.float64)}, "FP64"),
        "missing input": ("csc-denoiser", {"noisy": np.zeros((1, 1, 32, 32), np.float32)}, "sigma"),
        "too small for the model": ("csc-denoiser", {"noisy": np.zeros((1, 1, 2, 2), np.float32),
                                                     "sigma": np.array([0.1], np.float32)},
                                    "2×2 is smaller than the model's minimum image side 16"),
    }
    for what, (model, arrays, mentions) in bad.items():
        for client, mod in ((http, httpclient), (grpc, grpcclient)):
            with pytest.raises(InferenceServerException) as info:
                client.infer(model, _inputs(mod, arrays))
            assert mentions in str(info.value), (what, str(info.value))
            if what == "too small for the model":  # a bad request (400), not a server error (500)
                assert info.value.status() in ("400", "StatusCode.INVALID_ARGUMENT"), info.value.status()
    assert http.is_server_ready()
    ok = grpc.infer("sdnet-mnist", _inputs(grpcclient, {"image": _images(1)})).as_numpy("logits")
    assert ok.shape == (1, 10) and np.isfinite(ok).all()


# ---------------------------------------------------------------- repository: GPU configs and validation


def test_gpu_repository_parses_and_matches_the_onnx(onnx_dir: Path, tmp_path: Path) -> None:
    """The GPU configs of the demo models (plans and FP16/INT8 graphs: tests/test_gpu_repository.py)."""
    out = tmp_path / "gpu"
    write_repository("gpu", DEMO, out, onnx_dir=onnx_dir, plan_dir=tmp_path / "no-plans")
    cfgs = validate_repository(out, onnx_dir=onnx_dir)
    assert set(cfgs) == set(DEMO)
    for name, cfg in cfgs.items():
        parsed = text_format.Parse((out / name / "config.pbtxt").read_text(), mc.ModelConfig())
        assert parsed == cfg and parsed.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU
        assert parsed.max_batch_size > 0 and parsed.HasField("dynamic_batching")
        assert len(parsed.model_warmup) >= 1 and not any(i.optional for i in parsed.input)  # GPU: lam required
        assert "input_defaults" not in parsed.parameters and "unroll.profile" in parsed.parameters
        assert parsed.platform == "onnxruntime_onnx" and (out / name / "1" / "model.onnx").exists()
        acc = parsed.optimization.execution_accelerators.gpu_execution_accelerator[0]
        # FP32: ONNX Runtime's TensorRT provider builds strongly typed and runs the graph's own precision
        assert acc.name == "tensorrt" and acc.parameters["precision_mode"] == "FP32"
        assert acc.parameters["trt_engine_cache_enable"] == "1" and acc.parameters["trt_engine_cache_path"]
    mnist = cfgs["sdnet-mnist"]
    acc = mnist.optimization.execution_accelerators.gpu_execution_accelerator[0]
    b = mnist.max_batch_size
    assert acc.parameters["trt_profile_max_shapes"] == f"image:{b}x1x28x28,lam:{b}"
    assert (out / "sdnet-mnist" / "labels.txt").read_text().split() == [str(i) for i in range(10)]
    assert b == from_onnx(onnx_dir / "sdnet-mnist.onnx").trt_profile.batch[2]  # GPU: the card's profile max

    out = tmp_path / "gpu-noplan"  # the denoiser's TensorRT profile comes from its card (dynamic H×W ranges)
    write_repository("gpu", ["csc-denoiser"], out, onnx_dir=onnx_dir, plan_dir=tmp_path / "no-plans")
    card = from_onnx(onnx_dir / "csc-denoiser.onnx")
    acc = validate_repository(out)["csc-denoiser"].optimization.execution_accelerators.gpu_execution_accelerator[0]
    (b_min, b_opt, b_max), (h_min, h_opt, h_max), (w_min, w_opt, w_max) = (
        card.trt_profile.batch, card.trt_profile.dims["1"], card.trt_profile.dims["2"])
    assert acc.parameters["trt_profile_min_shapes"] == f"noisy:{b_min}x1x{h_min}x{w_min},sigma:{b_min}"
    assert acc.parameters["trt_profile_opt_shapes"] == f"noisy:{b_opt}x1x{h_opt}x{w_opt},sigma:{b_opt}"
    assert acc.parameters["trt_profile_max_shapes"] == f"noisy:{b_max}x1x{h_max}x{w_max},sigma:{b_max}"


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_a_config_that_disagrees_with_the_onnx_fails_naming_the_tensor(onnx_dir: Path, tmp_path: Path) -> None:
    cases = {
        "dims": ("sdnet-mnist", "dims: 28\n  optional: true\n}", "dims: 27\n  optional: true\n}", "'image'"),
        "dtype": ("csc-denoiser", "data_type: TYPE_FP32", "data_type: TYPE_FP16", "'noisy'"),
        "name": ("csc-denoiser", 'name: "denoised"', 'name: "clean"', "'clean'"),
        "reshape": ("sdnet-mnist-autolam", 'name: "lam"\n  data_type: TYPE_FP32\n  dims: 1\n  reshape {\n  }',
                    'name: "lam"\n  data_type: TYPE_FP32\n  dims: 1', "'lam'"),
        "labels": ("sdnet-mnist", "dims: 10", "dims: 11", "'logits'"),
    }
    for what, (model, old, new, named) in cases.items():
        out = tmp_path / what
        write_repository("cpu", [model], out, onnx_dir=onnx_dir)
        validate_model(out / model)  # as written: fine
        _edit(out / model / "config.pbtxt", old, new)
        with pytest.raises(RepositoryError, match=named):
            validate_model(out / model)
    out = tmp_path / "syntax"
    write_repository("gpu", ["sdnet-mnist"], out, onnx_dir=onnx_dir)
    _edit(out / "sdnet-mnist" / "config.pbtxt", "\nmax_batch_size:", "\nmax_batch:")
    with pytest.raises(RepositoryError, match="not a valid Triton model config"):
        validate_repository(out)


def test_write_repository_refuses_what_it_cannot_build(onnx_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(RepositoryError, match="unroll export vars-d"):
        write_repository("cpu", ["vars-d"], tmp_path, onnx_dir=onnx_dir)
    with pytest.raises(RepositoryError, match="unroll quantize sdnet-mnist"):
        write_repository("cpu", ["sdnet-mnist"], tmp_path, precision="int8", onnx_dir=onnx_dir)
    with pytest.raises(RepositoryError, match="target"):
        write_repository("tpu", ["sdnet-mnist"], tmp_path, onnx_dir=onnx_dir)  # type: ignore[arg-type]


# ---------------------------------------------------------------- start(): failures and clean shutdown


def _tiny_repo(onnx_dir: Path, root: Path, broken: bool) -> Path:
    repo = root / ("broken" if broken else "tiny")
    write_repository("cpu", ["sdnet-mnist-autolam"], repo, onnx_dir=onnx_dir)
    if broken:
        (repo / "sdnet-mnist-autolam" / "1" / "model.onnx").write_bytes(b"garbage, not a protobuf")
    return repo


@pytest.mark.triton
def test_a_model_that_fails_to_load_raises_with_tritons_reason(onnx_dir: Path, tmp_path: Path) -> None:
    repo = _tiny_repo(onnx_dir, tmp_path, broken=True)
    with pytest.raises(triton.TritonStartError) as info:
        triton.start(repo, *free_ports(3), log_file=tmp_path / "broken.log", timeout_s=60)
    msg = str(info.value)
    assert "failed to load 'sdnet-mnist-autolam'" in msg and "INVALID_PROTOBUF" in msg, msg
    assert info.value.log_path == tmp_path / "broken.log"


def test_missing_repository_or_busy_port_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(triton.TritonStartError, match="does not exist"):
        triton.start(tmp_path / "nope", *free_ports(3))
    tmp_path.joinpath("repo").mkdir()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(triton.TritonStartError, match=f"gRPC port {port} .* not available"):
            triton.start(tmp_path / "repo", free_ports(1)[0], port, free_ports(1)[0])
    raised: list[BaseException] = []

    def off_main() -> None:
        try:
            triton.start(tmp_path / "repo", *free_ports(3))
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            raised.append(e)

    worker = threading.Thread(target=off_main)
    worker.start()
    worker.join(30)
    assert len(raised) == 1 and isinstance(raised[0], triton.TritonStartError), raised
    assert "main thread" in str(raised[0])


def _processes_of(marker: str) -> dict[int, str]:
    """Live (non-zombie) processes whose command line contains ``marker``: ``{pid: command}``."""
    return {pid: " ".join(argv) for pid, argv in triton.processes_with(marker).items()}


@pytest.mark.triton
def test_a_killed_parent_leaves_no_triton_and_no_stub(onnx_dir: Path, tmp_path: Path) -> None:
    repo = _tiny_repo(onnx_dir, tmp_path, broken=False)
    code = ("import sys, time; from pathlib import Path; from unroll.serving import triton; "
            "h = triton.start(Path(sys.argv[1]), *triton.free_ports(3), log_file=Path(sys.argv[2])); "
            "print('ready', h.pid, flush=True); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", code, str(repo), str(tmp_path / "orphan.log")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = parent.stdout.readline()  # blocks until Triton is ready (or the parent failed)
        assert line.startswith("ready"), line + parent.stdout.read()
        before = _processes_of(str(repo))  # tritonserver (--model-repository) and its stub (<repo>/…/model.py)
        assert any("tritonserver" in c for c in before.values()), before
        assert any("triton_python_backend_stub" in c for c in before.values()), before
        parent.kill()  # SIGKILL: no atexit, no finally, nothing of ours runs
        parent.wait(10)
        deadline = time.monotonic() + 20
        while (left := _processes_of(str(repo))) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"still running {time.monotonic() - deadline + 20:.0f} s after the parent was killed: {left}"
    finally:
        if parent.poll() is None:
            parent.kill()
        _end(str(repo))  # only after a failure: never leave them to the next test


def _end(marker: str) -> None:
    """SIGTERM what is left (Triton then removes its stubs' shared memory), SIGKILL what outlives that."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
        for pid in _processes_of(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while _processes_of(marker) and time.monotonic() < deadline:
            time.sleep(0.2)


def test_the_server_is_found_without_importing_pytriton() -> None:
    """Paths come from pytriton.utils.distribution, loaded alone: pytriton's heavy __init__ does not run."""
    code = ("import sys; from unroll.serving import triton; layout = triton.server_layout(); "
            "assert 'pytriton' not in sys.modules, 'pytriton/__init__ ran'; print(layout.lib_dirs[0])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.strip()).name == "nvidia_pytriton.libs"


def test_stub_goes_to_a_writable_copy_when_site_packages_is_read_only(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(triton, "_writable", lambda path: False)
    layout = triton.server_layout()
    assert layout.backends.is_relative_to(tmp_path)
    assert (layout.backends / "python" / "libtriton_python.so").exists()
    assert os.access(layout.backends / "python" / "triton_python_backend_stub", os.X_OK)
    assert triton.server_layout() == layout  # idempotent


# ---------------------------------------------------------------- the two CLI commands


def _app() -> typer.Typer:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command("repo")(repo_cmd)
    app.command("triton")(triton_cmd)
    return app


def test_repo_command_writes_and_validates(onnx_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "repo"
    res = runner.invoke(_app(), ["repo", "--out", str(out), "--onnx-dir", str(onnx_dir)])
    assert res.exit_code == 0, res.output
    # the autolam companion and the graphs of sdnet-mnist's other served iteration counts are added
    assert sorted(p.name for p in out.iterdir()) == sorted([*DEMO, *(f"sdnet-mnist-iters{k}" for k in (1, 4, 8))])
    assert (out / "csc-denoiser" / "1" / "model.py").exists()
    res = runner.invoke(_app(), ["repo", "--target", "tpu", "--out", str(out)])
    assert res.exit_code == 1 and "cpu or gpu" in res.output and "Traceback" not in res.output
    res = runner.invoke(_app(), ["triton", "--repo", str(tmp_path / "nope")])
    assert res.exit_code == 1 and "does not exist" in res.output and "Traceback" not in res.output


@pytest.mark.triton
def test_triton_command_serves_until_sigint_and_leaves_no_process(onnx_dir: Path, tmp_path: Path) -> None:
    repo = _tiny_repo(onnx_dir, tmp_path, broken=False)
    http_port, grpc_port, metrics_port = free_ports(3)
    code = ("import typer; from unroll.app.triton_cli import repo, triton; app = typer.Typer(); "
            "app.command('repo')(repo); app.command('triton')(triton); app()")
    proc = subprocess.Popen([sys.executable, "-c", code, "triton", "--repo", str(repo), "--http-port", str(http_port),
                             "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
                             "--log-file", str(tmp_path / "cli.log")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=Path(__file__).resolve().parents[1], env={**os.environ, "COLUMNS": "200"})
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if client.is_model_ready("sdnet-mnist-autolam"):
                    break
            except Exception:  # not listening yet
                pass
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.3)
        else:
            pytest.fail("the triton command did not become ready")
        pids = subprocess.run(["pgrep", "-f", str(repo)], capture_output=True, text=True).stdout.split()
        assert pids  # tritonserver (and its stub) run with the repository in their command line
        client.close()  # Triton drains open connections (up to --exit-timeout-secs) before it exits
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    assert "Triton ready" in output and f"127.0.0.1:{http_port}" in output and "Triton stopped" in output
    for pid in pids:  # nothing left behind
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_stub_install_is_idempotent() -> None:
    a = triton.server_layout()
    stub = a.backends / "python" / "triton_python_backend_stub"
    mtime = stub.stat().st_mtime_ns
    b = triton.server_layout()
    assert a == b and stub.stat().st_mtime_ns == mtime and os.access(stub, os.X_OK)
    assert os.access(a.binary, os.X_OK) and all(d.is_dir() for d in a.lib_dirs)


def test_cpu_configs_carry_the_cards_runtime_and_the_spinning_choice(onnx_dir: Path, tmp_path: Path) -> None:
    """`cpu_runtime` comes from the card (the denoiser's names OpenVINO); spinning is on unless asked otherwise."""
    def params(repo: Path, model: str) -> dict[str, str]:
        cfg = text_format.Parse((repo / model / "config.pbtxt").read_text(), mc.ModelConfig())
        return {k: v.string_value for k, v in cfg.parameters.items()}

    write_repository("cpu", DEMO, tmp_path / "on", onnx_dir=onnx_dir)
    write_repository("cpu", ["sdnet-mnist"], tmp_path / "off", onnx_dir=onnx_dir, spinning=False)
    assert params(tmp_path / "on", "csc-denoiser")["cpu_runtime"] == "openvino"
    assert params(tmp_path / "on", "sdnet-mnist")["cpu_runtime"] == "onnxruntime"
    assert params(tmp_path / "on", "sdnet-mnist")["intra_op_spinning"] == "1"
    assert params(tmp_path / "off", "sdnet-mnist")["intra_op_spinning"] == "0"
