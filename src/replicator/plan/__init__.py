"""The planner: should you distribute, and how? ``replicator bench`` and ``replicator plan``.

From Python: ``rp.plan.bench(train_fn, nproc=(1, 2))`` runs ``train_fn(strategy)`` under each
setting and writes the report; ``rp.plan.plan(model_profile, workers)`` is the arithmetic of a
plan; ``rp.plan.print_plan_line(strategy, model_fn, dataset, batch)`` ends a script with one
line of advice. The modules, one job each:

* :mod:`~replicator.plan.cost_model`: alpha-beta formulas and one setting's predicted step;
* :mod:`~replicator.plan.devices`: nominal device and link figures (``--device``, ``--link``);
* :mod:`~replicator.plan.profiles`: the model's and this machine's figures (JSON);
* :mod:`~replicator.plan.measure`: what is measured on this machine (cached);
* :mod:`~replicator.plan.probe`: timers inside the user's training process (a step observer);
* :mod:`~replicator.plan.settings`: bench's settings, results, rounds and baseline (data);
* :mod:`~replicator.plan.benchmark`: runs a script or function under each setting, in rounds;
* :mod:`~replicator.plan.report` and :mod:`~replicator.plan.plots`: tables, report, PNGs;
* :mod:`~replicator.plan.recommend`: picks one setting, with a one-sentence reason;
* :mod:`~replicator.plan.planner`: profile, measure, predict, print;
* :mod:`~replicator.plan.validate`: predicted against measured on this machine.

This room sits at the top: it may import every other room, and none imports it. Importing it
is cheap: each function imports its module on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["bench", "plan", "print_plan_line"]


def bench(*args: Any, **kwargs: Any) -> Any:
    """:func:`replicator.plan.benchmark.bench_function`: ``bench(train_fn, nproc=(1, 2),
    strategies=("one_device", "mirrored"), steps=30)``."""
    from replicator.plan.benchmark import bench_function

    return bench_function(*args, **kwargs)


def plan(*args: Any, **kwargs: Any) -> Any:
    """:func:`replicator.plan.planner.plan_model`: ``plan(model_profile, workers,
    device="cpu", link="25gbit")``."""
    from replicator.plan.planner import plan_model

    return plan_model(*args, **kwargs)


def print_plan_line(*args: Any, **kwargs: Any) -> None:
    """:func:`replicator.plan.quick.print_plan_line`: one line of the plan, on the chief."""
    from replicator.plan.quick import print_plan_line as _print

    _print(*args, **kwargs)
