"""One error hierarchy: every error unroll raises on purpose derives from :class:`UnrollError`.

Each stage has its own subclass, so a caller can catch one stage's failures, and the two places that turn
errors into answers do it once: the CLI (``unroll.app.errors``: one line on stderr, ``exit_code``) and the
gateway (``unroll.serving.gateway.errors``: JSON ``{"error": {"code", "message"}}`` with ``http_status``).
Where a stage's error is also a builtin error that callers catch (``ValueError``, ``KeyError``), it derives from
both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path


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


class HttpError(UnrollError):
    """A load-engine request that got no HTTP answer; :attr:`cause` says how (``connect``, ``timeout``,
    ``disconnected``)."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(f"{cause}: {detail}")
        self.cause = cause


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


# ---------------------------------------- raised in unroll


class UnknownDimError(UsageError, ValueError):
    """A dim range names no dynamic axis of the graph; the message lists the names that exist."""


class RecipeError(TrainError, ValueError):
    """A model has no recipe, or a recipe option is unknown or malformed (the message lists the valid ones)."""


class UnknownName(UsageError, KeyError):
    """An option or a card names something no table holds (a dataset, a corruption); a KeyError too."""

    code = "unknown_name"

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class UnknownTask(UnknownName):
    """A card or an option names a task nobody registered."""

    code = "unknown_task"


class CheckpointError(UsageError, ValueError):
    """A checkpoint file that holds no state dict, or one that does not fit the architecture it is loaded into."""

    code = "bad_checkpoint"


# ---------------------------------------- raised in unroll.export


class MemoryBudgetError(BuildError, ValueError):
    """The estimate exceeds the memory available to the build; the message says by how much and what to lower."""


class LintError(BuildError, ValueError):
    """A graph failed the lint, so TensorRT was not run; ``issues`` holds every issue (or its line). The message is
    the caller's: :func:`unroll.export.trt_lint.lint_failure` words the usual one."""

    def __init__(self, message: str, issues: list) -> None:
        self.issues = issues
        super().__init__(message)


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


class GateFailed(QuantizeError):
    """The quantized model missed its accuracy gate (the report says by how much)."""


class FuseError(ExportError, ValueError):
    """The graph cannot be fused safely (unreadable, or the rewrite changed its outputs); nothing is written."""


# ---------------------------------------- raised in unroll.serving


class BadInput(UsageError, ValueError):
    """A request the model cannot take (Triton's INVALID_ARG: HTTP 400), as opposed to a failure while running."""


class ImageRejected(BadInput):
    """A client error of the encoded-image path, worded ``[STATUS CODE] message`` (:meth:`wire_text`; the gateway reads
    it back with :func:`unroll.serving.imaging.wire.parse_error`)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(self.wire_text(status, code, message))

    @staticmethod
    def wire_text(status: int, code: str, message: str) -> str:
        """``[413 image_too_large] message``: the text of an ``INVALID_ARG`` the gateway maps back to its 4xx."""
        return f"[{status} {code}] {message}"


class TritonStartError(ServingError):
    """The server binary is missing, could not start, or a model did not load (message has Triton's reason).

    ``reason`` is the short form (one line per failed model) for command-line output; the message
    adds the tail of the log at ``log_path``. ``crashed``: the server was killed by a signal while starting, no
    model refused (a crash, not a refusal such as a bad config): it may be retried.
    """

    def __init__(self, message: str, reason: str | None = None, log_path: Path | None = None,
                 crashed: bool = False) -> None:
        super().__init__(message)
        self.reason = reason or message.splitlines()[0]
        self.log_path = log_path
        self.crashed = crashed


class ProfileError(BuildError, ValueError):
    """A profile is malformed (the message names where it came from and what is wrong)."""


class TritonError(ServingError):
    """Base of the errors the gateway maps to 5xx responses (by their ``http_status`` and ``code``)."""

    http_status = 502
    code = "triton_error"


class TritonUnavailable(TritonError):
    """Triton cannot be reached, or the model is not loaded/ready (→ 503 with Retry-After)."""

    http_status = 503
    code = "triton_unavailable"


class TritonTimeout(TritonError):
    """Triton did not answer within the deadline (→ 504)."""

    http_status = 504
    code = "triton_timeout"


class TritonRejected(TritonError):
    """Triton answered this request with an error (→ 502, Triton's message kept)."""


class SettingsError(UsageError, ValueError):
    """Invalid settings; the message names each offending ``UNROLL_*`` variable and the value it got."""


class Refusal(UnrollError):
    """A request refused by the HTTP layer, before the app: status, stable code, message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.http_status = status


class GatewayStartError(ServingError):
    """The gateway process exited, or a server did not answer in time; the message holds the end of its log."""


class RuntimeUnavailable(ServingError):
    """The requested CPU runtime is not installed (or not a known runtime)."""


# ---------------------------------------- raised in unroll.pipeline


class DeployError(ServingError):
    """The new version was refused or could not be loaded; the model serves what it served before."""


# ---------------------------------------- raised in unroll.benchmarks


class PerfAnalyzerError(BenchError):
    """``perf_analyzer`` is missing, failed, or wrote no report; the message says which (and how to set it up)."""


class OptimizeError(BenchError):
    """``unroll optimize`` cannot run as asked (no such model, no GPU for ``--target gpu``); the message says why."""


class NoCuda(BenchError):
    """CUDA cannot be used here (the message says why): nothing is measured and nothing is written."""


class NothingMeasured(BenchError):
    """Every planned row was skipped or failed: the committed results are left as they are."""


class BudgetExceeded(BenchError, TimeoutError):
    """Raised (by an alarm) in the candidate that is building or running when the run's time budget ends."""


class NoModel(BenchError, LookupError):
    """The registry has no model a benchmark needs (e.g. no trained denoiser); the message says which."""


class ClientBound(BenchError):
    """``unroll profile``: the load client could not send at the offered rate (its sends fell behind schedule beyond
    the tolerance); the level is not reported as if offered."""


class SloMissed(BenchError):
    """``unroll profile``: the objective is already missed at the lowest rate or concurrency tried (the message says
    which percentile or error rate, by how much)."""


# ---------------------------------------- raised in unroll.app


class ServeError(ServingError):
    """A set-up step cannot be done; the message says what to do instead."""
