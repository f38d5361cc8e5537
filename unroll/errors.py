"""One error hierarchy: every error unroll raises on purpose derives from :class:`UnrollError`.

Each stage has its own subclass, so a caller can catch one stage's failures, and the two places that turn
errors into answers do it once: the CLI (``unroll.app.errors``: one line on stderr, ``exit_code``) and the
gateway (``unroll.serving.gateway.errors``: JSON ``{"error": {"code", "message"}}`` with ``http_status``).
Where a stage's error is also a builtin error that callers catch (``ValueError``, ``KeyError``), it derives from
both.
"""

from __future__ import annotations


class UnrollError(Exception):
    """Base of every deliberate unroll error: a message a user can act on, an exit code, an HTTP mapping."""

    #: process exit status when the CLI stops on this error
    exit_code: int = 1
    #: HTTP status when the gateway answers with this error
    http_status: int = 500
    #: stable snake_case code clients branch on
    code: str = "internal"


class UsageError(UnrollError):
    """The command line or a setting asks for something impossible (bad option value, unknown name)."""

    exit_code = 2
    http_status = 400
    code = "bad_request"


class CardError(UnrollError, ValueError):
    """A model card is missing, malformed or contradicts the graph it describes (a ValueError too)."""

    http_status = 422
    code = "invalid_card"


class RegistryError(UnrollError, KeyError):
    """No registered model (or architecture option) of that name; a KeyError too, for mapping-style callers."""

    http_status = 404
    code = "unknown_model"

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DataError(UnrollError):
    """A dataset, image or checkpoint file cannot be read as what it should be."""


class TrainError(UnrollError):
    """Training or evaluation cannot run as asked (recipe, options, weights)."""


class ExportError(UnrollError):
    """Export to ONNX failed or its parity check did not pass."""


class IterationsError(ExportError, ValueError):
    """A model's solver iteration count cannot be read or changed (no tied solver layer, untied steps, mixed
    counts): its graph cannot be exported with another count."""


class QuantizeError(ExportError):
    """FP16/INT8 conversion failed or a graph did not pass its card's accuracy gate."""


class BuildError(UnrollError):
    """A TensorRT plan could not be built (lint, profiles, memory, missing TensorRT)."""


class RepositoryError(UnrollError, ValueError):
    """The Triton model repository cannot be written or does not match its cards and artifacts (a ValueError too)."""


class PipelineError(UnrollError):
    """A stage's inputs are missing or a stage could not bring its artifacts up to date."""


class ServingError(UnrollError):
    """tritonserver or the gateway could not start, stay up or be reached."""

    http_status = 503
    code = "unavailable"


class BenchError(UnrollError):
    """A benchmark could not run or its results are not comparable."""


class ApiError(UnrollError):
    """A request a client must change, as it should see it: HTTP status, stable code, readable message, extra headers.

    Raised wherever a request is checked (the gateway's routes, the image checks the Triton backend shares with
    them), so the check and its answer are written once."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = self.http_status = status
        self.code = code
        self.message = message
        self.headers = headers or {}
