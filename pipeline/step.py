"""One unit of pipeline work: a stage to run for one model, why, and the call that runs it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Stage = Literal["export", "quantize", "build", "repo"]
#: The order stages run in: each one's output is the next one's input.
STAGES: tuple[Stage, ...] = ("export", "quantize", "build", "repo")


@dataclass(frozen=True)
class Step:
    """A stage that must run for ``name`` (a registered model for export, a graph for the others) and why.

    ``action`` does the work and returns what the stage returns; ``runnable`` is False when the stage cannot
    run on this machine (a TensorRT build without TensorRT): running it only reports ``reason``.
    """

    stage: Stage
    name: str
    reason: str
    outputs: tuple[Path, ...] = ()
    action: Callable[[], Any] | None = field(default=None, compare=False, repr=False)
    runnable: bool = True
    #: what the progress line says, when not the generic ``stage name (reason)``
    message: str = field(default="", compare=False)

    @property
    def key(self) -> tuple[str, str]:
        """``(stage, name)``: what a caller (or a test) compares plans by."""
        return self.stage, self.name

    def __str__(self) -> str:
        return self.message or f"{self.stage} {self.name} ({self.reason})"


def changed_words(changed: list[str], words: dict[str, str]) -> str:
    """The changed inputs of :func:`unroll.artifacts.changed_inputs` as a phrase."""
    return "; ".join(words.get(k, f"{k} changed") if not k.startswith("everything") else
                     "built before its inputs were recorded" for k in changed)
