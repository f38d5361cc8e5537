"""An AOTInductor package (``export/aoti.py``) as a CPU session: the ``aotinductor`` runtime of
:func:`unroll.serving.runtimes.open_session`, with the same call (``run(feeds) -> outputs``, ``.runtime``,
``.inputs``).

The package is compiled C++ that trusts its caller: it does not check its inputs' dtype, shapes or ranges, and a
batch that differs between inputs reads past a buffer. So the session checks every call against the sidecar
``NAME.json`` written with it (names in call order, dims, shared axes, ranges), as ONNX Runtime checks against its
graph. Its kernels take their thread count from the calling thread's OpenMP setting (compiled with
``cpp.dynamic_threads``), which is set on every call: Triton and the benchmarks may call from any thread.
PyTorch is imported only when a session is opened.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np

from unroll.errors import ServingError
from unroll.serving.runtimes import Session


def aoti_session(path: str | Path, threads: int) -> Session:
    """A :data:`~unroll.serving.runtimes.Session` running the AOTInductor package at ``path`` (``X.pt2``, with
    ``X.json`` beside it) on ``threads`` threads; calls are serialised (one package instance, one lock)."""
    import torch
    import torch._inductor

    path = Path(path)
    meta = json.loads(path.with_suffix(".json").read_text())  # (unroll.export.aoti.read_sidecar: another layer)
    if meta["torch"] != torch.__version__:
        raise ServingError(f"{path} was compiled by PyTorch {meta['torch']} and runs only on it, not on "
                           f"{torch.__version__}: compile it again here (unroll.export.aoti.compile_package)")
    dims: dict[str, list[int | None]] = meta["inputs"]
    axes = {k: {int(i): n for i, n in a.items()} for k, a in meta["axes"].items()}
    ranges, outputs = meta["ranges"], meta["outputs"]
    torch.set_num_threads(threads)
    compiled = torch._inductor.aoti_load_package(str(path))
    lock = threading.Lock()

    def check(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        extra, missing = feeds.keys() - dims.keys(), dims.keys() - feeds.keys()
        if extra or missing:
            raise ValueError(f"{'unknown' if extra else 'missing'} input(s) {sorted(extra or missing)}; the graph's "
                             f"inputs are {sorted(dims)}")
        sizes: dict[str, int] = {}
        for k, want in dims.items():
            a = feeds[k]
            if a.dtype != np.float32 or a.ndim != len(want):
                raise ValueError(f"input {k!r}: float32 with {len(want)} dims expected, got {a.dtype} {a.shape}")
            for i, (n, w) in enumerate(zip(a.shape, want, strict=True)):
                if w is not None and n != w:
                    raise ValueError(f"input {k!r}: dim {i} is {n}, the graph's is {w}")
                if w is None and sizes.setdefault(axes[k][i], n) != n:
                    raise ValueError(f"input {k!r}: {axes[k][i]} {n} differs from the other inputs' "
                                     f"{sizes[axes[k][i]]}")
        for name, n in sizes.items():
            lo, hi = ranges[name]
            if n < lo or (hi is not None and n > hi):
                raise ValueError(f"{name} {n} outside the package's range {lo}…{'' if hi is None else hi}")
        return [np.require(feeds[k], requirements=["C", "W"]) for k in dims]  # (torch wants writable memory)

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        args = [torch.from_numpy(a) for a in check(feeds)]
        with lock, torch.inference_mode():
            torch.set_num_threads(threads)  # the calling thread's OpenMP setting
            got = compiled(*args)
        got = [got] if isinstance(got, torch.Tensor) else list(got)
        return {name: np.ascontiguousarray(t.numpy()) for name, t in zip(outputs, got, strict=True)}

    run.runtime = "aotinductor"  # type: ignore[attr-defined]
    run.inputs = {k: list(v) for k, v in dims.items()}  # type: ignore[attr-defined]
    return run
