"""The replica context: inside ``strategy.run`` (or anywhere), who this replica is."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from replicator.comm.reduce_op import ReduceOp

if TYPE_CHECKING:
    from replicator.strategies.base import Strategy

_CURRENT: list[Strategy] = []
_LAST_CREATED: list[weakref.ref] = []


class ReplicaContext:
    """tf.distribute's ``ReplicaContext``: this replica's id and cross-replica reductions."""

    def __init__(self, strategy: Strategy | None) -> None:
        self._strategy = strategy

    @property
    def strategy(self) -> Strategy:
        if self._strategy is None:
            from replicator.strategies.one_device import OneDeviceStrategy

            self._strategy = OneDeviceStrategy()
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        return 0 if self._strategy is None else self._strategy.replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        return 1 if self._strategy is None else self._strategy.num_replicas_in_sync

    def all_reduce(self, op: ReduceOp | str, value: Any) -> torch.Tensor:
        """Reduce ``value`` across all replicas; every replica gets the result."""
        return self.strategy.reduce(op, value)

    def __repr__(self) -> str:
        return (f"ReplicaContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")


@contextlib.contextmanager
def entered(strategy: Strategy) -> Iterator[None]:
    _CURRENT.append(strategy)
    try:
        yield
    finally:
        _CURRENT.pop()


def created(strategy: Strategy) -> None:
    """Remember the newest strategy: in SPMD code it is the one the process runs under."""
    _LAST_CREATED[:] = [weakref.ref(strategy)]


def current_strategy() -> Strategy | None:
    """The strategy whose ``scope()`` or ``run()`` is active, else the newest one created."""
    if _CURRENT:
        return _CURRENT[-1]
    return _LAST_CREATED[0]() if _LAST_CREATED else None


def get_replica_context() -> ReplicaContext:
    """The context of the active strategy, or a one-replica default context outside any."""
    return ReplicaContext(current_strategy())
