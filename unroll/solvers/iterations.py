"""The iteration count of a model's solver layers, read and changed in one place (``iters=K`` per request).

A solver layer whose steps share their weights (SDNet's FISTA, the VARS and Dic-Attn ISTA steps, NMF updates)
can be unrolled to any K after training: it holds its count in ``n_steps`` (``eval_steps`` for NMF, whose
training count differs). A layer with learned weights per step (a LISTA denoiser) says so with
``untied_steps = True`` and cannot be re-unrolled.
"""

from __future__ import annotations

from torch import nn

from unroll.errors import IterationsError  # re-exported


def _tied_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    out = []
    for name, m in model.named_modules():
        if getattr(m, "untied_steps", False):
            raise IterationsError(f"{type(m).__name__} {name or '(the model)'} has learned weights for each of its "
                                  f"{m.n_steps} steps: another count would need retraining")
        if hasattr(m, "eval_steps") or hasattr(m, "n_steps"):
            out.append((name or "(the model)", m))
    return out


def _count(m: nn.Module) -> int:
    return int(m.eval_steps if hasattr(m, "eval_steps") else m.n_steps)


def iteration_count(model: nn.Module) -> int:
    """The one iteration count every tied solver layer of ``model`` runs in eval mode."""
    layers = _tied_layers(model)
    if not layers:
        raise IterationsError(f"{type(model).__name__} has no solver layer with an iteration count")
    counts = {name: _count(m) for name, m in layers}
    if len(set(counts.values())) > 1:
        raise IterationsError(f"its solver layers run different iteration counts ({counts}); iters=K needs one")
    return next(iter(counts.values()))


def set_iterations(model: nn.Module, k: int) -> nn.Module:
    """Unroll every tied solver layer of ``model`` to ``k`` steps (in place; returns ``model``)."""
    if k < 1:
        raise IterationsError(f"an iteration count is at least 1, got {k}")
    layers = _tied_layers(model)
    if not layers:
        raise IterationsError(f"{type(model).__name__} has no solver layer with an iteration count")
    for _, m in layers:
        if hasattr(m, "eval_steps"):
            m.eval_steps = k
        else:
            m.n_steps = k
    return model
