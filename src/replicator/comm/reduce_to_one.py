"""Reduction to one device: sum everything on one replica, then broadcast the sum.

tf.distribute's ``ReductionToOneDevice``: simple and robust, but the destination carries all
the traffic; its reduce step alone is what central storage needs. ``destination`` (and
``dst``) is a group rank, so one object serves any group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from replicator.comm.algorithms import CrossDeviceOps
from replicator.comm.compression import Compression
from replicator.comm.groups import group_size


class ReductionToOneDevice(CrossDeviceOps):
    """Reduce to replica ``destination`` (a group rank: position within the group), then
    broadcast from it."""

    name = "reduce_to_one"

    def __init__(self, destination: int = 0, *, compression: Compression | None = None,
                 timeout_seconds: float | None = None) -> None:
        super().__init__(compression=compression, timeout_seconds=timeout_seconds)
        if isinstance(destination, bool) or not isinstance(destination, int) or destination < 0:
            raise ValueError(f"destination must be a replica index >= 0, got {destination!r}")
        self.destination = destination

    def _dst(self, group: dist.ProcessGroup | None) -> int:
        world = group_size(group)
        if self.destination >= world:
            raise ValueError(f"ReductionToOneDevice(destination={self.destination}) needs at "
                             f"least {self.destination + 1} replicas, the group has {world}. "
                             "HINT: destination is a group rank (a position within the group), "
                             "not a global rank")
        return self.destination

    def _prepare(self, group: dist.ProcessGroup | None, private: dist.ProcessGroup) -> None:
        self._dst(group)  # a wrong destination fails here, on the caller's thread

    def _sum_now(self, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        dst = self._dst(group)
        dist.reduce(tensor, group_dst=dst, op=dist.ReduceOp.SUM, group=group)
        dist.broadcast(tensor, group_src=dst, group=group)

    def _reduce_now(self, tensor: torch.Tensor, dst: int,
                    group: dist.ProcessGroup | None) -> None:
        dist.reduce(tensor, group_dst=dst, op=dist.ReduceOp.SUM, group=group)

    def __repr__(self) -> str:
        extra = f", compression={self.compression!r}" if self.compression is not None else ""
        return f"ReductionToOneDevice(destination={self.destination}{extra})"
