"""Where every artifact lives and how it is named, and what it was built from (content hashes).

The one place that spells the build layout: exported graphs and their reports (``build/onnx/NAME.onnx``,
``NAME.PRECISION.onnx``, ``.report.json``), TensorRT plans (``build/trt/NAME.PRECISION.plan`` + ``.json``), the
Triton repositories (``model_repository/``), the serving samples (``build/samples/``) and the container staging
(``build/image/``). Paths are relative to the working directory, as the CLI's defaults are.

A stage records in its report the hashes of what it was built from (:func:`built_from`: card, weights, upstream
graph, options); :func:`changed_inputs` compares such a record with the current hashes, which is the one
staleness rule of :mod:`unroll.pipeline` (content, not modification times). Core module: imports no stage.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from unroll.card import ModelCard
    from unroll.registry import ModelSpec

BUILD_DIR = Path("build")
ONNX_DIR = BUILD_DIR / "onnx"  #: ``unroll export`` / ``unroll quantize`` output
TRT_DIR = BUILD_DIR / "trt"  #: ``unroll build`` output
TIMING_CACHE = TRT_DIR / "timing.cache"  #: TensorRT's timing cache, shared by builds on one GPU
AOTI_DIR = BUILD_DIR / "aoti"  #: AOTInductor packages (``unroll optimize``'s PyTorch candidate)
#: ``unroll optimize``'s choices and evidence, read by ``unroll repo`` (``$UNROLL_OPTIMIZE_DIR`` moves it: the tests
#: point it at an empty folder, so a developer's own choices do not change what they serve)
OPTIMIZE_DIR = Path(os.environ.get("UNROLL_OPTIMIZE_DIR") or BUILD_DIR / "optimize")
SAMPLES_DIR = BUILD_DIR / "samples"  #: one sample input per served model (``unroll serve``'s banner)
IMAGE_DIR = BUILD_DIR / "image"  #: the container build context's generated part
REPOSITORY_DIR = Path("model_repository")  #: the Triton model repository ``unroll repo`` writes
GPU_REPOSITORY_DIR = Path("model_repository_gpu")  #: the GPU repository staged for the NGC image
#: Triton's log, rotated at each start (``unroll triton``; ``unroll serve`` writes it beside its graphs' folder)
TRITON_LOG = BUILD_DIR / "triton.log"
#: The warm standby's log (``unroll serve --standby``), beside :data:`TRITON_LOG`
TRITON_STANDBY_LOG = BUILD_DIR / "triton-standby.log"
#: The key of the Triton ``unroll serve`` runs (owner-only file, a new key each start), for ``unroll deploy``
TRITON_KEY = BUILD_DIR / "triton.key"
#: Where a running ``unroll serve`` says what it runs (its pid, Triton's ports, the repository), for ``unroll deploy``
SERVE_STATE = BUILD_DIR / "serve.json"
PRECISIONS = ("fp32", "fp16", "int8")
#: Each model's Triton configuration in a repository (:func:`model_config`).
TRITON_CONFIG = "config.pbtxt"
#: Benchmark results (``unroll bench``, ``unroll optimize``'s copies); ``unroll.benchmarks.common.RESULTS`` is
#: the same folder found from the package, for reading the committed ones from any working directory.
RESULTS_DIR = Path("benchmarks/results")
#: Written beside each model's ``config.pbtxt``: what the directory was written from (Triton ignores it).
REPOSITORY_SOURCE_FILE = "built_from.json"
#: The key of a stage report holding :func:`built_from`.
BUILT_FROM_KEY = "built_from"

REPORT_SUFFIX = ".report.json"


def graph(name: str, precision: str = "fp32", onnx_dir: str | Path = ONNX_DIR) -> Path:
    """The graph that carries ``precision``: ``NAME.onnx`` (fp32) or ``NAME.PRECISION.onnx`` (``unroll quantize``)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    return Path(onnx_dir) / (f"{name}.onnx" if precision == "fp32" else f"{name}.{precision}.onnx")


def report_of(path: str | Path) -> Path:
    """The report beside an artifact: ``X.onnx`` → ``X.report.json`` (``X.fp16.onnx`` → ``X.fp16.report.json``)."""
    path = Path(path)
    return path.with_name(path.name.removesuffix(path.suffix) + REPORT_SUFFIX)


def graph_report(name: str, precision: str = "fp32", onnx_dir: str | Path = ONNX_DIR) -> Path:
    """The report of :func:`graph` (export report for fp32, the quantization gate's report otherwise)."""
    return report_of(graph(name, precision, onnx_dir))


