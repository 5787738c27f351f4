"""Cross-device all-reduce algorithms (docs/collectives.md): each sums a flat tensor over a group
in place and returns a handle; any serves as a DDP communication hook, each hook its own bucket
owner so two hooked models keep their compression state apart."""

from __future__ import annotations

import concurrent.futures
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from replicator.comm.comm_thread import DONE, Handle, ThreadHandle, forget_at_shutdown, lane
from replicator.comm.compression import BucketLayout, Compression
from replicator.comm.groups import check_member, group_size

__all__ = ["CrossDeviceOps", "NativeAllReduce", "ReductionToOneDevice", "Handle",
           "BucketLayout", "ddp_comm_hook", "register_ddp_comm_hook"]

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
        if compression is not None and not isinstance(compression, Compression):
            raise TypeError(f"compression must be a Compression such as "
                            f"rp.comm.Compression.fp16(), got {type(compression).__name__}")
        if timeout_seconds is not None and timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be positive, got {timeout_seconds}")
        self.compression = compression
        self.timeout_seconds = timeout_seconds
        forget_at_shutdown(self)

    def forget_groups(self) -> None:
        """Drop state kept per process group (at shutdown, before the groups are destroyed)."""
        return None

    def all_reduce_sum_async(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                             *, layout: BucketLayout | None = None) -> Handle:
        """Start summing ``tensor`` in place across ``group``; ``layout``: its gradients (for
        PowerSGD)."""
        world = self._world(tensor, group, "all_reduce_sum_async")
        if world == 1 or tensor.numel() == 0:
            return DONE
        what = f"{self.name} all-reduce of {_describe(tensor)}"
        if (compression := self.compression) is not None:  # on the lane's private group
            return self._on_lane(group, what, tensor, lambda g: compression.all_reduce_sum(
                tensor, layout, lambda t: self._sum_now(t, g), world))
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
        world = self._world(tensor, group, "reduce_sum_async")
        if isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < world:
            raise ValueError(f"reduce_sum_async(dst={dst!r}): dst is a group rank, from 0 to "
                             f"{world - 1} for this group of {world}. HINT: for a global rank r, "
                             "pass torch.distributed.get_group_rank(group, r)")
        if world == 1 or tensor.numel() == 0:
            return DONE
        if self.compression is not None:
            return self.all_reduce_sum_async(tensor, group, layout=layout)
        what = f"{self.name} reduce to group rank {dst} of {_describe(tensor)}"
        return self._start(tensor, group, what, dst)

    def release_buckets(self, owner: int | None = None) -> None:
        """Forget the compression state of ``owner``'s buckets (``None``: all), its model gone."""
        if self.compression is not None:
            self.compression.release(owner)

    def make_buffers(self, specs: Sequence[BufferSpec],
                     group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
        """Flat buffers for ``specs``, made alike on every rank, where this algorithm is fastest."""
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

    def _reduce_now(self, tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None) -> None:
        """Sum onto group rank ``dst`` (default: a full all-reduce, also correct on ``dst``)."""
        self._sum_now(tensor, group)

    def _prepare(self, group: dist.ProcessGroup | None,  # noqa: B027 - optional hook
                 private: dist.ProcessGroup) -> None:
        """Collective set-up over the caller's ``group``, on its thread, before the lane runs."""

    def _start(self, tensor: torch.Tensor, group: dist.ProcessGroup | None, what: str,
               dst: int | None = None) -> Handle:
        """Start the sum of ``tensor`` (onto group rank ``dst`` only, when given) on the lane."""
        if dst is None:
            return self._on_lane(group, what, tensor, lambda g: self._sum_now(tensor, g))
        return self._on_lane(group, what, tensor, lambda g: self._reduce_now(tensor, dst, g))

    def _on_lane(self, group: dist.ProcessGroup | None, what: str, tensor: torch.Tensor,
                 work: Callable[[dist.ProcessGroup], None]) -> Handle:
        """Run ``work(private)`` on ``group``'s lane, over the lane's private copy of it."""
        ln = lane(group)
        self._prepare(group, ln.group)
        return ln.submit(lambda: work(ln.group), what, tensor, self.timeout_seconds)

    @staticmethod
    def _world(tensor: torch.Tensor, group: dist.ProcessGroup | None, call: str) -> int:
        """The size of ``group`` once ``tensor`` and this process's membership are checked."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{call} takes a tensor, got {type(tensor).__name__}")
        if tensor.layout != torch.strided:
            raise TypeError(f"{call} takes a dense tensor, got layout {tensor.layout}")
        if not tensor.is_contiguous():
            raise ValueError(f"{call} needs a contiguous tensor (it works on the memory in "
                             "place). HINT: pass tensor.contiguous() and copy the result back")
        check_member(group, call)
        return group_size(group)


class NativeAllReduce(CrossDeviceOps):
    """The backend's own all-reduce: NCCL on GPUs, gloo on CPUs. Asynchronous in the backend."""

    name = "native"

    def _start(self, tensor: torch.Tensor, group: dist.ProcessGroup | None, what: str,
               dst: int | None = None) -> Handle:
        if dst is None:
            return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True) or DONE
        return dist.reduce(tensor, group_dst=dst, op=dist.ReduceOp.SUM, group=group,
                           async_op=True) or DONE

    def _sum_now(self, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)

    def _reduce_now(self, tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None) -> None:
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

    _reduce_now = NativeAllReduce._reduce_now  # the backend's reduce, as in _sum_now

    def _fields(self) -> dict[str, object]:
        return {"destination": self.destination}


