"""The model registry: names → builders, cards, committed weights and example inputs (CONVENTIONS.md).

Models register themselves where they are defined, with :func:`register_model` (as timm's
``@register_model`` does), together with their model card (:mod:`unroll.card`). ``unroll.load(name)``
is the one way in, like ``timm.create_model``: it builds the architecture with its own options, loads
committed weights (or a checkpoint), and returns the module in eval mode.

A user's model registers the same way from their own file; nothing else in the pipeline needs an edit.

PyTorch is imported only where a model is built or loaded (the shipped model files import it, and so does
:func:`load`). Without PyTorch — the serving image, which serves graphs exported elsewhere — the shipped
models are not registered (:func:`builtin_unavailable` says why) and everything else works: the served
models' cards come from their ONNX graphs, not from here.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unroll import tasks
from unroll.card import ModelCard, Task
from unroll.errors import RegistryError

if TYPE_CHECKING:
    from torch import nn

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
#: Modules that register the shipped models (imported on first use of the registry).
BUILTIN_MODULES = ("unroll.models.mnist", "unroll.models.digits", "unroll.models.denoiser", "unroll.models.sdnet",
                   "unroll.models.rvt", "unroll.models.hamnet", "unroll.models.dic_vit", "unroll.solvers.csc",
                   "unroll.solvers.vars_attn", "unroll.solvers.nmf", "unroll.solvers.dic_attn")



def weights_file(name: str, folder: Path) -> Path:
    """``FOLDER/NAME.pt``: a model's trained weights (``unroll train`` writes them, the registry reads them)."""
    return folder / f"{name}.pt"


def training_record(name: str, folder: Path) -> Path:
    """``FOLDER/NAME.json`` beside the weights: the recipe, builder options and measured metrics."""
    return folder / f"{name}.json"

@dataclass(frozen=True)
class ModelSpec:
    name: str
    builder: Callable[..., nn.Module]
    card: ModelCard
    #: Shape of one example input sample (without batch): the resolution export traces at.
    input_shape: tuple[int, ...]
    #: Options forwarded to the builder unless the caller overrides them.
    defaults: dict[str, Any] = field(default_factory=dict)
    #: ``fn(model, path)`` loading an external checkpoint (e.g. official SDNet files), or ``None``.
    checkpoint_loader: Callable[[nn.Module, Any], Any] | None = None
    #: Dotted module holding the training/evaluation recipe (``train(...)``/``evaluate(...)``), if any.
    recipe: str | None = None
    #: Folder with ``NAME.pt`` / ``NAME.json`` committed weights.
    weights_dir: Path = WEIGHTS_DIR
    #: Whether ``unroll serve`` without ``--models`` serves it (when it has weights): the demos do; models trained
    #: for a study (the robustness comparison) are served when named.
    served_by_default: bool = True

    @property
    def task(self) -> Task:
        return self.card.task

    @property
    def description(self) -> str:
        return self.card.description

    @property
    def weights_path(self) -> Path:
        return weights_file(self.name, self.weights_dir)

    @property
    def info_path(self) -> Path:
        return training_record(self.name, self.weights_dir)

    @property
    def has_weights(self) -> bool:
        return self.weights_path.exists()

    def info(self) -> dict:
        """The committed training record (recipe, split, seed, metrics), or ``{}``."""
        return json.loads(self.info_path.read_text()) if self.info_path.exists() else {}


REGISTRY: dict[str, ModelSpec] = {}
_builtin_loaded = False
#: Why the shipped models are not registered in this install (``None`` once they are, or before the first look).
_builtin_missing: str | None = None
NO_TORCH = ("PyTorch is not installed, so the shipped models are not registered here: this install serves graphs "
            "exported elsewhere (`unroll export` where PyTorch is installed)")


