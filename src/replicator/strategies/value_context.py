"""``ValueContext``: what ``strategy.distribute_values_from_function(fn)`` passes to ``fn``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ValueContext:
    """Which replica a value is for (tf.distribute's ``ValueContext``): ``fn`` is called once
    in each process, for that process's replica."""

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1
