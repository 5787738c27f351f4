"""The process group across replica groups: torchft's reconfigurable gloo group, whose float
sums go through a shared-memory segment when every group of the quorum runs on this host.

Measured on a 2-core host (``benchmarks/recovery.py``: 3 groups, a 16 MB gradient, medians of
three runs): gloo over loopback took 20.9 ms a step against 10.7 ms for ``MirroredStrategy``'s
shared-memory all-reduce; through the segment the groups take 11.1 ms. The segment is made anew
at each reconfiguration (each quorum change), over the new gloo group, so a healed group never
meets an old one's counters. A lost peer ends the sum within about half a second (the flag
barrier checks that the processes it waits for exist) or the collective timeout, and torchft
redoes the step as it does after a gloo error. Across hosts, and for anything but a sum of
CPU floating-point tensors, the gloo group does the work.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import AllreduceOptions
from torchft.process_group import ProcessGroupGloo  # type: ignore[import-untyped]
from torchft.work import _DummyWork  # type: ignore[import-untyped]

from replicator.comm.shared_memory import SharedMemoryAllReduce
from replicator.comm.shm_segment import (
    all_on_this_host,
    flag_barrier_is_safe,
    shared_memory_problem,
)
from replicator.errors import ReplicatorError
from replicator.strategies.live.settings import TRANSPORTS

log = logging.getLogger("replicator")


class LiveProcessGroup(ProcessGroupGloo):  # type: ignore[misc]
    """torchft's ``ProcessGroupGloo`` with a same-host shared-memory sum (see the module doc);
    ``transport="gloo"`` keeps every collective on gloo."""

    def __init__(self, timeout: timedelta, transport: str = "auto") -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        super().__init__(timeout=timeout)
        self._transport = transport
        self._shared: SharedMemoryAllReduce | None = None
        self._buffers: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._error: BaseException | None = None

    @property
    def uses_shared_memory(self) -> bool:
        """True while this configuration sums through a shared-memory segment."""
        return self._shared is not None

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  *args: Any, **kwargs: Any) -> None:
        """torchft's reconfiguration (a new gloo group), then whether every member can sum
        through a new segment."""
        self._drop_shared()
        super().configure(store_addr, replica_id, rank, world_size, *args, **kwargs)
        if self._transport == "gloo" or world_size < 2:
            return
        usable = flag_barrier_is_safe() and not shared_memory_problem()
        if not all_on_this_host(self.parent, usable):
            return
        shared = SharedMemoryAllReduce(timeout_seconds=self._timeout.total_seconds())
        try:  # a collective that fails on every member alike (a full /dev/shm, say)
            shared.channel(self.parent)
        except ReplicatorError as exc:
            log.warning("the replica groups sum through gloo: %s", exc)
            return
        self._shared = shared
        log.info("the %d replica groups sum through shared memory", world_size)

    def buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat tensor to sum in place: in this configuration's segment where shared memory
        is used (no copy in or out), else ordinary memory. Every member asks for the same
        sizes in the same order (the first ask of a size is a collective)."""
        shared = self._shared
        if shared is None or device.type != "cpu" or self._error is not None:
            return torch.empty(numel, dtype=dtype, device=device)
        found = self._buffers.get((numel, dtype))
        if found is None:
            try:
                found = shared.make_buffers([(numel, dtype, device)], self.parent)[0]
            except Exception as exc:  # noqa: BLE001 - a peer lost while the segment was made
                # the sum that follows raises inside torchft's all-reduce, which skips the step
                self._error = exc
                return torch.empty(numel, dtype=dtype, device=device)
            self._buffers[(numel, dtype)] = found
        return found

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        shared = self._shared
        if shared is None or not _summable(tensors, opts):
            return super().allreduce(tensors, opts)
        if self._error is not None:  # the segment's counters no longer agree: torchft reconfigures
            raise ReplicatorError(f"the shared-memory sum across replica groups failed before "
                                  f"in this quorum: {self._error}")
        try:
            for tensor in tensors:
                shared.all_reduce_sum(tensor, self.parent)
        except Exception as exc:
            self._error = exc
            raise
        return _DummyWork(tensors)

    def abort(self, errored: bool = True) -> None:
        self._drop_shared()
        super().abort(errored)

    def shutdown(self) -> None:
        self._drop_shared()
        super().shutdown()

    def _drop_shared(self) -> None:
        if self._shared is not None:
            self._shared.forget_groups()
        self._shared, self._error = None, None
        self._buffers.clear()


def _summable(tensors: list[torch.Tensor], opts: Any) -> bool:
    """A sum of contiguous CPU floating-point tensors (what every member decides alike from
    the same call)."""
    op = opts.reduceOp if isinstance(opts, AllreduceOptions) else opts
    return op == dist.ReduceOp.SUM and all(
        t.device.type == "cpu" and t.is_floating_point() and t.is_contiguous()
        for t in tensors)
