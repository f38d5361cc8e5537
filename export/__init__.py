"""The export stage: fused static ONNX (``onnx_export``), quantization (``quantize``), gates, fusing third-party
graphs (``fuse``) and TensorRT engines (``trt_build``).

``unroll.export.export(module, card, example_inputs)`` is the one public way to export a model; it is loaded
lazily because the exporter pulls in torch, onnx and onnxruntime.
"""

from __future__ import annotations

from typing import Any

_LAZY = {"export", "export_model", "ExportError", "ExportResult"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from unroll.export import onnx_export

        return getattr(onnx_export, name)
    raise AttributeError(f"module 'unroll.export' has no attribute {name!r}")
