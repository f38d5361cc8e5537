"""unroll: deploy and serve vision models whose layers are fixed-iteration optimization solvers.

``list_models`` and ``load`` are resolved on first use (PEP 562), so ``import unroll`` — which every
``unroll`` command and ``unroll.serving`` does — imports neither the registry's model files nor PyTorch:
the serving image runs exported graphs without PyTorch installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["list_models", "load"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in __all__:
        from unroll import registry  # local: keeps `import unroll` light (module docstring)

        return getattr(registry, name)
    raise AttributeError(f"module 'unroll' has no attribute {name!r}")
