"""The planner: should you distribute, and how? ``replicator bench`` and ``replicator plan``.

* :mod:`~replicator.plan.cost_model`: alpha-beta formulas and one setting's predicted step;
* :mod:`~replicator.plan.devices`: nominal device and link figures (``--device``, ``--link``);
* :mod:`~replicator.plan.measure`: what is measured on this machine (cached);
* :mod:`~replicator.plan.probe`: timers inside the user's training process;
* :mod:`~replicator.plan.bench`: runs a script or function under each setting, writes the report;
* :mod:`~replicator.plan.recommend`: picks one setting, with a one-sentence reason;
* :mod:`~replicator.plan.validate`: predicted against measured on this machine.

This room sits at the top: it may import every other room, and none imports it. Importing it
is cheap (no torch until a measurement runs).
"""

from __future__ import annotations

from typing import Any

__all__ = ["bench", "plan"]


def bench(*args: Any, **kwargs: Any) -> Any:
    """:func:`replicator.plan.bench.bench_function` (imported on first use)."""
    from replicator.plan.bench import bench_function

    return bench_function(*args, **kwargs)


def plan(*args: Any, **kwargs: Any) -> Any:
    """:func:`replicator.plan.planner.plan_model` (imported on first use)."""
    from replicator.plan.planner import plan_model

    return plan_model(*args, **kwargs)
