"""unroll: deploy and serve vision models whose layers are fixed-iteration optimization solvers."""

from unroll.registry import list_models, load

__all__ = ["list_models", "load"]
__version__ = "0.1.0"
