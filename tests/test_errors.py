"""One error hierarchy, mapped once: every exception class unroll defines derives from ``unroll.errors.UnrollError``;
the CLI turns any of them into one ``error:`` line and its exit code, the gateway into its JSON error with its
HTTP status."""

from __future__ import annotations

import ast
import importlib
import sys
import types
from pathlib import Path

import pytest
import typer
from fastapi import FastAPI
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from unroll.app.errors import handles_errors
from unroll.errors import (
    CardError,
    RegistryError,
    TritonRejected,
    TritonTimeout,
    TritonUnavailable,
    UnrollError,
    UsageError,
)
from unroll.serving.gateway import errors as gateway_errors
from unroll.serving.gateway.errors import ApiError

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"unroll": "unroll", "export": "unroll.export", "serving": "unroll.serving",
           "benchmarks": "unroll.benchmarks", "pipeline": "unroll.pipeline", "app": "unroll.app"}


def _exception_classes() -> list[tuple[str, str]]:
    """(module, class) for every top-level class of the package whose bases name an error or exception."""
    found = []
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            module = ".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts)))
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef) and any(
                        w in ast.unparse(b) for b in node.bases for w in ("Error", "Exception", "Unavailable",
                                                                           "Failed", "Refusal")):
                    found.append((module, node.name))
    return found


def test_every_exception_class_derives_from_unroll_error(monkeypatch) -> None:
    # the Triton Python backend's model imports Triton's own module, which only exists inside tritonserver
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    classes = _exception_classes()
    assert len(classes) > 20, classes
    outside = []
    for module, name in classes:
        cls = getattr(importlib.import_module(module), name)
        if isinstance(cls, type) and issubclass(cls, BaseException) and not issubclass(cls, UnrollError):
            outside.append(f"{module}.{name}")
    assert not outside, f"exception classes outside the hierarchy (unroll/errors.py): {outside}"


def test_every_exception_class_is_defined_in_the_one_error_module() -> None:
    """The README's rule (Architecture, Errors): one module holds every class, grouped by the layer raising it."""
    elsewhere = [f"{m}.{n}" for m, n in _exception_classes() if m != "unroll.errors"]
    assert not elsewhere, f"exception classes outside unroll/errors.py: {elsewhere}"


def test_builtin_bases_are_kept_where_callers_catch_them() -> None:
    from unroll.card import CardError as CardModuleError
    from unroll.errors import LintError
    from unroll.export.trt_build import LintError as BuildLintError

    assert CardModuleError is CardError and issubclass(CardError, ValueError)
    assert issubclass(RegistryError, KeyError) and str(RegistryError("unknown model 'x'")) == "unknown model 'x'"
    assert BuildLintError is LintError and issubclass(LintError, ValueError)


def _cli(exc: Exception) -> typer.Typer:
    @handles_errors
    def command() -> None:
        """Fails."""
        raise exc

    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(command)
    return app


@pytest.mark.parametrize("exc, code", [(CardError("the card has no field 'x'"), 1), (UsageError("bad option"), 2)])
def test_the_cli_maps_an_unroll_error_to_one_line_and_its_exit_code(exc: UnrollError, code: int) -> None:
    r = CliRunner().invoke(_cli(exc), [], env={"COLUMNS": "40"})
    assert r.exit_code == code and isinstance(r.exception, SystemExit)
    assert r.stderr.strip().splitlines() == [f"error: {exc}"]  # one line, even on a narrow terminal


def test_the_cli_lets_other_exceptions_through() -> None:
    r = CliRunner().invoke(_cli(RuntimeError("a bug")), [])
    assert isinstance(r.exception, RuntimeError)


def test_the_gateway_maps_an_unroll_error_to_its_json_error() -> None:
    app = FastAPI()
    gateway_errors.install(app, retry_after_s=3)
    raised = {"api": ApiError(413, "image_too_large", "too big"), "card": CardError("bad card"),
              "down": TritonUnavailable("down"), "slow": TritonTimeout("slow"), "rejected": TritonRejected("no")}

    def route(exc: Exception):
        def fails() -> None:
            raise exc

        return fails

    for key, exc in raised.items():
        app.add_api_route(f"/{key}", route(exc))
    client = TestClient(app)
    want = {"api": (413, "image_too_large"), "card": (422, "invalid_card"), "down": (503, "triton_unavailable"),
            "slow": (504, "triton_timeout"), "rejected": (502, "triton_error")}
    for key, (status, code) in want.items():
        r = client.get(f"/{key}")
        assert r.status_code == status and r.json() == {"error": {"code": code, "message": str(raised[key])}}
        assert ("retry-after" in r.headers) == (key == "down")