def as_torch_future(handle: Handle, value: torch.Tensor,
                    then: Callable[[torch.Tensor], torch.Tensor] | None = None
                    ) -> torch.futures.Future:
    """A ``torch.futures.Future`` completed with ``then(value)`` when ``handle`` is done."""
    finish = then or (lambda t: t)
    if isinstance(handle, torch.distributed.Work):
        return handle.get_future().then(lambda _: finish(value))
    devices: list[int | str | torch.device] | None = \
        [value.device] if value.device.type == "cuda" else None
    fut: torch.futures.Future = torch.futures.Future(devices=devices)
    if isinstance(handle, ThreadHandle):
        def complete(done: concurrent.futures.Future) -> None:  # on the lane
            try:
                done.result()  # the lane's error, if any
                fut.set_result(finish(value))
            except BaseException as exc:  # noqa: BLE001 - handed to the future's waiter
                fut.set_exception(exc)

        handle.future.add_done_callback(complete)
        return fut
    handle.wait()
    fut.set_result(finish(value))
    return fut


CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future]

_OWNERS = itertools.count(-1, -1)


def ddp_comm_hook(ops: CrossDeviceOps) -> CommHook:
    """A hook for ``DistributedDataParallel.register_comm_hook(state, hook)``; ``state``: a group
    or ``None``."""
    if not isinstance(ops, CrossDeviceOps):
        raise TypeError(f"ddp_comm_hook takes a CrossDeviceOps such as rp.comm.RingAllReduce(), "
                        f"got {type(ops).__name__}")
    owner = next(_OWNERS)

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future:
        group = state if isinstance(state, dist.ProcessGroup) else None
        tensor = bucket.buffer()
        world = group_size(group)
        layout = BucketLayout.from_shapes(bucket.index(), [p.shape for p in bucket.parameters()],
                                          owner=owner)
        if layout.numel != tensor.numel():  # DDP padded the bucket: the shapes do not apply
            layout = BucketLayout.from_shapes(bucket.index(), [tensor.shape], owner=owner)
        handle = ops.all_reduce_sum_async(tensor, group, layout=layout)
        return as_torch_future(handle, tensor, lambda t: t.div_(world))

    # DDP inspects the annotations; give it the objects, not this module's postponed strings
    hook.__annotations__ = {"state": Any, "bucket": dist.GradBucket,
                            "return": torch.futures.Future[torch.Tensor]}
    hook.__name__ = f"{ops.name}_comm_hook"
    hook.__qualname__ = hook.__name__
    return hook


def register_ddp_comm_hook(model: torch.nn.parallel.DistributedDataParallel,
                           ops: CrossDeviceOps) -> None:
    """Make ``model`` (a DDP module) sum its gradient buckets with ``ops``."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"register_ddp_comm_hook takes a DistributedDataParallel model, got "
                        f"{type(model).__name__}")
    model.register_comm_hook(model.process_group, ddp_comm_hook(ops))
