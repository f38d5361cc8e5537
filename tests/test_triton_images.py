"""Encoded images straight to Triton (issue 24, items 4 and 5): the protocol of ``serving/triton_backend_model.py``.

A real tritonserver serves the demo models' CPU configs; a KServe v2 client (``tritonclient``) sends PNG/JPEG/… files
as ``image_bytes`` and must get what the float-tensor path gives for the same upload (the tensors built as the gateway
builds them: logits within float tolerance, the denoised file byte for byte), several images per call, each limit
refused as ``INVALID_ARG`` carrying the gateway's status and code, and no output computed that was not asked for.
Then a real gateway in front of it forwards the upload's bytes (Triton counts one inference for an RGB image the
float path would send as three channels) and answers ``Accept: image/tiff`` / ``application/x-npy`` / 406.
"""

from __future__ import annotations

import io
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from PIL import Image
from tritonclient.utils import InferenceServerException

from unroll.card import ModelCard, from_onnx
from unroll.serving import triton
from unroll.serving.gateway.settings import Settings
from unroll.serving.imaging import images, prepare, wire
from unroll.serving.repository import write_repository

pytestmark = pytest.mark.triton

CLASSIFIER, DENOISER = "sdnet-mnist", "csc-denoiser"
TOL = 1e-5


@pytest.fixture(scope="module")
def cards(demo_onnx_dir: Path) -> dict[str, ModelCard]:
    return {m: from_onnx(demo_onnx_dir / f"{m}.onnx") for m in (CLASSIFIER, DENOISER)}


@pytest.fixture(scope="module")
def server(demo_triton) -> triton.TritonHandle:
    """The session's tritonserver: the demo models (the classifier with its λ rule: the gateway is ready once
    every graph its card names is served)."""
    return demo_triton


@pytest.fixture(scope="module")
def http(server) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url)


@pytest.fixture(scope="module")
def grpc(server) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(server.grpc_url)


