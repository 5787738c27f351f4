"""Cross-device all-reduce algorithms: the one argument that picks how replicas communicate.

An algorithm sums a flat tensor across the replicas of a process group, in place, and may
return a handle to wait on so that communication overlaps the rest of ``backward()``.
``NativeAllReduce`` is the backend's own (NCCL on GPU, gloo on CPU) and the default.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch
import torch.distributed as dist


class Handle(Protocol):
    def wait(self) -> object: ...


class _Done:
    """A handle for work that already finished."""

    def wait(self) -> bool:
        return True


class CrossDeviceOps(ABC):
    """Base class of the all-reduce algorithms (tf.distribute's ``CrossDeviceOps``)."""

    name: str = "base"

    @abstractmethod
    def all_reduce_sum_async(self, tensor: torch.Tensor,
                             group: dist.ProcessGroup | None = None) -> Handle:
        """Start summing ``tensor`` in place across the group; return a handle to wait on."""

    def all_reduce_sum(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
        self.all_reduce_sum_async(tensor, group).wait()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NativeAllReduce(CrossDeviceOps):
    """The backend's own all-reduce: NCCL on GPUs, gloo on CPUs."""

    name = "native"

    def all_reduce_sum_async(self, tensor: torch.Tensor,
                             group: dist.ProcessGroup | None = None) -> Handle:
        if tensor.numel() == 0:
            return _Done()
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return work if work is not None else _Done()
