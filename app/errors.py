"""The command line's one error mapping: any :class:`~unroll.errors.UnrollError` ends a command with one line
``error: …`` on stderr (no traceback) and the error's ``exit_code``.

Every command function is wrapped by :func:`handles_errors` where it is defined, so the mapping holds however the
command is mounted (the ``unroll`` app, a test's own Typer app, ``python -m unroll.app.trt_cli``); :func:`main`
wraps the whole app for errors raised outside a command. The gateway's counterpart is
:mod:`unroll.serving.gateway.errors`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from unroll.errors import UnrollError

P = ParamSpec("P")
R = TypeVar("R")

err = Console(stderr=True)


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print ``error: message`` on stderr (no traceback, never wrapped) and return the exit to raise."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def report(e: UnrollError) -> typer.Exit:
    """The one mapping: the error's message as one ``error:`` line, and the exit carrying its ``exit_code``."""
    return fail(str(e), e.exit_code)


def handles_errors(command: Callable[P, R]) -> Callable[P, R]:
    """``command`` with every :class:`UnrollError` it raises turned into :func:`report` (signature kept for Typer)."""

    @functools.wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except UnrollError as e:
            raise report(e) from None

    return run
