"""Export stage: a registered model (card + weights + options) → ``NAME.onnx`` (+ companions) and their reports.

Stale iff a graph of the model is missing, carries no card, or its report's ``built_from`` differs from
:func:`unroll.artifacts.export_inputs` now (the card, the weights file, the export options). A graph that is not a
registered model's (``unroll export --model``, ``unroll fuse``) is never stale: nothing here could rebuild it.
"""

from __future__ import annotations

import functools
from pathlib import Path

from unroll import artifacts
from unroll.card import CardError, ModelCard, from_onnx
from unroll.errors import PipelineError
from unroll.pipeline.step import Step, changed_words
from unroll.registry import get_spec, list_models

#: Why a recorded input hash differs, in words.
_CHANGED = {"card": "its card changed", "weights": "its weights changed", "options": "the export options changed"}


def is_registered(name: str) -> bool:
    """Whether ``name`` is a registered model (one the export stage can build)."""
    return name in list_models()


def card_of(name: str, onnx_dir: Path | None = None) -> ModelCard:
    """A model's card: the registry's, or (a graph not registered here) the one inside ``onnx_dir/NAME.onnx``."""
    if is_registered(name) or onnx_dir is None:
        return get_spec(name).card  # RegistryError lists the registered names
    return from_onnx(artifacts.graph(name, onnx_dir=onnx_dir))


def graphs_of(models: list[str], onnx_dir: Path | None = None, companions: bool = True) -> list[str]:
    """Triton model names to serve: each model, followed by the graphs its card names: its λ rule (``lam.auto``,
    unless ``companions`` is off) and one graph per served iteration count other than the trained one
    (``iters``)."""
    out: list[str] = []
    for m in models:
        card = card_of(m, onnx_dir)
        auto = card.lam.auto if card.lam is not None and companions else None
        out += [m] + ([auto] if auto is not None else []) + iteration_graphs(m, card)
    return list(dict.fromkeys(out))


def iteration_graphs(model: str, card: ModelCard) -> list[str]:
    """The sibling graphs of ``model``'s other served iteration counts (``card.iters``; none without it). A
    registration leaves the trained count to the model: it is read from the architecture (built without
    weights) when the card does not say it."""
    if card.iters is None:
        return []
    iters = card.iters
    if iters.default is None:
        iters = iters.model_copy(update={"default": _trained_iterations(model)})
    return [iters.graph(model, k) for k in iters.counts if k != iters.default]


@functools.cache
def _trained_iterations(model: str) -> int:
    from unroll.solvers.iterations import iteration_count  # PyTorch: only for a registered model (see above)

    spec = get_spec(model)
    return iteration_count(spec.builder(**spec.defaults))


def stale_reason(graph: str, onnx_dir: Path) -> str | None:
    """Why the export ``onnx_dir/<graph>.onnx`` must be (re)built, or ``None`` when it is up to date.

    The graph's own card says which registered model it comes from (``companion_of`` for a λ rule); its report
    records the hashes of what it was built from. Weights that are not here (a serving image ships graphs, not
    weights) cannot be compared and count as unchanged.
    """
    path, report_path = artifacts.graph(graph, onnx_dir=onnx_dir), artifacts.graph_report(graph, onnx_dir=onnx_dir)
    if not path.exists() or not report_path.exists():
        return "not exported yet"
    try:
        card = from_onnx(path)
    except CardError:
        return "exported without a model card (an older export)"
    owner = card.companion_of or card.name
    if not is_registered(owner):
        return None  # a user's graph: nothing here could rebuild it, and it carries its card
    report = artifacts.read_json(report_path) or {}
    changed = artifacts.changed_inputs(report.get(artifacts.BUILT_FROM_KEY),
                                       artifacts.export_inputs(get_spec(owner)), absent_ok=("weights",))
    return changed_words(changed, _CHANGED) or None


def plan_model(model: str, onnx_dir: Path, force: bool = False) -> Step | None:
    """The export step for ``model`` when one of its graphs is missing or stale (or ``force``), else ``None``."""
    if not is_registered(model):
        if not artifacts.graph(model, onnx_dir=onnx_dir).exists():
            raise PipelineError(f"unknown model {model!r}: not registered (registered: {', '.join(list_models())}) "
                                f"and not exported at {artifacts.graph(model, onnx_dir=onnx_dir)}")
        return None  # an exported graph with its card: served as it is
    graphs = graphs_of([model])
    reasons = {g: "--rebuild" if force else stale_reason(g, onnx_dir) for g in graphs}
    why = "; ".join(f"{g}: {r}" for g, r in reasons.items() if r is not None)
    if not why:
        return None
    spec = get_spec(model)
    warning = "" if spec.has_weights else (
        f"warning: {model} has no committed weights ({spec.weights_path}); serving a seeded random initialisation — "
        "its predictions are meaningless until it is trained\n")
    return Step("export", model, why, tuple(artifacts.graph(g, onnx_dir=onnx_dir) for g in graphs),
                action=lambda: run(model, onnx_dir), message=f"{warning}export {model} → {onnx_dir} ({why})")


def run(model: str, onnx_dir: Path) -> list[str]:
    """Export ``model`` (fused, verified; its companions too); returns the graph names written.

    The exporter (PyTorch, onnxslim) is imported only here, when something must be exported, so a serving image
    built without them serves its pre-exported graphs.
    """
    from unroll.export.onnx_export import export_model  # PyTorch: only when exporting (see the docstring)

    Path(onnx_dir).mkdir(parents=True, exist_ok=True)
    result = export_model(model, onnx_dir, naive=False)
    return [r.onnx_path.stem for r in (result, *result.companions)]
