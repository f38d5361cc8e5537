"""Training and evaluation recipes, one module per recipe, behind one interface (``unroll train`` / ``unroll eval``).

A model names its recipe where it is registered (``recipe="unroll.train.<module>"``), so the command line knows no
model. A recipe module defines ``TRAIN_OPTIONS`` / ``EVAL_OPTIONS`` (:class:`Option` tuples), ``train(run, **options)
-> (model, record)`` (seeded, from scratch) and ``evaluate(name, model, record, progress, **options) ->
Evaluation``, which recomputes the record's metrics so that every number in ``unroll/weights/NAME.json`` comes from
code. Every recipe's ``EVAL_OPTIONS`` has ``slice`` (:func:`slice_option`): the same evaluation on a fixed, small
part of its data, whose numbers ``unroll eval NAME --slice --write`` records apart (:data:`SLICE_KEY`), so that a
test can check in seconds what the whole evaluation checks in minutes. No stage after training imports this package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from unroll.errors import RecipeError
from unroll.registry import REGISTRY, get_spec

#: ``update(done, total, loss=nan)``: what a training loop reports to a progress bar.
Update = Callable[..., None]
#: ``progress(description, total)`` opens a progress bar (a context manager yielding ``update``).
ProgressFactory = Callable[[str, int], AbstractContextManager[Update]]


@contextmanager
def counted(progress: ProgressFactory, description: str, total: int) -> Iterator[Callable[[], None]]:
    """A progress bar of ``total`` work units (``progress(description, total)``) that yields ``tick()``, which
    advances it by one: evaluations report each pass or image as it finishes, not one unit at the end."""
    with progress(description, total) as update:
        done = 0

        def tick() -> None:
            nonlocal done
            done += 1
            update(done, total)

        yield tick


@dataclass(frozen=True)
class Option:
    """One recipe setting: ``--name VALUE`` on the command line (``--name/--no-name`` for a bool)."""

    name: str
    default: bool | int | float | str | None
    help: str
    #: The value's type where ``default`` is ``None`` (else ``type(default)``).
    kind: type | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def type(self) -> type:
        return self.kind or type(self.default)

    def parse(self, text: str) -> Any:
        try:
            return self.type(text)
        except ValueError:
            raise RecipeError(f"{self.flag} takes a {self.type.__name__}, not {text!r}") from None

    def describe(self) -> str:
        if self.type is bool:
            spelling = f"{self.flag}/--no-{self.flag[2:]}"
        else:
            spelling = f"{self.flag} {self.type.__name__.upper()}"
        return f"{spelling}: {self.help} [default: {self.default}]"


def slice_option(description: str) -> Option:
    """The ``--slice`` evaluation option every recipe has, with its slice described."""
    return Option("slice", False, f"evaluate on a fixed slice only ({description}); its numbers are recorded apart, "
                                  f"in NAME.json's {SLICE_KEY}")


@dataclass(frozen=True)
class TrainRun:
    """Settings every recipe takes (the CLI's own options), and the progress bar factory."""

    name: str
    seed: int
    #: Stop after this many optimizer steps (smoke runs); ``None``: the recipe's full schedule.
    steps: int | None
    #: Measure the trained model (``record["metrics"]``); off for smoke runs.
    metrics: bool
    progress: ProgressFactory


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]]


@dataclass
class Evaluation:
    """What ``evaluate`` measured: ``metrics`` (the record fields it recomputed), a summary and tables."""

    metrics: dict[str, Any]
    lines: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    #: The fixed slice evaluated (its description) when ``evaluate`` ran with ``slice=True``; ``None``: all the data.
    slice: str | None = None


#: The record's key for the metrics measured on the recipe's fixed slice: ``{"slice": description, "metrics": {...}}``
#: (``unroll eval NAME --slice --write`` writes it; the full evaluation's numbers stay in ``metrics``).
SLICE_KEY = "slice_metrics"


def record_evaluation(record: dict, result: Evaluation) -> dict:
    """``record`` with ``result`` written in: a full evaluation's fields replace those in ``metrics``; a slice's
    numbers replace :data:`SLICE_KEY`."""
    if result.slice is not None:
        return {**record, SLICE_KEY: {"slice": result.slice, "metrics": result.metrics}}
    return {**record, "metrics": {**record.get("metrics", {}), **result.metrics}}


def recipe_module(name: str) -> ModuleType:
    """The recipe module a registered model names; a model without one is an error listing those that have one."""
    spec = get_spec(name)
    if spec.recipe is None:
        have = [n for n, s in REGISTRY.items() if s.recipe is not None]
        raise RecipeError(f"{name!r} has no training recipe; models with one: {', '.join(have) or 'none'}")
    module = importlib.import_module(spec.recipe)
    missing = [a for a in ("TRAIN_OPTIONS", "EVAL_OPTIONS", "train", "evaluate") if not hasattr(module, a)]
    if missing:
        raise RecipeError(f"recipe module {spec.recipe} (for {name!r}) lacks {', '.join(missing)}")
    return module


def parse_options(options: Sequence[Option], args: Sequence[str], what: str) -> dict[str, Any]:
    """``--name VALUE`` / ``--name=VALUE`` / ``--flag`` / ``--no-flag`` tokens → ``{name: value}`` (defaults filled)."""
    by_flag = {o.flag: o for o in options}
    values = {o.name: o.default for o in options}
    known = "; ".join(o.describe() for o in options) or "none"
    it = iter(args)
    for token in it:
        key, eq, inline = token.partition("=")
        if key.startswith("--no-") and "--" + key[5:] in by_flag and by_flag["--" + key[5:]].type is bool and not eq:
            values[by_flag["--" + key[5:]].name] = False
            continue
        opt = by_flag.get(key)
        if opt is None:
            raise RecipeError(f"{what}: unknown option {token!r}; its options: {known}")
        if opt.type is bool and not eq:
            values[opt.name] = True
            continue
        text = inline if eq else next(it, None)
        if text is None:
            raise RecipeError(f"{what}: {opt.flag} needs a value")
        values[opt.name] = opt.parse(text) if opt.type is not bool else text.lower() in ("1", "true", "yes")
    return values
