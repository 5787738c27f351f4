"""Cross-device all-reduce algorithms: the one argument that picks how replicas communicate.

An algorithm sums a flat tensor over a group in place and returns a handle, so communication
overlaps ``backward()``. ``NativeAllReduce`` (NCCL, gloo) is the default; ring, hierarchical,
reduce-to-one and shared-memory live beside it. Each takes ``compression=``; replica ranks
(``dst``, ``destination=``) are group ranks. A new one subclasses :class:`CrossDeviceOps` and
implements ``_sum_now`` (run on the group's lane, ``comm_thread.py``).
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from replicator.comm.bucket_layout import BucketLayout
from replicator.comm.comm_thread import lane, on_groups_released
from replicator.comm.groups import check_member, group_size
from replicator.comm.handles import DONE, Done, Handle

if TYPE_CHECKING:
    from replicator.comm.compression import Compression

__all__ = ["CrossDeviceOps", "NativeAllReduce", "Handle", "BucketLayout"]

_Done = Done  # the name earlier code used

BufferSpec = tuple[int, torch.dtype, torch.device]


def _describe(tensor: torch.Tensor) -> str:
    nbytes = tensor.numel() * tensor.element_size()
    size = f"{nbytes / 1e6:.1f} MB" if nbytes >= 100_000 else f"{nbytes} bytes"
    return f"{size} {str(tensor.dtype).replace('torch.', '')}"


#: Every algorithm object alive in this process (weakly), so that shutdown can make each one
#: drop the process groups it keeps before the groups are destroyed.
_LIVE: weakref.WeakSet[CrossDeviceOps] = weakref.WeakSet()


def forget_all_groups() -> None:
    """Make every live algorithm drop what it keeps per process group (run at shutdown): groups
    still referenced at interpreter teardown are destroyed after gloo's static state, which aborts
    the process."""
    for algorithm in list(_LIVE):
        algorithm.forget_groups()


on_groups_released(forget_all_groups)

class CrossDeviceOps(ABC):
    """Base class of the all-reduce algorithms (tf.distribute's ``CrossDeviceOps``).
    ``compression``: ``Compression.fp16()``, ``.bf16()``, ``.powersgd(rank)`` or ``None``;
    ``timeout_seconds``: how long a wait may last (``None``: the process group's).
    """

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
        _LIVE.add(self)

    def forget_groups(self) -> None:
        """Drop state kept per process group (host layouts, shared-memory channels); the next
        use on a group builds it again. Called at shutdown, before groups are destroyed."""
        return None

    # -- public API ---------------------------------------------------------------------------
    def all_reduce_sum_async(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                             *, layout: BucketLayout | None = None) -> Handle:
        """Start summing ``tensor`` in place across ``group``; return a handle to wait on.
        ``layout``: the gradients packed in ``tensor`` (for PowerSGD and error feedback)."""
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
        """Forget the compression state of ``owner``'s buckets (``None``: all), when a model whose
        gradients this algorithm summed is gone."""
        if self.compression is not None:
            self.compression.release(owner)

    def make_buffers(self, specs: Sequence[BufferSpec],
                     group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
        """Allocate flat buffers ``(numel, dtype, device)`` for this algorithm, once and in the same
        order on every rank, where it communicates fastest (shared memory, say)."""
        return [torch.empty(n, dtype=d, device=dev) for n, d, dev in specs]

    def __repr__(self) -> str:
        extra = f"compression={self.compression!r}" if self.compression is not None else ""
        return f"{type(self).__name__}({extra})"

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
        """Collective set-up, on the caller's thread over the caller's ``group``, before work
        runs on the lane whose private copy of the group is ``private``."""

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
