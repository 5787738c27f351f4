"""TF-Replicator's shape for researchers who write only an ``input_fn`` and a ``step_fn``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from replicator.data.context import InputContext
from replicator.strategies.base import Strategy


class Replicator:
    """``rp.Replicator(strategy).run(input_fn, step_fn, num_steps)``: ``input_fn(ctx)`` builds
    this replica's pipeline, ``step_fn(batch)`` runs a step; passes repeat for ``num_steps``."""

    def __init__(self, strategy: Strategy) -> None:
        if not isinstance(strategy, Strategy):
            raise TypeError(f"Replicator needs a Strategy, got {type(strategy).__name__}")
        self.strategy = strategy

    def run(self, input_fn: Callable[[InputContext], Iterable[Any]],
            step_fn: Callable[[Any], Any], num_steps: int,
            reduce: str | None = "mean") -> list[Any]:
        """Run ``num_steps`` steps; return each step's output, reduced across replicas with
        ``reduce`` (``None`` keeps this replica's own values)."""
        if num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {num_steps}")
        dataset = self.strategy.distribute_datasets_from_function(input_fn)
        outputs: list[Any] = []
        while len(outputs) < num_steps:
            before = len(outputs)
            for batch in dataset:
                out = self.strategy.run(step_fn, args=(batch,))
                if reduce is not None and out is not None:
                    out = self.strategy.reduce(reduce, out)
                outputs.append(out)
                if len(outputs) == num_steps:
                    break
            if len(outputs) == before:
                raise ValueError("input_fn produced an empty pipeline; no step could run")
        return outputs