def register_model(name: str, *, card: dict[str, Any], input_shape: tuple[int, ...],
                   defaults: dict[str, Any] | None = None, checkpoint_loader: Callable | None = None,
                   recipe: str | None = None, weights_dir: Path | None = None, served_by_default: bool = True,
                   replace: bool = False) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Decorator registering a builder under ``name`` with its model card (the card's fields, no name).

    ``served_by_default=False``: ``unroll serve`` serves it only when named (``--models``).
    ``replace=True`` allows re-registering a name (a user iterating on their model in one session);
    otherwise a second registration of the same name is an error rather than a silent override.
    """
    model_card = ModelCard(name=name, **card)

    def deco(builder: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        if name in REGISTRY and not replace and REGISTRY[name].builder is not builder:
            raise ValueError(f"model {name!r} is already registered (by {REGISTRY[name].builder.__module__}); "
                             "pass replace=True to override it")
        REGISTRY[name] = ModelSpec(name, builder, model_card, tuple(input_shape), dict(defaults or {}),
                                   checkpoint_loader, recipe, Path(weights_dir) if weights_dir else WEIGHTS_DIR,
                                   served_by_default)
        return builder

    return deco


def _ensure_builtin() -> None:
    global _builtin_loaded, _builtin_missing
    if not _builtin_loaded:
        _builtin_loaded = True
        if importlib.util.find_spec("torch") is None:
            _builtin_missing = NO_TORCH  # a serving-only install: graphs carry their cards, nothing to register
            return
        for mod in BUILTIN_MODULES:
            importlib.import_module(mod)
        # Import order is an accident of module dependencies (whichever stage imported a model file first); list
        # trained demos first, then by task, then in BUILTIN_MODULES order, so every command lists them alike.
        rank = {m: i for i, m in enumerate(BUILTIN_MODULES)}
        ranked = sorted(REGISTRY.values(), key=lambda s: (not s.has_weights, tasks.get(s.task).order,
                                                          rank.get(s.builder.__module__, len(rank))))
        REGISTRY.clear()
        REGISTRY.update((s.name, s) for s in ranked)


def list_models() -> list[str]:
    """Registered model names, in registration order (none of the shipped ones without PyTorch)."""
    _ensure_builtin()
    return list(REGISTRY)


def builtin_unavailable() -> str | None:
    """Why the shipped models are not registered in this install (no PyTorch), or ``None`` when they are."""
    _ensure_builtin()
    return _builtin_missing


def get_spec(name: str) -> ModelSpec:
    _ensure_builtin()
    if name not in REGISTRY:
        why = f" ({_builtin_missing})" if _builtin_missing else ""
        raise RegistryError(f"unknown model {name!r}; registered models: {', '.join(REGISTRY) or 'none'}{why}")
    return REGISTRY[name]


def load(name: str, pretrained: bool = True, checkpoint: str | Path | None = None, **options: Any) -> nn.Module:
    """Build a registered model in eval mode, with its committed weights when ``pretrained``.

    ``checkpoint=PATH`` loads an external checkpoint with the model's own loader (official SDNet
    ``model_best.pth.tar`` / ``checkpoint.pth.tar``) instead of committed weights; other ``options`` go
    to the architecture.
    """
    spec = get_spec(name)
    import torch

    kw = {**spec.defaults, **spec.info().get("model", {}), **options}
    seed = kw.pop("seed", 0)
    with torch.random.fork_rng():  # seeded initialisation, without touching the caller's RNG state
        torch.manual_seed(seed)
        model = spec.builder(**kw)
    if checkpoint is not None:
        if spec.checkpoint_loader is None:
            raise ValueError(f"{name!r} has no checkpoint loader; checkpoint= is for architectures that declare one "
                             f"({', '.join(n for n, s in REGISTRY.items() if s.checkpoint_loader) or 'none'})")
        spec.checkpoint_loader(model, checkpoint)
    elif pretrained:
        if not spec.has_weights:
            raise FileNotFoundError(
                f"{name!r} has no committed weights (expected {spec.weights_path}); use pretrained=False for "
                "a seeded random initialisation" + (", or checkpoint=PATH for an external checkpoint"
                                                    if spec.checkpoint_loader else ""))
        model.load_state_dict(torch.load(spec.weights_path, map_location="cpu", weights_only=True))
    return model.eval()
