"""Tasks as objects: ``unroll.tasks.get(card.task)`` says what a model's task means to each stage.

One module per task (:mod:`.classification`, :mod:`.denoising`, :mod:`.block`, :mod:`.lambda_rule`) builds a
:class:`~unroll.tasks.base.Task` and registers it by name; a new task is one such module (or a test's own
object) passed to :func:`register`. No stage and no PyTorch is imported here (the gateway's serving image).
"""

from __future__ import annotations

from unroll.errors import UnknownTask
from unroll.tasks import block, classification, denoising, lambda_rule
from unroll.tasks.base import Answer, DataKind, Route, Task, all_tasks, get, names, register, routed, unregister

#: The shipped tasks' names, for code that declares or picks a model of one of them.
CLASSIFICATION = classification.NAME
DENOISING = denoising.NAME
BLOCK = block.NAME
LAMBDA_RULE = lambda_rule.NAME

__all__ = ["BLOCK", "CLASSIFICATION", "DENOISING", "LAMBDA_RULE", "Answer", "DataKind", "Route", "Task",
           "UnknownTask", "all_tasks", "get", "names", "register", "routed", "unregister"]
