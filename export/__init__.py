"""The export stage, installed as ``unroll.export``: fused static ONNX (``onnx_export``), quantization
(``quantize``), gates, fusing third-party graphs (``fuse``) and TensorRT engines (``trt_build``).

A stage: it imports the core (``unroll``: card, registry, models, tasks, artifacts, errors) and nothing of
``unroll.serving``, ``unroll.pipeline``, ``unroll.benchmarks`` or ``unroll.app`` (``tests/test_architecture.py``).

``unroll.export.export(module, card, example_inputs)`` is the one public way to export a model; it is loaded
lazily because the exporter pulls in torch, onnx and onnxruntime.
"""

from __future__ import annotations

from typing import Any

from unroll.errors import ExportError

__all__ = ["ExportError", "ExportResult", "export", "export_model"]
_LAZY = {"export", "export_model", "ExportResult"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from unroll.export import onnx_export  # local: it imports torch (module docstring)

        return getattr(onnx_export, name)
    raise AttributeError(f"module 'unroll.export' has no attribute {name!r}")