def encode(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def tensor(mod, name: str, a: np.ndarray):
    i = mod.InferInput(name, list(a.shape), {np.dtype(np.uint8): "UINT8", np.dtype(np.int32): "INT32",
                                             np.dtype(np.float32): "FP32"}[a.dtype])
    if mod is httpclient:
        i.set_data_from_numpy(a, binary_data=True)
    else:
        i.set_data_from_numpy(a)
    return i


def outputs(mod, *names: str) -> list:
    return [mod.InferRequestedOutput(n, binary_data=True) if mod is httpclient else mod.InferRequestedOutput(n)
            for n in names]


def files(*blobs: bytes) -> np.ndarray:
    """The ``image_bytes`` input: one zero-padded row per file."""
    return wire.rows(list(blobs))


def col(value, dtype) -> np.ndarray:
    return np.array([[value]], dtype)


@pytest.fixture(scope="module")
def digits() -> np.ndarray:
    from unroll.data import mnist_split

    _, _, x, _ = mnist_split()
    return np.rint(x[:6, 0] * 255).astype(np.uint8)


@pytest.fixture(scope="module")
def noisy() -> np.ndarray:
    """A σ = 25 noisy crop of the bundled camera image (8-bit), within one tiling window."""
    from unroll.data import add_noise, bundled_image, noise_seed

    clean = bundled_image("camera")[:96, :120]
    return np.rint(np.clip(add_noise(clean, 25.0, noise_seed("camera", 25.0)), 0, 1) * 255).astype(np.uint8)


# ------------------------------------------------------------------------------------------------ the float path


def classifier_feed(data: bytes, card: ModelCard, invert: str | None = None) -> tuple[np.ndarray, bool]:
    """What the gateway builds from ``data`` for the float path (decode, fit to the card)."""
    img = images.decode(data, wire.DEFAULT_MAX_PIXELS, wire.DEFAULT_MAX_ASPECT_RATIO)
    fitted = images.classifier_input(img, card.input, prepare.check_invert(card.input, invert))
    return fitted.x, fitted.inverted


def float_logits(client, mod, card: ModelCard, x: np.ndarray, lam: float | None = None) -> np.ndarray:
    ins = [tensor(mod, card.input.name, x)]
    if lam is not None:
        ins.append(tensor(mod, card.lam.input, col(lam, np.float32)))
    return client.infer(CLASSIFIER, ins, outputs=outputs(mod, card.output)).as_numpy(card.output)


def float_denoise(client, card: ModelCard, data: bytes, sigma: float | None, fmt: str = "png") -> tuple[bytes, dict]:
    """The gateway's float path for a one-window image: decode, float tensors to Triton (``max_batch_size`` items
    per call), encode."""
    planes, used = prepare.denoiser_planes(data, wire.DEFAULT_MAX_PIXELS, sigma, card.input.min_size,
                                           wire.DEFAULT_MAX_ASPECT_RATIO, sigma_max=card.sigma.max)
    batch = images.to_graph(prepare.to_batch(planes.data, card.input), card.input)
    out = np.empty_like(batch)
    for i in range(0, len(batch), 4):
        x = batch[i:i + 4]
        level = np.full((len(x), 1), used.value * 255.0 / card.sigma.scale, np.float32)
        res = client.infer(DENOISER, [tensor(grpcclient, card.input.name, np.ascontiguousarray(x)),
                                      tensor(grpcclient, card.sigma.input, level)],
                           outputs=outputs(grpcclient, card.output))
        out[i:i + 4] = res.as_numpy(card.output)
    info = {"sigma_used": used.value * 255.0, "sigma_reliable": used.reliable, "sigma_rule": used.rule,
            "sigma_residual": images.removed_noise_sigma(batch, out, card.input)}
    return prepare.encode_result(out, planes, card.input, fmt), info


def image_denoise(client, mod, data: bytes | list[bytes], sigma: float | None = None, fmt: str | None = None,
                  card: ModelCard | None = None) -> list[tuple[bytes, dict]]:
    blobs = data if isinstance(data, list) else [data]
    ins = [tensor(mod, wire.IMAGE_BYTES, files(*blobs))]
    if sigma is not None:
        assert card is not None
        ins.append(tensor(mod, card.sigma.input, np.full((len(blobs), 1), sigma / card.sigma.scale, np.float32)))
    if fmt is not None:
        ins.append(tensor(mod, wire.FORMAT, col(wire.code_of(wire.FORMAT_CODES, fmt), np.int32)))
    res = client.infer(DENOISER, ins, outputs=outputs(mod, wire.ENCODED, wire.IMAGE_INFO))
    infos = [wire.read_info(r) for r in res.as_numpy(wire.IMAGE_INFO)]
    return [(wire.encoded_file(r, info), info) for r, info in zip(res.as_numpy(wire.ENCODED), infos, strict=True)]


# ------------------------------------------------------------------------------------------------------- tests


def test_limits_are_the_gateways_and_travel_in_the_config(server, grpc) -> None:
    s = Settings()  # the gateway's defaults are wire's (one source), and the model's config carries them
    for model in (CLASSIFIER, DENOISER):
        params = grpc.get_model_config(model, as_json=True)["config"]["parameters"]
        assert int(params[wire.MAX_PIXELS_KEY]["string_value"]) == s.max_pixels
        assert float(params[wire.MAX_ASPECT_RATIO_KEY]["string_value"]) == s.max_aspect_ratio


def test_wire_error_and_accept_helpers() -> None:
    text = "Triton rejected inference on m: [400] " + wire.format_error(413, "image_too_large", "image is 9×9")
    assert wire.parse_error(text) == wire.WireError(413, "image_too_large", "image is 9×9")
    assert wire.parse_error("BadInput: missing required input 'sigma'") is None
    assert [wire.padded_length(n) for n in (0, 1, 256, 257, 300, 65536, 65537, 200_000)] == \
        [256, 256, 256, 512, 512, 65536, 131072, 262144]
    for accept, fmt in {None: "png", "": "png", "*/*": "png", "image/*": "png", "image/png": "png",
                        "image/tiff": "tiff", "application/x-npy": "npy", "text/html, image/tiff;q=0.9": "tiff",
                        "image/png;q=0.5, application/x-npy": "npy", "text/html": None, "image/tiff;q=0": None,
                        "image/jpeg, */*;q=0.1": "png"}.items():
        assert wire.media_format(accept) == fmt, accept


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_classifier_answers_as_the_float_path(http, grpc, cards, digits: np.ndarray, fmt: str) -> None:
    card = cards[CLASSIFIER]
    for client, mod in ((http, httpclient), (grpc, grpcclient)):
        for i, digit in enumerate(digits[:3]):
            data = encode(Image.fromarray(digit), fmt)
            x, inverted = classifier_feed(data, card)
            want = float_logits(client, mod, card, x)
            res = client.infer(CLASSIFIER, [tensor(mod, wire.IMAGE_BYTES, files(data))],
                               outputs=outputs(mod, card.output, wire.IMAGE_INFO))
            np.testing.assert_allclose(res.as_numpy(card.output), want, rtol=0, atol=TOL)
            assert wire.read_info(res.as_numpy(wire.IMAGE_INFO)[0]) == {"inverted": inverted}
            if i == 0:  # λ and invert through their inputs
                x, inverted = classifier_feed(data, card, "true")
                want = float_logits(client, mod, card, x, lam=0.3)
                res = client.infer(CLASSIFIER, [tensor(mod, wire.IMAGE_BYTES, files(data)),
                                                tensor(mod, card.lam.input, col(0.3, np.float32)),
                                                tensor(mod, wire.INVERT, col(1, np.int32))],
                                   outputs=outputs(mod, card.output, wire.IMAGE_INFO))
                np.testing.assert_allclose(res.as_numpy(card.output), want, rtol=0, atol=TOL)
                assert inverted and wire.read_info(res.as_numpy(wire.IMAGE_INFO)[0]) == {"inverted": True}


def test_a_batch_of_files_of_every_format_in_one_call(grpc, cards, digits: np.ndarray) -> None:
    """Five files of different formats and lengths (rows zero-padded) in one request, one answer per file; the
    classification extension still labels them."""
    card = cards[CLASSIFIER]
    big = Image.fromarray(digits[0]).resize((56, 42))
    blobs = [encode(Image.fromarray(digits[1]), "PNG"), encode(Image.fromarray(digits[2]), "JPEG", quality=95),
             encode(Image.fromarray(digits[3]).convert("RGB"), "WEBP", lossless=True),
             encode(Image.fromarray(digits[4]), "TIFF"), encode(big, "BMP")]
    assert len({len(b) for b in blobs}) == len(blobs)
    want = np.concatenate([float_logits(grpc, grpcclient, card, classifier_feed(b, card)[0]) for b in blobs])
    res = grpc.infer(CLASSIFIER, [tensor(grpcclient, wire.IMAGE_BYTES, files(*blobs))],
                     outputs=outputs(grpcclient, card.output))
    np.testing.assert_allclose(res.as_numpy(card.output), want, rtol=0, atol=TOL)
    labelled = grpc.infer(CLASSIFIER, [tensor(grpcclient, wire.IMAGE_BYTES, files(*blobs))],
                          outputs=[grpcclient.InferRequestedOutput(card.output, class_count=1)])
    top = [int(e.decode().split(":")[1]) for e in labelled.as_numpy(card.output).reshape(-1)]
    assert top == [int(np.argmax(r)) for r in want]


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_denoiser_answers_the_gateways_file(http, grpc, cards, noisy: np.ndarray, fmt: str) -> None:
    card = cards[DENOISER]
    gray = encode(Image.fromarray(noisy), fmt)
    rgb = encode(Image.fromarray(np.stack([noisy, noisy[::-1], noisy[:, ::-1]], -1)), fmt)
    for client, mod in ((http, httpclient), (grpc, grpcclient)):
        for data in (gray, rgb):
            for sigma in (25.0, None):
                want, want_info = float_denoise(grpc, card, data, sigma)
                ((got, info),) = image_denoise(client, mod, data, sigma, card=card)
                assert got == want  # the same code on the same numbers: the same file
                assert info["sigma_estimated"] is (sigma is None) and info["encoded_bytes"] == len(got)
                assert info["sigma_used"] == pytest.approx(want_info["sigma_used"], abs=1e-6)
                assert info["sigma_reliable"] is want_info["sigma_reliable"]
                assert info["sigma_rule"] == want_info["sigma_rule"]
                assert info["sigma_residual"] == pytest.approx(want_info["sigma_residual"], rel=1e-5)
    # a batch: both files in one call, each its own answer
    both = image_denoise(grpc, grpcclient, [gray, rgb], 25.0, card=card)
    assert [b[0] for b in both] == [float_denoise(grpc, card, d, 25.0)[0] for d in (gray, rgb)]


def test_denoiser_formats(grpc, cards, noisy: np.ndarray) -> None:
    card = cards[DENOISER]
    data = encode(Image.fromarray(noisy))
    ((png, _),) = image_denoise(grpc, grpcclient, data, 25.0, card=card)
    ((tiff, _),) = image_denoise(grpc, grpcclient, data, 25.0, "tiff", card=card)
    ((npy, _),) = image_denoise(grpc, grpcclient, data, 25.0, "npy", card=card)
    pixels = np.asarray(Image.open(io.BytesIO(png)))
    with Image.open(io.BytesIO(tiff)) as t:
        assert t.format == "TIFF" and np.array_equal(np.asarray(t), pixels)
    arr = np.load(io.BytesIO(npy), allow_pickle=False)
    assert arr.dtype == np.uint8 and np.array_equal(arr, pixels)
    assert tiff == float_denoise(grpc, card, data, 25.0, "tiff")[0]


def test_denoiser_tiles_a_large_image(grpc, cards) -> None:
    """An image larger than the card's tiling window runs in windows inside the model: the gateway's result."""
    from unroll.data import add_noise, bundled_image, noise_seed
    from unroll.tiling import Tiler, run_tiled

    card = cards[DENOISER]
    clean = np.tile(bundled_image("camera"), (2, 2))[:601, :517]
    noisy8 = np.rint(np.clip(add_noise(clean, 25.0, noise_seed("camera", 25.0)), 0, 1) * 255).astype(np.uint8)
    assert Tiler(*noisy8.shape, card.tiling).needed
    data = encode(Image.fromarray(noisy8))
    planes, used = prepare.denoiser_planes(data, wire.DEFAULT_MAX_PIXELS, 25.0, card.input.min_size)
    batch = images.to_graph(prepare.to_batch(planes.data, card.input), card.input)

    def run(x: np.ndarray, extra: dict[str, np.ndarray]) -> np.ndarray:
        level = extra[card.sigma.input].reshape(-1, 1)
        res = grpc.infer(DENOISER, [tensor(grpcclient, card.input.name, np.ascontiguousarray(x)),
                                    tensor(grpcclient, card.sigma.input, level)])
        return res.as_numpy(card.output)

    sig = np.full(len(batch), used.value * 255.0 / card.sigma.scale, np.float32)
    want = prepare.encode_result(run_tiled(batch, {card.sigma.input: sig}, run, card.tiling, 4), planes, card.input)
    ((got, _),) = image_denoise(grpc, grpcclient, data, 25.0, card=card)
    assert got == want


def _rejected(client, model: str, inputs: list, mod=grpcclient) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        client.infer(model, inputs)
    status = info.value.status()
    assert status in ("400", "StatusCode.INVALID_ARGUMENT"), (status, str(info.value))
    return info.value


def test_each_limit_is_invalid_arg_with_the_gateways_code(http, grpc, cards) -> None:
    bomb = encode(Image.new("L", (2100, 2100)))  # 4.41 Mpx > 2048²: refused from its header
    huge = encode(Image.new("1", (3000, 3000)))  # over twice the limit: Pillow's own bomb guard
    cases = {
        "pixel bomb": (bomb, 413, "image_too_large"),
        "decompression bomb": (huge, 413, "image_too_large"),
        "aspect": (encode(Image.new("L", (40, 1300))), 422, "aspect_ratio_too_large"),
        "not an image": (b"definitely not an image", 400, "invalid_image"),
        "truncated": (encode(Image.new("L", (64, 64), 7))[:60], 400, "invalid_image"),
        "GIF": (encode(Image.new("L", (32, 32)), "GIF"), 415, "unsupported_media_type"),
        "float image": (encode(Image.new("F", (32, 32)), "TIFF"), 415, "unsupported_image_mode"),
    }
    for model in (CLASSIFIER, DENOISER):
        for what, (data, status, code) in cases.items():
            for client, mod in ((http, httpclient), (grpc, grpcclient)):
                if what == "float image" and model == CLASSIFIER:
                    continue  # the classifier reads float TIFFs as Pillow's L conversion
                e = _rejected(client, model, [tensor(mod, wire.IMAGE_BYTES, files(data))], mod)
                found = wire.parse_error(e.message())
                assert found is not None and (found.status, found.code) == (status, code), (model, what, str(e))
    small = encode(Image.new("L", (12, 40)))
    found = wire.parse_error(_rejected(grpc, DENOISER, [tensor(grpcclient, wire.IMAGE_BYTES, files(small))]).message())
    assert (found.status, found.code) == (422, "image_too_small") and "16" in found.message
    # both inputs, or neither: INVALID_ARG naming both
    digit = encode(Image.new("L", (28, 28)))
    x = np.zeros((1, 1, 28, 28), np.float32)
    for inputs in ([tensor(grpcclient, wire.IMAGE_BYTES, files(digit)), tensor(grpcclient, "image", x)],
                   [tensor(grpcclient, "lam", col(0.1, np.float32))]):
        e = _rejected(grpc, CLASSIFIER, inputs)
        assert wire.IMAGE_BYTES in e.message() and "'image'" in e.message(), e.message()
    # bad codes
    for name, model in ((wire.INVERT, CLASSIFIER), (wire.FORMAT, DENOISER)):
        e = _rejected(grpc, model, [tensor(grpcclient, wire.IMAGE_BYTES, files(encode(Image.new("L", (28, 28))))),
                                    tensor(grpcclient, name, col(7, np.int32))])
        assert wire.parse_error(e.message()).code == "invalid_parameter", e.message()
    assert grpc.is_server_ready()


def test_a_bad_image_fails_only_its_own_request(server, cards, digits: np.ndarray) -> None:
    card = cards[CLASSIFIER]
    good = encode(Image.fromarray(digits[0]))
    results: dict[int, object] = {}
    done = threading.Semaphore(0)
    clients = [grpcclient.InferenceServerClient(server.grpc_url) for _ in range(4)]
    blobs = [good if i % 2 else b"junk" for i in range(16)]

    def callback(i: int):
        def cb(result, error) -> None:
            results[i] = error if error is not None else result.as_numpy(card.output)
            done.release()
        return cb

    for i, blob in enumerate(blobs):
        clients[i % 4].async_infer(CLASSIFIER, [tensor(grpcclient, wire.IMAGE_BYTES, files(blob))], callback(i),
                                   outputs=outputs(grpcclient, card.output))
    for _ in blobs:
        assert done.acquire(timeout=60)
    want = float_logits(clients[0], grpcclient, card, classifier_feed(good, card)[0])
    for i, r in results.items():
        if i % 2:
            np.testing.assert_allclose(r, want, rtol=0, atol=TOL)
        else:
            assert isinstance(r, InferenceServerException) and "[400 invalid_image]" in str(r), r


def test_outputs_not_requested_are_not_computed(grpc, cards, noisy: np.ndarray, digits: np.ndarray) -> None:
    card = cards[DENOISER]
    data = encode(Image.fromarray(noisy))
    res = grpc.infer(DENOISER, [tensor(grpcclient, wire.IMAGE_BYTES, files(data))],
                     outputs=outputs(grpcclient, wire.IMAGE_INFO))
    assert [o.name for o in res.get_response().outputs] == [wire.IMAGE_INFO]
    info = wire.read_info(res.as_numpy(wire.IMAGE_INFO)[0])
    assert "encoded_bytes" not in info and info["sigma_estimated"]  # σ estimated, the graph never ran
    res = grpc.infer(CLASSIFIER, [tensor(grpcclient, wire.IMAGE_BYTES, files(encode(Image.fromarray(digits[0]))))],
                     outputs=outputs(grpcclient, cards[CLASSIFIER].output))
    assert [o.name for o in res.get_response().outputs] == [cards[CLASSIFIER].output]
    # a float-tensor client asking for nothing gets the graph's outputs and an empty image_info ({}: nothing decoded)
    res = grpc.infer(DENOISER, [tensor(grpcclient, card.input.name, np.zeros((2, 1, 32, 32), np.float32)),
                                tensor(grpcclient, card.sigma.input, np.full((2, 1), 0.1, np.float32))])
    assert [o.name for o in res.get_response().outputs] == [card.output, wire.IMAGE_INFO]
    assert [wire.read_info(r) for r in res.as_numpy(wire.IMAGE_INFO)] == [{}, {}]
    res = grpc.infer(DENOISER, [tensor(grpcclient, card.input.name, np.zeros((1, 1, 32, 32), np.float32)),
                                tensor(grpcclient, card.sigma.input, col(0.1, np.float32))],
                     outputs=outputs(grpcclient, card.output))
    assert [o.name for o in res.get_response().outputs] == [card.output]


# ------------------------------------------------------------------------------------------- through the gateway


@pytest.fixture(scope="module")
def gateway(demo_gateway: httpx.Client) -> httpx.Client:
    """The session's gateway (default settings) in front of ``server``."""
    return demo_gateway


def _inferences(server, model: str) -> int:
    stats = httpx.get(f"http://{server.url}/v2/models/{model}/stats").json()
    return int(stats["model_stats"][0]["inference_count"])


def test_gateway_forwards_bytes_and_honours_accept(server, gateway: httpx.Client, grpc, cards,
                                                   noisy: np.ndarray) -> None:
    card = cards[DENOISER]
    rgb = encode(Image.fromarray(np.stack([noisy, noisy[::-1], noisy[:, ::-1]], -1)))
    before = _inferences(server, DENOISER)
    r = gateway.post(f"/v1/denoise?model={DENOISER}&sigma=25", content=rgb, headers={"Content-Type": "image/png"})
    assert r.status_code == 200 and r.headers["content-type"] == "image/png", r.text
    # one request with the file (the float path sends the three channels as three items)
    assert _inferences(server, DENOISER) - before == 1
    assert r.content == float_denoise(grpc, card, rgb, 25.0)[0]
    assert r.headers["X-Sigma-Used"] == "25.000" and r.headers["X-Sigma-Estimated"] == "false"
    for accept, media in (("image/tiff", "image/tiff"), ("application/x-npy", "application/x-npy"),
                          ("*/*", "image/png"), ("image/webp;q=1, image/tiff;q=0.5", "image/tiff")):
        r = gateway.post(f"/v1/denoise?model={DENOISER}", content=rgb,
                         headers={"Content-Type": "image/png", "Accept": accept})
        assert r.status_code == 200 and r.headers["content-type"] == media, (accept, r.status_code, r.text[:300])
        assert r.headers["X-Sigma-Estimated"] == "true"
    r = gateway.post(f"/v1/denoise?model={DENOISER}", content=rgb,
                     headers={"Content-Type": "image/png", "Accept": "application/x-npy"})
    arr = np.load(io.BytesIO(r.content), allow_pickle=False)
    assert arr.shape == (*noisy.shape, 3) and arr.dtype == np.uint8
    r = gateway.post(f"/v1/denoise?model={DENOISER}", content=rgb,
                     headers={"Content-Type": "image/png", "Accept": "image/jpeg"})
    assert r.status_code == 406 and r.json()["error"]["code"] == "not_acceptable", r.text
    # an error only the pixels show comes back as the gateway's own
    r = gateway.post(f"/v1/denoise?model={DENOISER}", content=rgb[:200], headers={"Content-Type": "image/png"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_image", r.text
    r = gateway.post(f"/v1/classify?model={CLASSIFIER}", content=rgb[:200], headers={"Content-Type": "image/png"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_image", r.text


# ------------------------------------------------------------------------------------------------- the configs


def test_the_protocol_is_in_cpu_configs_only_and_validated(demo_onnx_dir: Path, tmp_path: Path) -> None:
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    from unroll.serving.repository import RepositoryError
    from unroll.serving.repository_check import validate_model

    def cfg(path: Path) -> mc.ModelConfig:
        return text_format.Parse(path.read_text(), mc.ModelConfig())

    write_repository("cpu", [CLASSIFIER, DENOISER], tmp_path / "cpu", onnx_dir=demo_onnx_dir)
    write_repository("gpu", [CLASSIFIER, DENOISER], tmp_path / "gpu", onnx_dir=demo_onnx_dir)
    for model, extra_in, extra_out in ((CLASSIFIER, [wire.INVERT], [wire.IMAGE_INFO]),
                                       (DENOISER, [wire.FORMAT], [wire.ENCODED, wire.IMAGE_INFO])):
        c = cfg(tmp_path / "cpu" / model / "config.pbtxt")
        ins = {i.name: i for i in c.input}
        assert [i for i in ins if i in wire.NAMES] == [wire.IMAGE_BYTES, *extra_in]
        assert [o.name for o in c.output if o.name in wire.NAMES] == extra_out
        assert all(ins[n].optional for n in (wire.IMAGE_BYTES, *extra_in))
        assert mc.DataType.Name(ins[wire.IMAGE_BYTES].data_type) == "TYPE_UINT8" and list(ins[wire.IMAGE_BYTES].dims) \
            == [-1]
        assert ins["image" if model == CLASSIFIER else "noisy"].optional  # the float input: one of the two
        assert not any(w.inputs.get(wire.IMAGE_BYTES) for w in c.model_warmup)
        g = cfg(tmp_path / "gpu" / model / "config.pbtxt")
        assert not {i.name for i in g.input} & set(wire.NAMES) and wire.MAX_PIXELS_KEY not in g.parameters
    path = tmp_path / "cpu" / DENOISER / "config.pbtxt"
    text = path.read_text()
    at = text.index(f'name: "{wire.IMAGE_BYTES}"')
    path.write_text(text[:at] + text[at:].replace("TYPE_UINT8", "TYPE_STRING", 1))
    with pytest.raises(RepositoryError, match=wire.IMAGE_BYTES):
        validate_model(tmp_path / "cpu" / DENOISER)
