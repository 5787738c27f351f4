"""tf.distribute's ``ReplicaContext`` with one process per replica (who this replica is; its
collectives are the strategy's and ``merge_call`` runs once in each process), and the strategy
of a context outside any: ``OneDeviceStrategy``, the reference for equivalence."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from replicator.cluster.devices import parse_device
from replicator.cluster.environment import resolve_cluster
from replicator.comm.reduce_op import ReduceOp
from replicator.strategies.base import Strategy, ValueContext, current_strategy
from replicator.strategies.replicas import ReplicaGroup

__all__ = ["OneDeviceStrategy", "ReplicaContext", "ValueContext", "get_replica_context",
           "current_strategy"]


class OneDeviceStrategy(Strategy):
    """Run on a single device (``None``: the first GPU if any, else the CPU), with no process
    group: ``reduce``/``gather`` return the local value. ``check_finite``: see ``Strategy``.
    """

    name = "one_device"

    def __init__(self, device: str | torch.device | None = None, *,
                 check_finite: bool = False) -> None:
        self._replica_group = ReplicaGroup.single(parse_device(device))
        spec = resolve_cluster()
        if spec.world_size > 1:
            warnings.warn(
                f"OneDeviceStrategy in a job of {spec.world_size} processes (rank {spec.rank}): "
                "every process trains its own independent model on its own data and acts as "
                "the chief (prints, writes checkpoints). HINT: use rp.MirroredStrategy() to "
                "train one model on every process, or launch a single process.",
                UserWarning, stacklevel=2)
        super().__init__(check_finite=check_finite)


class ReplicaContext:
    """tf.distribute's ``ReplicaContext``: this replica's id and cross-replica reductions."""

    def __init__(self, strategy: Strategy | None) -> None:
        self._strategy = strategy

    @property
    def strategy(self) -> Strategy:
        if self._strategy is None:
            self._strategy = OneDeviceStrategy()
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        return 0 if self._strategy is None else self._strategy.replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        return 1 if self._strategy is None else self._strategy.num_replicas_in_sync

    def all_reduce(self, op: ReduceOp | str, value: Any) -> Any:
        """Reduce ``value`` (a tensor, a number, or a nest of them) across all replicas in one
        collective; every replica gets the result, in ``value``'s structure."""
        return self.strategy.reduce(op, value)

    def all_gather(self, value: Any, axis: int = 0) -> Any:
        """Every replica's ``value`` (or each leaf of a nest) concatenated along ``axis`` in
        replica order; sizes along ``axis`` may differ. Every replica gets the result."""
        return self.strategy.gather(value, axis)

    def merge_call(self, merge_fn: Callable[..., Any], args: tuple | list = (),
                   kwargs: dict[str, Any] | None = None) -> Any:
        """Run ``merge_fn(strategy, *args, **kwargs)`` and return its result. Each replica is a
        process here, so it runs once in every process with this replica's ``args``; combine
        values with ``strategy.reduce``/``gather`` inside it (every replica reaches the call)."""
        if not callable(merge_fn):
            raise TypeError(f"merge_call() needs a callable, got {type(merge_fn).__name__}")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"merge_call(fn, args=...) takes a tuple of arguments, got "
                            f"{type(args).__name__}. HINT: write args=(value,)")
        return merge_fn(self.strategy, *args, **dict(kwargs or {}))

    def __repr__(self) -> str:
        return (f"ReplicaContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")


def get_replica_context() -> ReplicaContext:
    """The context of the active strategy, or a one-replica default context outside any."""
    return ReplicaContext(current_strategy())
