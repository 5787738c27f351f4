"""Cross-device all-reduce algorithms: the one argument that picks how replicas communicate.

An algorithm sums a flat tensor over a group in place and returns a handle, so communication
overlaps ``backward()``: the backend's own and reduce-to-one (central storage needs its reduce
step alone) here, ring, hierarchical and shared memory beside. A new one subclasses
:class:`CrossDeviceOps` and implements ``_sum_now``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from replicator.comm.bucket_layout import BucketLayout
from replicator.comm.comm_thread import forget_at_shutdown, lane
from replicator.comm.groups import check_member, group_size
from replicator.comm.handles import DONE, Handle

if TYPE_CHECKING:
    from replicator.comm.compression import Compression

__all__ = ["CrossDeviceOps", "NativeAllReduce", "ReductionToOneDevice", "Handle",
           "BucketLayout"]

BufferSpec = tuple[int, torch.dtype, torch.device]


def _describe(tensor: torch.Tensor) -> str:
    nbytes = tensor.numel() * tensor.element_size()
    size = f"{nbytes / 1e6:.1f} MB" if nbytes >= 100_000 else f"{nbytes} bytes"
    return f"{size} {str(tensor.dtype).replace('torch.', '')}"


class CrossDeviceOps(ABC):
    """Base class of the all-reduce algorithms (tf.distribute's); ``timeout_seconds``: ``None``
    takes the process group's."""

    name: str = "base"

    def __init__(self, *, compression: Compression | None = None,
                 timeout_seconds: float | None = None) -> None:
        from replicator.comm.compression import Compression

        if compression is not None and not isinstance(compression, Compression):
            raise TypeError(f"compression must be a Compression such as "
                            f"rp.comm.Compression.fp16(), got {type(compression).__name__}")
        if timeout_seconds is not None and timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be positive, got {timeout_seconds}")
        self.compression = compression
        self.timeout_seconds = timeout_seconds
        forget_at_shutdown(self)

    def forget_groups(self) -> None:
        """Drop state kept per process group; called at shutdown, before the groups are
        destroyed."""
        return None

    # -- public API ---------------------------------------------------------------------------
    def all_reduce_sum_async(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                             *, layout: BucketLayout | None = None) -> Handle:
        """Start summing ``tensor`` in place across ``group``; ``layout``: its gradients (for
        PowerSGD)."""
        self._check(tensor, "all_reduce_sum_async")
        check_member(group, "all_reduce_sum_async")
        world = group_size(group)
        if world == 1 or tensor.numel() == 0:
            return DONE
        what = f"{self.name} all-reduce of {_describe(tensor)}"
        if self.compression is not None:
            compression = self.compression

            def compressed(g: dist.ProcessGroup | None) -> None:
                compression.all_reduce_sum(tensor, layout, lambda t: self._sum_now(t, g), world)

            return self._on_lane(group, what, tensor, compressed)
        return self._start(tensor, group, what)

    def all_reduce_sum(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                       *, layout: BucketLayout | None = None) -> None:
        """Sum ``tensor`` in place across ``group`` and wait for the result."""
        self.all_reduce_sum_async(tensor, group, layout=layout).wait()

    def reduce_sum_async(self, tensor: torch.Tensor, dst: int = 0,
                         group: dist.ProcessGroup | None = None, *,
                         layout: BucketLayout | None = None) -> Handle:
        """Start summing ``tensor`` onto group rank ``dst`` only (central storage's reduce); only
        ``dst``'s tensor is defined afterwards. With compression this is a compressed all-reduce."""
        self._check(tensor, "reduce_sum_async")
        check_member(group, "reduce_sum_async")
        world = group_size(group)
        if isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < world:
            raise ValueError(
                f"reduce_sum_async(dst={dst!r}): dst is a group rank, from 0 to {world - 1} "
                f"for this group of {world}. HINT: for a global rank r, pass "
                "torch.distributed.get_group_rank(group, r)")
        if world == 1 or tensor.numel() == 0:
            return DONE
        if self.compression is not None:
            return self.all_reduce_sum_async(tensor, group, layout=layout)
        what = f"{self.name} reduce to group rank {dst} of {_describe(tensor)}"
        return self._start_reduce(tensor, dst, group, what)

    def release_buckets(self, owner: int | None = None) -> None:
        """Forget the compression state of ``owner``'s buckets (``None``: all), its model gone."""
        if self.compression is not None:
            self.compression.release(owner)

    def make_buffers(self, specs: Sequence[BufferSpec],
                     group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
        """Flat buffers ``(numel, dtype, device)``, made in the same order on every rank, where
        this algorithm communicates fastest."""
        return [torch.empty(n, dtype=d, device=dev) for n, d, dev in specs]

    def __repr__(self) -> str:
        fields = [f"{k}={v!r}" for k, v in self._fields().items()]
        if self.compression is not None:
            fields.append(f"compression={self.compression!r}")
        return f"{type(self).__name__}({', '.join(fields)})"

    def _fields(self) -> dict[str, object]:
        """The settings :meth:`__repr__` shows besides compression."""
        return {}

    # -- hooks for subclasses -------------------------------------------------------------------
    @abstractmethod
    def _sum_now(self, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        """Sum ``tensor`` in place over exactly ``group``, on the calling thread."""

    def _reduce_now(self, tensor: torch.Tensor, dst: int,
                    group: dist.ProcessGroup | None) -> None:
        """Sum onto group rank ``dst`` (default: a full all-reduce, also correct on ``dst``)."""
        self._sum_now(tensor, group)

    def _prepare(self, group: dist.ProcessGroup | None,  # noqa: B027 - optional hook
                 private: dist.ProcessGroup) -> None:
        """Collective set-up over the caller's ``group``, on its thread, before work runs on the
        lane."""

    def _start(self, tensor: torch.Tensor, group: dist.ProcessGroup | None,
               what: str) -> Handle:
        return self._on_lane(group, what, tensor, lambda g: self._sum_now(tensor, g))

    def _start_reduce(self, tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None,
                      what: str) -> Handle:
        return self._on_lane(group, what, tensor, lambda g: self._reduce_now(tensor, dst, g))

    def _on_lane(self, group: dist.ProcessGroup | None, what: str, tensor: torch.Tensor,
                 work: Callable[[dist.ProcessGroup], None]) -> Handle:
        """Run ``work(private)`` on ``group``'s lane, over the lane's private copy of it."""
        ln = lane(group)
        self._prepare(group, ln.group)
        return ln.submit(lambda: work(ln.group), what, tensor, self.timeout_seconds)

    @staticmethod
    def _check(tensor: torch.Tensor, call: str) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{call} takes a tensor, got {type(tensor).__name__}")
        if tensor.layout != torch.strided:
            raise TypeError(f"{call} takes a dense tensor, got layout {tensor.layout}")
        if not tensor.is_contiguous():
            raise ValueError(f"{call} needs a contiguous tensor (it works on the memory in "
                             "place). HINT: pass tensor.contiguous() and copy the result back")


class NativeAllReduce(CrossDeviceOps):
    """The backend's own all-reduce: NCCL on GPUs, gloo on CPUs. Asynchronous in the backend."""

    name = "native"

    def _start(self, tensor: torch.Tensor, group: dist.ProcessGroup | None,
               what: str) -> Handle:
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return work if work is not None else DONE

    def _start_reduce(self, tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None,
                      what: str) -> Handle:
        work = dist.reduce(tensor, group_dst=dst, op=dist.ReduceOp.SUM, group=group,
                           async_op=True)
        return work if work is not None else DONE

    def _sum_now(self, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)

    def _reduce_now(self, tensor: torch.Tensor, dst: int,
                    group: dist.ProcessGroup | None) -> None:
        dist.reduce(tensor, group_dst=dst, op=dist.ReduceOp.SUM, group=group)


class ReductionToOneDevice(CrossDeviceOps):
    """Reduce to replica ``destination`` (a group rank), then broadcast from it: tf.distribute's;
    simple, but the destination carries all the traffic."""

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

    def _fields(self) -> dict[str, object]:
        return {"destination": self.destination}