def aoti_package(name: str, aoti_dir: str | Path = AOTI_DIR) -> Path:
    """``build/aoti/NAME.pt2``: the AOTInductor package of a registered model (FP32, CPU)."""
    return Path(aoti_dir) / f"{name}.pt2"


def choice(name: str, target: str = "cpu", optimize_dir: str | Path | None = None) -> Path:
    """``build/optimize/NAME.TARGET.json``: what ``unroll optimize`` chose for ``name``, with its evidence."""
    return Path(OPTIMIZE_DIR if optimize_dir is None else optimize_dir) / f"{name}.{target}.json"


def plan(name: str, precision: str, plan_dir: str | Path = TRT_DIR) -> Path:
    """A TensorRT plan ``NAME.PRECISION.plan`` (``unroll build``)."""
    return Path(plan_dir) / f"{name}.{precision}.plan"


def plan_report(name: str, precision: str, plan_dir: str | Path = TRT_DIR) -> Path:
    """The JSON ``unroll build`` writes beside :func:`plan` (TensorRT version, GPU, profiles, checksums)."""
    return plan_json(plan(name, precision, plan_dir))


def plan_json(plan_path: str | Path) -> Path:
    """The JSON beside a plan file: ``X.plan`` → ``X.json``."""
    return Path(plan_path).with_suffix(".json")


def model_dir(name: str, repo: str | Path = REPOSITORY_DIR) -> Path:
    """One model's directory in a Triton repository."""
    return Path(repo) / name


def model_config(directory: str | Path) -> Path:
    """The ``config.pbtxt`` of a model's directory in a Triton repository."""
    return Path(directory) / TRITON_CONFIG


def sample(stem: str, suffix: str, samples_dir: str | Path = SAMPLES_DIR) -> Path:
    """A sample input file for the served model ``stem``."""
    return Path(samples_dir) / f"{stem}{suffix}"


# ------------------------------------------------------------------------------------------------ hashes

def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def sha256(path: str | Path) -> str:
    """Hex sha256 of a file's content, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_json(value: Any) -> str:
    """Hex sha256 of a JSON value in canonical form (sorted keys), e.g. a stage's options."""
    return sha256_bytes(json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode())


def built_from(*, card: ModelCard | None = None, weights: str | Path | None = None,
               upstream: str | Path | None = None, options: Mapping[str, Any] | None = None,
               **files: str | Path | None) -> dict[str, str | None]:
    """What an artifact is built from, as hashes: the card's JSON, the weights file, the upstream graph, the
    options and any other named ``files`` (``None`` for an input that is absent, e.g. no committed weights)."""
    out: dict[str, str | None] = {}
    if card is not None:
        out["card"] = sha256_bytes(card.to_json().encode())
    out["weights"] = sha256(weights) if weights is not None else None
    if upstream is not None:
        out["upstream"] = sha256(upstream)
    for k, v in files.items():
        out[k] = sha256(v) if v is not None else None
    out["options"] = sha256_json(dict(options or {}))
    return out


def export_inputs(spec: ModelSpec, *, card: ModelCard | None = None, checkpoint: str | Path | None = None,
                  iters: int | None = None, opset: int = 17, lam_input: bool | None = None) -> dict[str, str | None]:
    """:func:`built_from` of a registered model's export (and of its companions): its card (after any updates),
    the weights it loads (``checkpoint``, else the committed weights when there are any), the options that
    change the graph, and for a card declaring ``ood`` the rule its training record gives it (export puts it on the
    card: a new rule makes the export stale)."""
    card = card if card is not None else spec.card
    weights = checkpoint if checkpoint is not None else spec.weights_path if spec.has_weights else None
    rule = spec.info().get("ood") if card.ood is not None and checkpoint is None else None
    return built_from(card=card, weights=weights, options={"iters": iters, "opset": opset, "lam_input": lam_input,
                                                           **({"ood_rule": rule} if rule else {})})


def changed_inputs(recorded: Mapping[str, Any] | None, current: Mapping[str, Any],
                   absent_ok: tuple[str, ...] = ()) -> list[str]:
    """The inputs whose hash differs between a report's record and now ([] = up to date).

    ``recorded`` ``None`` (a report from before hashes were recorded) is ``["everything"]``. A key in
    ``absent_ok`` whose current value is ``None`` counts as unchanged: the input is not here to compare (a
    serving image has the exported graphs but not the weights they came from).
    """
    if not isinstance(recorded, Mapping):
        return ["everything (no input hashes recorded)"]
    return [k for k in sorted(set(recorded) | set(current))
            if recorded.get(k) != current.get(k) and not (k in absent_ok and current.get(k) is None)]


def read_json(path: str | Path) -> dict | None:
    """A JSON object from ``path``, or ``None`` when it is missing or not a JSON object."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
