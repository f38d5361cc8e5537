"""A classifier's λ rule (``lam=auto``): image → λ, exported beside the classifier and used by its route only."""

from __future__ import annotations

from unroll.tasks.base import ModelCard, Task, register

NAME = "lambda-rule"


class LambdaRule(Task):
    """A companion graph: served by Triton for its classifier's ``lam=auto``, never by a route of its own."""

    def not_served_reason(self, card: ModelCard) -> str | None:
        return f"λ rule of {card.companion_of or 'a classifier'} (used by lam=auto)"


TASK = register(LambdaRule(
    name=NAME, description="image → λ for a classifier's sparse-coding front end",
    gates={"fp32": {"rel_err": 1e-4}, "fp16": {"rel_err": 1e-2}, "int8": {"rel_err": 5e-2}},
    data="plain", order=3))
