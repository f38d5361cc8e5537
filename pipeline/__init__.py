"""The pipeline layer, installed as ``unroll.pipeline``: which artifacts each stage makes, whether they are up to
date, and running the stages that are not. It imports the stages (``unroll.export``, ``unroll.serving``) and the
core; the application layer (``unroll.app``) and the benchmarks ask it what is missing instead of calling each
other (``tests/test_architecture.py``)."""

from unroll.pipeline.export_stage import card_of, graphs_of, is_registered
from unroll.pipeline.plan import plan, plan_graph, run, stale
from unroll.pipeline.repo_stage import RepoOptions
from unroll.pipeline.step import STAGES, Stage, Step

__all__ = ["STAGES", "RepoOptions", "Stage", "Step", "card_of", "graphs_of", "is_registered", "plan", "plan_graph",
           "run", "stale"]
