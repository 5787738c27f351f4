"""The planner: should you distribute, and how? ``replicator bench`` and ``replicator plan``.

``rp.plan.bench(train_fn, nproc=(1, 2))`` runs ``train_fn(strategy)`` under each setting and
writes the report (:mod:`~replicator.plan.benchmark`); ``rp.plan.plan(model_profile,
workers)`` is the arithmetic of a plan (:mod:`~replicator.plan.planner`, over
:mod:`~replicator.plan.cost_model`); ``rp.plan.print_plan_line(strategy, model_fn, dataset,
batch)`` ends a script with one line of advice. This room sits at the top: none imports it.
Importing it is cheap: each name imports its module on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["bench", "plan", "print_plan_line"]

_HOMES = {"bench": "benchmark.bench_function", "plan": "planner.plan_model",
          "print_plan_line": "planner.print_plan_line"}


def __getattr__(name: str) -> Any:
    """``bench``, ``plan`` and ``print_plan_line``, imported from their modules on first use."""
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}", name=name)
    module, attr = _HOMES[name].split(".")
    return getattr(importlib.import_module(f"{__name__}.{module}"), attr)
