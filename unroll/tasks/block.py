"""Solver blocks exported on their own (a CSC layer, an attention block): tensor → tensor, gated on relative error."""

from __future__ import annotations

from unroll.tasks.base import Task, register

NAME = "block"

TASK = register(Task(
    name=NAME, description="tensor → tensor (a solver layer on its own)",
    gates={"fp32": {"rel_err": 1e-4}, "fp16": {"rel_err": 1e-2}, "int8": {"rel_err": 5e-2}},
    data="plain", same_shape_output=True, second_size_case=True, io=("x", "y"), order=2))
