"""What ``unroll profile`` sends, and where: the deployment read from the server itself, and the request bodies.

Three targets, one model each:

- ``v1``: the gateway's task route (``/v1/classify``, ``/v1/denoise`` …), the model and its task read from the
  gateway's ``GET /v1/models``; the body is an encoded image: the user's files, or the test images of the dataset
  the model's card names (where this package has it: ``inputs="card"``, the default when it can), or generated.
- ``v2``: the gateway's KServe v2 front (``/v2/models/NAME/infer``), the tensors from ``GET /v1/models`` (or the
  front's own metadata, for a model ``/v1`` does not route).
- ``triton``: Triton's own HTTP port (``/v2/models/NAME/infer``), or its gRPC port (a ``grpc://host:port`` URL:
  binary tensors on ``tritonclient.grpc.aio``), the tensors from Triton's model metadata and config.

Tensors are KServe v2 binary (JSON header + raw bytes, ``Inference-Header-Content-Length``) or JSON; a dynamic
first axis takes 1 (the batch), other dynamic axes ``--size``. Every failure to reach the server, to authenticate
or to find the model is a :class:`~unroll.errors.BenchError` in one line.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from unroll import tasks
from unroll.benchmarks.loadgen import Payload, Tensors, v2_infer
from unroll.errors import BenchError
from unroll.serving.triton import GRPC_HEADER_PREFIX, RESTRICTED_HEADER

TARGETS = ("v1", "v2", "triton")
IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".bmp": "image/bmp",
               ".tif": "image/tiff", ".tiff": "image/tiff", ".webp": "image/webp", ".pgm": "image/x-portable-graymap",
               ".ppm": "image/x-portable-pixmap"}
DTYPES = {"FP32": np.float32, "FP16": np.float16, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32,
          "INT16": np.int16, "INT8": np.int8, "UINT8": np.uint8, "UINT16": np.uint16, "BOOL": np.bool_}
#: Generated inputs: how many distinct bodies to cycle through (and at most this many of the card's test images).
GENERATED = 8
#: Side of generated inputs when no ``size`` is given.
DEFAULT_SIZE = 64
INPUTS = ("auto", "card", "generated")


@dataclass
class Deployment:
    """One model of a running deployment, as the profile found it, and the bodies to send it."""

    target: str
    url: str
    model: str
    headers: dict[str, str]  #: sent with every request (the API key)
    payloads: list[Payload]
    listing: dict[str, Any] | None = None  #: the gateway's ``GET /v1/models`` answer (``None``: Triton direct)
    metadata: dict[str, Any] = field(default_factory=dict)  #: the model's entry (or Triton's metadata + config)
    task: str | None = None
    inputs: str = ""  #: what is sent, in words


def key_headers(target: str, key: str | None, url: str = "") -> dict[str, str]:
    """The gateway's ``X-API-Key``, or Triton's restricted-API header for Triton direct (over gRPC under Triton's
    ``triton-grpc-protocol-`` prefix)."""
    if not key:
        return {}
    if target != "triton":
        return {"X-API-Key": key}
    return {(GRPC_HEADER_PREFIX if url.startswith("grpc://") else "") + RESTRICTED_HEADER: key}


def get_json(client: httpx.Client, path: str, what: str) -> tuple[int, Any]:
    """``GET path`` → (status, JSON or None); an unreachable server, a refused key, a timeout are one-line errors."""
    base = str(client.base_url).rstrip("/")
    try:
        r = client.get(path)
    except httpx.ConnectError:
        raise BenchError(f"cannot reach {base}: nothing answers there (is the {what} running?)") from None
    except httpx.TimeoutException:
        raise BenchError(f"{base} did not answer {path} within {client.timeout.read:g} s") from None
    except httpx.HTTPError as e:
        raise BenchError(f"cannot read {base}{path}: {type(e).__name__}: {e}") from None
    if r.status_code in (401, 403):
        raise BenchError(f"{base} refused the API key ({r.status_code}): pass the deployment's key with --key"
                         + (" (Triton direct: the key `unroll serve` wrote to build/triton.key)" if what == "Triton"
                            else ""))
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, None


def _served_models(listing: dict) -> list[dict]:
    return [m for m in listing.get("models", []) if isinstance(m, dict)]


def _not_served(model: str, names: list[str], where: str) -> BenchError:
    served = ", ".join(sorted(set(names))) or "none"
    return BenchError(f"{where} does not serve {model!r}; it serves: {served}")


def discover(target: str, url: str, model: str, key: str | None = None, images: Path | None = None,
             size: int | None = None, binary: bool = True, timeout_s: float = 10.0,
             inputs: str = "auto") -> Deployment:
    """Read the deployment at ``url`` and prepare the bodies for ``model`` on ``target``: ``images`` (a folder), else
    (``v1``) the card's test images (``inputs`` ``card``; ``auto``: when this package has them), else generated
    inputs of side ``size`` (card images are cropped to ``size`` where it is given)."""
    if target not in TARGETS:
        raise BenchError(f"unknown target {target!r}: one of {', '.join(TARGETS)}")
    if inputs not in INPUTS:
        raise BenchError(f"unknown inputs {inputs!r}: one of {', '.join(INPUTS)}")
    if inputs == "card" and target != "v1":
        raise BenchError("the card's test images are sent as images: --inputs card needs --target v1")
    url = url.rstrip("/")
    headers = key_headers(target, key, url)
    if url.startswith("grpc://"):
        if target != "triton":
            raise BenchError(f"{url}: a grpc:// URL is Triton's gRPC port: use it with --target triton")
        return _triton_grpc(url, model, headers, size or DEFAULT_SIZE)
    with httpx.Client(base_url=url, headers=headers, timeout=timeout_s) as client:
        if target == "triton":
            return _triton(client, url, model, headers, size or DEFAULT_SIZE, binary)
        status, listing = get_json(client, "/v1/models", "gateway")
        if status != 200 or not isinstance(listing, dict):
            raise BenchError(f"{url}/v1/models answered {status}: is {url} an unroll gateway? (Triton's own port: "
                             "--target triton)")
        models = _served_models(listing)
        entry = next((m for m in models if m.get("name") == model), None)
        if entry is None and target == "v2":  # the v2 front also serves models /v1 does not route (a λ rule …)
            status, meta = get_json(client, f"/v2/models/{model}", "gateway")
            entry = {"name": model, **meta} if status == 200 and isinstance(meta, dict) else None
        if entry is None:
            raise _not_served(model, [str(m.get("name")) for m in models], f"the gateway at {url}")
        if target == "v1":
            return _v1(url, model, headers, listing, entry, images, size, inputs)
        _, config = get_json(client, f"/v2/models/{model}/config", "gateway")
        feeds = _tensors(entry.get("inputs", []), size or DEFAULT_SIZE, input_defaults(config))
        return Deployment(target, url, model, headers, [v2_infer(model, feeds, binary=binary)], listing, entry,
                          entry.get("task"), _describe(feeds, binary))


def _v1(url: str, model: str, headers: dict[str, str], listing: dict, entry: dict, images: Path | None,
        size: int | None, inputs: str = "auto") -> Deployment:
    task = entry.get("task")
    try:
        route = tasks.get(str(task)).route
    except Exception:  # noqa: BLE001  (an unknown task: the message says so)
        route = None
    if route is None:
        raise BenchError(f"{model!r} is served for task {task!r}, which has no /v1 route here: use --target v2")
    path = f"/v1{route.path}?model={model}"
    if images is not None:
        bodies = read_images(images)
        what = f"{len(bodies)} image(s) from {images}"
    else:
        card = entry.get("card") or {}
        test = (card.get("data") or {}).get("test")
        found = card_images(test, size) if inputs != "generated" and test else None
        if found is None and inputs == "card":
            raise BenchError(f"{model}'s card names no test data this package has ({test!r}): send --images DIR")
        if found is not None:
            bodies, what = found
        else:
            side = size or DEFAULT_SIZE
            bodies = generated_images(card.get("input") or {}, side)
            what = f"{len(bodies)} generated {side}×{side} PNG(s)"
    payloads = [Payload(path, body, {"Content-Type": ctype}) for body, ctype in bodies]
    return Deployment("v1", url, model, headers, payloads, listing, entry, str(task), what)


def read_images(folder: Path) -> list[tuple[bytes, str]]:
    """Every image file in ``folder`` (by extension), as (bytes, content type), sorted by name."""
    folder = Path(folder)
    if not folder.is_dir():
        raise BenchError(f"--images {folder}: not a folder")
    found = [(p.read_bytes(), IMAGE_TYPES[p.suffix.lower()]) for p in sorted(folder.iterdir())
             if p.is_file() and p.suffix.lower() in IMAGE_TYPES]
    if not found:
        raise BenchError(f"--images {folder}: no image files there ({', '.join(sorted(IMAGE_TYPES))})")
    return found


def card_images(dataset_id: str, size: int | None, n: int = GENERATED) -> tuple[list[tuple[bytes, str]], str] | None:
    """The first ``n`` test images of the dataset a card names, as PNGs (where ``size`` is given: those at least that
    large, centre-cropped to ``size``²), with their description; ``None`` when this package does not have that
    dataset or none of its images is that large."""
    from PIL import Image

    from unroll.data import DATASETS

    ds = DATASETS.get(dataset_id)
    if ds is None:
        return None
    loaded = ds.load()
    arrays = [x.transpose(1, 2, 0) for x in loaded[0]] if ds.kind == "labelled" else list(loaded.values())
    out = []
    for a in arrays:
        a = np.asarray(a)
        a = a[..., 0] if a.ndim == 3 and a.shape[-1] == 1 else a
        if size is not None:
            if min(a.shape[:2]) < size:
                continue
            top, left = (a.shape[0] - size) // 2, (a.shape[1] - size) // 2
            a = a[top:top + size, left:left + size]
        if len(out) == n:
            break
        buf = io.BytesIO()
        Image.fromarray((np.clip(a, 0, 1) * 255).round().astype(np.uint8)).save(buf, "PNG")
        out.append((buf.getvalue(), "image/png"))
    if not out:
        return None
    shapes = sorted({f"{Image.open(io.BytesIO(b)).width}×{Image.open(io.BytesIO(b)).height}" for b, _ in out})
    return out, f"{len(out)} test image(s) of the card's {dataset_id} ({', '.join(shapes)} PNG)"


def generated_images(card_input: dict, size: int, n: int = GENERATED, seed: int = 0) -> list[tuple[bytes, str]]:
    """``n`` noisy ``size``×``size`` PNGs (a smooth gradient under uniform noise: not trivially compressible), grey
    or RGB as the card's input is."""
    from PIL import Image

    if size < 1:
        raise BenchError(f"--size must be at least 1, not {size}")
    rgb = card_input.get("colour") == "rgb" or (card_input.get("shape") or [1])[0] == 3
    rng = np.random.default_rng(seed)
    ramp = np.add.outer(np.arange(size), np.arange(size)) * (127.0 / max(1, 2 * size - 2))
    out = []
    for _ in range(n):
        shape = (size, size, 3) if rgb else (size, size)
        noise = rng.uniform(0, 128, shape)
        a = (noise + (ramp[..., None] if rgb else ramp)).clip(0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(a, "RGB" if rgb else "L").save(buf, "PNG")
        out.append((buf.getvalue(), "image/png"))
    return out


def _triton(client: httpx.Client, url: str, model: str, headers: dict[str, str], size: int,
            binary: bool) -> Deployment:
    status, meta = get_json(client, f"/v2/models/{model}", "Triton")
    if status != 200 or not isinstance(meta, dict):
        status_i, index = _index(client)
        names = [str(m.get("name")) for m in index if isinstance(m, dict) and m.get("state") == "READY"]
        if status_i != 200 and status == 404 and not names:
            raise BenchError(f"{url} answered 404 for /v2/models/{model}: is {url} Triton's HTTP port?")
        raise _not_served(model, names, f"Triton at {url}")
    _, config = get_json(client, f"/v2/models/{model}/config", "Triton")
    config = config if isinstance(config, dict) else {}
    optional = {i.get("name") for i in config.get("input", []) if i.get("optional")}
    inputs = [{**i, "optional": i.get("name") in optional} for i in meta.get("inputs", [])]
    feeds = _tensors(inputs, size, input_defaults(config))
    return Deployment("triton", url, model, headers, [v2_infer(model, feeds, binary=binary)], None,
                      {"metadata": meta, "config": config}, None, _describe(feeds, binary))


def _triton_grpc(url: str, model: str, headers: dict[str, str], size: int) -> Deployment:
    import tritonclient.grpc as grpcclient
    from google.protobuf.json_format import MessageToDict
    from tritonclient.utils import InferenceServerException

    address = url.removeprefix("grpc://")
    client = grpcclient.InferenceServerClient(address)

    def call(what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except InferenceServerException as e:
            status, text = str(e.status() or ""), str(e.message() or e)
            if "UNAVAILABLE" in status:
                raise BenchError(f"cannot reach {url}: nothing answers there (is Triton's gRPC port running?)") \
                    from None
            if "PERMISSION_DENIED" in status or "UNAUTHENTICATED" in status or "restricted" in text.lower():
                raise BenchError(f"{url} refused the API key: pass Triton's restricted-API key with --key (the key "
                                 "`unroll serve` wrote to build/triton.key)") from None
            if what == "metadata":
                return None
            raise BenchError(f"{url}: {what} of {model!r}: {text}") from None

    try:
        meta = call("metadata", lambda: client.get_model_metadata(model, headers=headers, as_json=True))
        if meta is None:
            index = call("the model index", lambda: client.get_model_repository_index(headers=headers, as_json=True))
            names = [str(m.get("name")) for m in index.get("models", []) if m.get("state") == "READY"]
            raise _not_served(model, names, f"Triton at {url}")
        config = call("the config", lambda: client.get_model_config(model, headers=headers)).config
    finally:
        client.close()
    optional = {i.name for i in config.input if i.optional}
    inputs = [{**i, "shape": [int(d) for d in i.get("shape", [])], "optional": i.get("name") in optional}
              for i in meta.get("inputs", [])]
    config_json = MessageToDict(config, preserving_proto_field_name=True)
    feeds = _tensors(inputs, size, input_defaults(config_json))
    return Deployment("triton", url, model, headers, [Tensors(model, feeds)], None,
                      {"metadata": meta, "config": config_json}, None, _describe(feeds, True) + " over gRPC")


def _index(client: httpx.Client) -> tuple[int, list]:
    try:
        r = client.post("/v2/repository/index", json={"ready": True})
        return r.status_code, r.json() if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError):
        return 0, []


def input_defaults(config: Any) -> set[str]:
    """The inputs a model config gives defaults to (``unroll``'s Python backend: its ``input_defaults`` parameter,
    e.g. λ), which a profile leaves out as a client would."""
    try:
        return set(json.loads(config["parameters"]["input_defaults"]["string_value"]))
    except (KeyError, TypeError, ValueError):
        return set()


def _tensors(inputs: list[dict], size: int, defaults: set[str] = frozenset(), seed: int = 0) -> dict[str, np.ndarray]:
    """Random tensors for the required inputs — where every input is optional (a model that also takes the encoded
    image), the tensor form's: all but the encoded-image protocol's and those with a default — a dynamic first axis
    1 (the batch), other dynamic axes ``size``; values in [0, 1) (integers: 0–255)."""
    from unroll.serving.imaging import wire

    required = [i for i in inputs if not i.get("optional")]
    if not required:
        required = [i for i in inputs if i.get("name") not in wire.INPUTS and i.get("name") not in defaults]
    if not required:
        raise BenchError("the model declares no input this profile can fill (only encoded image bytes): use --target "
                         "v1 to send images")
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in required:
        dt = DTYPES.get(str(i.get("datatype")))
        if dt is None:
            raise BenchError(f"input {i.get('name')!r} is {i.get('datatype')}: this profile cannot generate it")
        shape = [int(d) for d in i.get("shape", [])]
        shape = [(1 if k == 0 else size) if d < 0 else d for k, d in enumerate(shape)]  # a dynamic first axis: batch
        if np.issubdtype(dt, np.floating):
            a = rng.random(shape).astype(dt)
        elif dt is np.bool_:
            a = rng.random(shape) < 0.5
        else:
            a = rng.integers(0, 256 if dt is not np.int8 else 128, shape).astype(dt)
        feeds[str(i["name"])] = a
    return feeds


def _describe(feeds: dict[str, np.ndarray], binary: bool) -> str:
    parts = [f"{n} {a.dtype} {list(a.shape)}" for n, a in feeds.items()]
    return ", ".join(parts) + (" (binary tensors)" if binary else " (JSON tensors)")
