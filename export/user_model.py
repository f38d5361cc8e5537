"""A user's own model for ``unroll export``: their ``nn.Module`` from a file or package, and its card from options.

``unroll export --model path/to/file.py:factory`` (or ``package.module:factory``) imports the file,
calls ``factory()`` for the module, builds the model card from the command-line options
(:func:`card_from_options`) and hands both to :func:`unroll.export.onnx_export.export`, the one export
path. Every card problem is a :class:`~unroll.card.CardError` with one line naming the field, raised
before anything is traced or written.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from torch import nn

from unroll import data, tasks
from unroll.card import CardError, ModelCard
from unroll.errors import ExportError

#: A model name is a file stem and a Triton model name.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _one_line(e: ValidationError, where: str) -> CardError:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return CardError(f"{where}: " + "; ".join(parts))


def _merge(base: Any, updates: Any) -> Any:
    if isinstance(updates, dict) and isinstance(base, dict):
        return {**base, **{k: _merge(base.get(k), v) for k, v in updates.items()}}
    return updates


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise CardError(f"model name {name!r}: use letters, digits, '-', '_' and '.' (it names the file and the "
                        "served model)")
    return name


def _check_datasets(card: ModelCard) -> None:
    for role in ("train", "validation", "test", "stress"):
        ds = getattr(card.data, role)
        if ds is not None and ds not in data.DATASETS:
            raise CardError(f"data.{role}: unknown dataset {ds!r}; known: {', '.join(data.DATASETS)}")


def update_card(card: ModelCard, updates: dict[str, Any], where: str = "model card") -> ModelCard:
    """``card`` with ``updates`` merged in field by field (nested dicts merge), validated as a whole."""
    if not updates:
        return card
    try:
        new = ModelCard.model_validate(_merge(card.model_dump(mode="json"), updates))
    except ValidationError as e:
        raise _one_line(e, where) from None
    check_name(new.name)
    _check_datasets(new)
    return new


def card_from_options(name: str, task: str, input_shape: tuple[int, ...], updates: dict[str, Any] | None = None
                      ) -> ModelCard:
    """The card of a user's module: the task's conventions (input/output names, colour from the channel
    count, resize policy) under the options given (``updates``, as :func:`card_updates` builds them)."""
    offered = [t.name for t in tasks.all_tasks() if t.io is not None]  # default I/O names: CONVENTIONS.md
    if task not in offered:
        raise CardError(f"--task: one of {', '.join(offered)}, not {task!r}")
    spec = tasks.get(task)
    shape = tuple(int(d) for d in input_shape)
    if not shape or any(d == 0 or d < -1 for d in shape):
        raise CardError(f"--input-shape: sizes per sample (C,H,W; -1 for a dynamic axis), not {list(shape)}")
    if spec.image_input and (len(shape) != 3 or shape[0] < 1):
        raise CardError(f"--input-shape: a {task} model takes images C,H,W (C fixed), not {list(shape)}")
    inp, out = spec.io
    image = len(shape) == 3 and shape[0] in (1, 3) and spec.image_input
    base: dict[str, Any] = {
        "name": check_name(name), "task": task, "output": out, "origin": "options",
        "input": {"name": inp, "shape": list(shape), "colour": ({1: "gray", 3: "rgb"}[shape[0]] if image else None),
                  "resize": "none"},
    }
    base = _merge(base, spec.card_defaults(shape))
    try:
        card = ModelCard.model_validate(_merge(base, updates or {}))
    except ValidationError as e:
        raise _one_line(e, "model card from the options") from None
    _check_datasets(card)
    return card


def card_updates(*, labels: list[str] | None = None, mean: list[float] | None = None,
                 std: list[float] | None = None, colour: str | None = None, resize: str | None = None,
                 input_name: str | None = None, output_name: str | None = None, lam_input: str | None = None,
                 lam_default: float | None = None, sigma_input: str | None = None, sigma_scale: float | None = None,
                 data_train: str | None = None, data_test: str | None = None, min_size: int | None = None,
                 description: str | None = None) -> dict[str, Any]:
    """Card field updates from ``unroll export``'s options (``None``: keep the card's)."""
    inp = {k: v for k, v in (("mean", mean), ("std", std), ("colour", colour), ("resize", resize),
                             ("name", input_name), ("min_size", min_size)) if v is not None}
    lam = {k: v for k, v in (("input", lam_input), ("default", lam_default)) if v is not None}
    sigma = {k: v for k, v in (("input", sigma_input), ("scale", sigma_scale)) if v is not None}
    data = {k: v for k, v in (("train", data_train), ("test", data_test)) if v is not None}
    out: dict[str, Any] = {k: v for k, v in (("input", inp), ("lam", lam), ("sigma", sigma), ("data", data)) if v}
    if labels is not None:
        out["labels"] = list(labels)
    if output_name is not None:
        out["output"] = output_name
    if description is not None:
        out["description"] = description
    return out


def read_labels(path: str | Path) -> list[str]:
    """Class names, one per line (blank lines and surrounding spaces ignored)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CardError(f"--labels {p}: cannot read it ({type(e).__name__}: {e})") from None
    labels = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if len(labels) < 2:
        raise CardError(f"--labels {p}: needs one class name per line, at least 2 (found {len(labels)})")
    return labels


def parse_numbers(text: str | None, kind: type, option: str) -> list | None:
    """``"0.5,0.5,0.5"`` → ``[0.5, 0.5, 0.5]`` (``None`` stays ``None``)."""
    if text is None:
        return None
    try:
        return [kind(v) for v in text.replace(" ", "").split(",") if v != ""]
    except ValueError:
        raise CardError(f"{option}: comma-separated {kind.__name__} values, not {text!r}") from None


def load_factory(ref: str) -> Callable[..., nn.Module]:
    """``path/to/file.py:factory`` or ``package.module:factory`` → the factory callable."""
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr:
        raise ExportError(f"--model {ref!r}: give FILE.py:FACTORY or package.module:FACTORY")
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target)
        if not path.is_file():
            raise ExportError(f"--model: no such file {path}")
        mod_name = "unroll_user_" + re.sub(r"\W", "_", path.resolve().stem)
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.resolve().parent))  # the file's own sibling imports
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(mod_name, None)
            raise ExportError(f"--model: importing {path} failed: {type(e).__name__}: {e}") from e
        finally:
            sys.path.remove(str(path.resolve().parent))
    else:
        try:
            module = importlib.import_module(target)
        except Exception as e:
            raise ExportError(f"--model: importing {target} failed: {type(e).__name__}: {e}") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise ExportError(f"--model: {target} has no callable {attr!r}" + (f" (it defines: {', '.join(found)})"
                                                                        if found else ""))
    return factory


def build_module(ref: str) -> nn.Module:
    """Call the factory ``ref`` names; it must return an ``nn.Module``."""
    factory = load_factory(ref)
    try:
        module = factory()
    except Exception as e:
        raise ExportError(f"--model: {ref}() failed: {type(e).__name__}: {e}") from e
    if not isinstance(module, nn.Module):
        raise ExportError(f"--model: {ref}() returned a {type(module).__name__}, not a torch.nn.Module")
    return module
