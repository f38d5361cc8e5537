"""The :class:`Task` base and the task registry: what a model's ``card.task`` means to every stage.

A task object owns the facts and small decisions that differ between tasks (which data its example, gate and
calibration inputs come from, which gate metrics it produces and their default tolerances, how the gateway
routes it and shapes the answer, the ``unroll serve`` banner sample). Stage code stays in the stages: they ask the
card's task object instead of branching on its name. Adding a task is one module with a :func:`register` call.

Nothing here imports PyTorch or a stage: the gateway imports this in the torch-free serving image.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from unroll.errors import UnknownTask

if TYPE_CHECKING:
    import numpy as np

Precision = Literal["fp32", "fp16", "int8"]
#: Where a task's example (export), gate and calibration inputs come from: ``labelled`` (the card's labelled
#: image datasets, fitted to the input), ``noisy`` (clean images with synthetic noise at the card's σ levels) or
#: ``plain`` (the card's data when it has some, else bundled photos as feature maps/tokens).
DataKind = Literal["labelled", "noisy", "plain"]
#: How the gateway answers a route: ``predictions`` (JSON top-k labels) or ``image`` (a PNG of the input's size).
Answer = Literal["predictions", "image"]


class ModelCard(Protocol):
    """What a task reads of a model card (:class:`unroll.card.ModelCard` has it). Declared here, not imported: the
    card validates its task against this registry, so the tasks sit below the card and never import it back."""

    name: str
    task: str
    labels: tuple[str, ...] | None
    lam: Any  #: ``unroll.card.LamCard | None``: ``auto``, ``min``, ``max``
    sigma: Any  #: ``unroll.card.SigmaCard | None``
    iters: Any  #: ``unroll.card.IterCard | None``: ``default``, ``counts``
    companion_of: str | None


@dataclass(frozen=True)
class Route:
    """A task's ``/v1`` route in the gateway."""

    #: Path under ``/v1`` (``/classify``).
    path: str
    answer: Answer
    #: What one served model is called in messages and parameter help (``classifier``).
    noun: str
    #: OpenAPI summary of the route.
    summary: str
    #: Gateway setting (a field of ``Settings``, ``UNROLL_`` + its upper-case name) that narrows the models served
    #: by this route; ``None``: every model of the task that Triton serves.
    setting: str | None = None
    #: The route takes the card's noise level (``sigma`` query parameter, estimated when omitted).
    sigma: bool = False


@dataclass(frozen=True)
class Task:
    """One task: its facts as fields, its task-specific decisions as methods a stage calls with what it needs."""

    name: str
    description: str
    #: Default gate tolerances per precision (metric → tolerance; units in ``unroll.gates``).
    gates: dict[str, dict[str, float]]
    #: Gate metrics the task produces besides ``rel_err`` (which every task has).
    metrics: tuple[str, ...] = ()
    #: Where its example, gate and calibration inputs come from (:data:`DataKind`).
    data: DataKind = "plain"
    #: The output is class logits ``[batch, classes]`` (labels, top-k, the served labels file).
    logits: bool = False
    #: The output has the input's dynamic axes (image → image, tokens → tokens).
    same_shape_output: bool = False
    #: A user's module with dynamic H×W is also verified at a second size (random images).
    second_size_case: bool = False
    #: Default graph (input, output) names of ``unroll export --model --task NAME``; ``None``: not offered there.
    io: tuple[str, str] | None = None
    #: ``--task NAME`` needs an image input ``C,H,W`` (C fixed) and gets its colour from C.
    image_input: bool = False
    #: Largest batch a CPU Triton config allows (``None``: the repository's default).
    cpu_max_batch: int | None = None
    route: Route | None = None
    #: Rank in ``unroll models`` (trained demos first, then by this).
    order: int = 9

    # ------------------------------------------------------------------ hooks (override in a subclass)

    def check(self, card: ModelCard) -> None:
        """Raise ``ValueError`` when ``card`` is invalid for this task (called by the card's validator)."""

    def card_defaults(self, shape: tuple[int, ...]) -> dict[str, Any]:
        """Card fields a user's module of this task gets from ``unroll export --model`` beyond names and colour."""
        return {}

    def not_served_reason(self, card: ModelCard) -> str | None:
        """Why the gateway does not serve a model of this task (``None``: it may, when the task has a route)."""
        if self.route is None:
            return f"task {card.task!r} has no /v1 route"
        if card.companion_of is not None and card.iters is not None:
            return f"{card.companion_of}'s graph for iters={card.iters.default} (requests name {card.companion_of})"
        return None

    def listing(self, card: ModelCard, output_shape: tuple[int, ...]) -> dict[str, Any]:
        """Fields of a served model's ``GET /v1/models`` entry (at least ``params``: the route's query parameters
        and their ranges); ``output_shape`` is the served output's shape as Triton reports it."""
        return {"params": {}}

    def sample(self, card: ModelCard, image: np.ndarray, label: int | None, out: Path) -> np.ndarray:
        """The banner's sample image for a served model of this task (it may write a side file next to it)."""
        return image

    def banner(self, base: str, card: ModelCard, sample: Path, auth: str) -> list[str]:
        """``curl`` lines that try a served model of this task (none without a route)."""
        if self.route is None:
            return []
        post = f"  curl{auth} --data-binary {shlex.quote(f'@{sample}')} -H 'Content-Type: image/png'"
        return [f"{post} '{base}/v1{self.route.path}?model={card.name}'"
                + (" -o out.png" if self.route.answer == "image" else "")]


_TASKS: dict[str, Task] = {}


def register(task: Task) -> Task:
    """Make ``task`` known by its name (a card's ``task`` field); a second task of the same name replaces it."""
    _TASKS[task.name] = task
    return task


def unregister(name: str) -> None:
    """Forget a task (tests that register a task of their own)."""
    _TASKS.pop(name, None)


def get(name: str) -> Task:
    """The task called ``name``; :class:`UnknownTask` naming the known ones otherwise."""
    try:
        return _TASKS[name]
    except KeyError:
        raise UnknownTask(f"unknown task {name!r}; known: {', '.join(_TASKS)}") from None


def all_tasks() -> Iterator[Task]:
    """Registered tasks by :attr:`Task.order`, then registration order."""
    return iter(sorted(_TASKS.values(), key=lambda t: t.order))


def names() -> tuple[str, ...]:
    """Registered task names (in :func:`all_tasks` order)."""
    return tuple(t.name for t in all_tasks())


def routed() -> tuple[Task, ...]:
    """Tasks with a gateway route (in :func:`all_tasks` order)."""
    return tuple(t for t in all_tasks() if t.route is not None)
