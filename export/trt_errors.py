"""The errors of ``unroll build`` (:mod:`unroll.export.trt_build`), in a module of their own so that the builder,
the engine runner and the shape helpers can all raise them without importing one another."""

from __future__ import annotations

from unroll.errors import BuildError
from unroll.export.trt_lint import LintError

#: LintError is re-exported: one class for the lint's refusals, here and in quantize.
__all__ = ["GateError", "LintError", "MissingOnnxError", "ProfileMemoryError", "TrtBuildError", "TrtUnavailableError"]


class TrtBuildError(BuildError):
    """The engine could not be built or checked; the message says why in one sentence (plus details)."""


class TrtUnavailableError(TrtBuildError):
    """No TensorRT or no CUDA GPU here: nothing to build with (the CLI exits 2 on this)."""

    exit_code = 2


class MissingOnnxError(TrtBuildError, FileNotFoundError):
    """The ONNX to build from is missing; the message names the command that writes it."""


class ProfileMemoryError(TrtBuildError):
    """The profile's estimated GPU memory (:mod:`unroll.export.trt_memory`) exceeds the budget; nothing was built."""


class GateError(TrtBuildError):
    """The engine disagrees with ONNX Runtime FP32 beyond its gate; the JSON was written, the plan was not."""

    def __init__(self, message: str, report: dict) -> None:
        super().__init__(message)
        self.report = report
