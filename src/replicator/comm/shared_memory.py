"""Same-host all-reduce through shared memory, with no sockets involved.

Each rank copies its piece into its slot of a shared segment; after a barrier rank ``p`` sums
chunk ``p`` of every slot into every slot; after a second each copies its slot back: about
three passes over the tensor, about 2x gloo on loopback. Buffers from
:meth:`SharedMemoryAllReduce.make_buffers` (the gradient buckets) live in the segment: two
barriers and one pass, close to memcpy speed. No background thread (on CPU it would compete
with ``backward()``); resident buffers are still asynchronous (a launch sums what is ready and
leaves the rest to later launches or ``wait()``). Each group gets its own segment, named after
its ranks plus a random part.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from replicator.cluster.timeouts import resolve_timeout
from replicator.comm.algorithms import BufferSpec, CrossDeviceOps
from replicator.comm.compression import Compression
from replicator.comm.groups import (
    global_rank,
    group_rank,
    group_ranks,
    group_size,
)
from replicator.comm.handles import DONE, Handle
from replicator.comm.op_errors import algorithm_error
from replicator.comm.shm_segment import (
    ALIGN,
    FlagBarrier,
    SharedSegment,
    align,
    check_same_host,
    flag_barrier_is_safe,
)
from replicator.errors import ReplicatorError

log = logging.getLogger("replicator")

DEFAULT_PIECE_BYTES = 4 << 20
DEFAULT_MAX_RESIDENT_BYTES = 2 << 30
_WHO = "shared-memory all-reduce"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _sum_chunk(slots: list[torch.Tensor], me: int, lo: int, hi: int) -> None:
    """Sum ``[lo, hi)`` of every slot into slot ``me``, then copy it into every other slot."""
    if hi <= lo:
        return
    out = slots[me][lo:hi]
    others = [s[lo:hi] for i, s in enumerate(slots) if i != me]
    for other in others:
        out.add_(other)
    for other in others:
        other.copy_(out)


@dataclass
class _Resident:
    """A buffer made by ``make_buffers``: the other ranks' copies, as views into one segment
    (this rank's copy is not held, so the segment goes when the caller drops its buffers)."""

    segment: SharedSegment
    rank: int
    ranks: tuple[int, ...]
    others: dict[int, torch.Tensor]

    def slots(self, mine: torch.Tensor) -> list[torch.Tensor]:
        return [mine if r == self.rank else self.others[r] for r in range(len(self.others) + 1)]


@dataclass
class _Pending:
    """An all-reduce of a resident buffer, number ``number`` in this channel's order."""

    slots: list[torch.Tensor]
    number: int
    summed: bool = False


class _Channel:
    """The segment with the barrier flags and the per-rank piece slots for one group. Each rank
    announces all-reduce ``k`` (INPUTS), sums its chunk once all did, then bumps SUMS; ``k`` is done
    when every SUMS reached it. Resident launches sum what is ready, so backward never stalls.
    """

    def __init__(self, group: dist.ProcessGroup | None, piece_bytes: int,
                 timeout_seconds: float) -> None:
        check_same_host(group, _WHO)
        self.world, self.rank = group_size(group), group_rank(group)
        self.piece_bytes = piece_bytes
        self.header = align(FlagBarrier.nbytes(self.world), 4096)
        self.segment = SharedSegment.create(self.header + self.world * piece_bytes, group, _WHO)
        self.barrier = FlagBarrier(self.segment, 0, group, timeout_seconds, _WHO)
        self._queue: deque[_Pending] = deque()

    # -- resident buffers: asynchronous -----------------------------------------------------
    def launch(self, slots: list[torch.Tensor]) -> _Pending:
        op = _Pending(slots, self.barrier.arrive(FlagBarrier.INPUTS))
        self._queue.append(op)
        self._advance(None)
        return op

    def complete(self, op: _Pending) -> None:
        """Block until ``op``'s sums are in every slot."""
        if not op.summed:
            self._advance(op)
        self.barrier.wait_for(op.number, "sums written", FlagBarrier.SUMS)

    def _advance(self, target: _Pending | None) -> None:
        """Sum this rank's chunks in order; block only until ``target`` (if any) is summed."""
        while self._queue:
            op = self._queue[0]
            if not self.barrier.ready(op.number, FlagBarrier.INPUTS):
                if target is None:
                    return
                self.barrier.wait_for(op.number, "inputs written", FlagBarrier.INPUTS)
            n = op.slots[0].numel()
            _sum_chunk(op.slots, self.rank, n * self.rank // self.world,
                       n * (self.rank + 1) // self.world)
            self.barrier.arrive(FlagBarrier.SUMS)
            op.summed = True
            self._queue.popleft()
            if op is target:
                return

    # -- any tensor: copied through the slots, synchronous -------------------------------------
    def drain(self) -> None:
        """Finish every resident all-reduce launched before, in order."""
        while self._queue:
            self._advance(self._queue[-1])

    def sum_copy(self, flat: torch.Tensor) -> None:
        self.drain()
        n, size = flat.numel(), flat.element_size()
        piece = self.piece_bytes // size
        inputs, sums = FlagBarrier.INPUTS, FlagBarrier.SUMS
        for start in range(0, n, piece):
            m = min(piece, n - start)
            slots = [self.segment.view(self.header + s * self.piece_bytes, m, flat.dtype)
                     for s in range(self.world)]
            slots[self.rank].copy_(flat[start:start + m])
            number = self.barrier.arrive(inputs)
            self.barrier.wait_for(number, "inputs written", inputs)
            _sum_chunk(slots, self.rank, m * self.rank // self.world,
                       m * (self.rank + 1) // self.world)
            self.barrier.arrive(sums)
            self.barrier.wait_for(number, "sums written", sums)
            flat[start:start + m].copy_(slots[self.rank])


    def exchange_bytes(self, mine: Sequence[torch.Tensor],
                       read: Callable[[int, list[tuple[torch.Tensor, int, int, int]]], None],
                       writer: int | None) -> None:
        """Move byte views through the slots, a slot-full at a time: ``mine`` (``uint8`` views) is
        written to this rank's slot (by ``writer`` only, if given); after each fill
        ``read(slot_rank, pieces)`` runs per slot read, ``pieces`` as ``(view, start, length,
        offset)``.
        """
        self.drain()
        cap = self.piece_bytes
        batch: list[tuple[torch.Tensor, int, int, int]] = []
        fill = 0
        inputs, sums = FlagBarrier.INPUTS, FlagBarrier.SUMS
        slots = [self.segment.view(self.header + s * cap, cap, torch.uint8)
                 for s in range(self.world)]

        def flush() -> None:
            if writer is None or writer == self.rank:
                own = slots[self.rank]
                for view, start, length, offset in batch:
                    own[offset:offset + length].copy_(view[start:start + length])
            number = self.barrier.arrive(inputs)
            self.barrier.wait_for(number, "inputs written", inputs)
            for s in ([writer] if writer is not None else range(self.world)):
                read(s, batch)
            self.barrier.arrive(sums)
            self.barrier.wait_for(number, "inputs read", sums)

        for view in mine:
            pos, n = 0, view.numel()
            while pos < n:
                take = min(cap - fill, n - pos)
                batch.append((view, pos, take, fill))
                fill += take
                pos += take
                if fill == cap:
                    flush()
                    batch, fill = [], 0
        if batch:
            flush()

    def slot(self, rank: int) -> torch.Tensor:
        return self.segment.view(self.header + rank * self.piece_bytes, self.piece_bytes,
                                 torch.uint8)


class _ResidentHandle:
    """``wait()`` finishes the resident all-reduce (and those launched before it)."""

    def __init__(self, channel: _Channel, op: _Pending, what: str) -> None:
        self._channel, self._op, self._what = channel, op, what

    def wait(self) -> bool:
        try:
            self._channel.complete(self._op)
        except Exception as exc:
            raise algorithm_error(exc, global_rank(), self._what) from exc
        return True


class SharedMemoryAllReduce(CrossDeviceOps):
    """All-reduce through a shared-memory segment; every replica must be on this host, on CPU.
    ``piece_bytes``: the per-rank slot for other tensors (4 MB); ``max_resident_bytes``: the most
    ``make_buffers`` may place in shared memory (beyond it, buckets go through the slots).
    """

    name = "shared_memory"
    #: From this many bytes on, :meth:`pays_for` sends reduce/gather/broadcast through the
    #: segment rather than the backend: any non-empty tensor (a 4-byte reduce takes about
    #: 70 us through the segment against about 580 us on gloo over loopback).
    LARGE_BYTES = 1

    def __init__(self, piece_bytes: int = DEFAULT_PIECE_BYTES, *,
                 max_resident_bytes: int = DEFAULT_MAX_RESIDENT_BYTES,
                 compression: Compression | None = None,
                 timeout_seconds: float | None = None) -> None:
        super().__init__(compression=compression, timeout_seconds=timeout_seconds)
        if piece_bytes < ALIGN:
            raise ValueError(f"piece_bytes must be at least {ALIGN}, got {piece_bytes}")
        if max_resident_bytes < 0:
            raise ValueError(f"max_resident_bytes must be >= 0, got {max_resident_bytes}")
        self.piece_bytes = align(piece_bytes)
        self.max_resident_bytes = max_resident_bytes
        self._channels: weakref.WeakKeyDictionary[dist.ProcessGroup, _Channel] = \
            weakref.WeakKeyDictionary()
        self._resident: dict[tuple[int, int, torch.dtype], _Resident] = {}

    def forget_groups(self) -> None:
        # a channel holds its group: in a weak-keyed map that keeps the key alive for good
        self._channels.clear()

    # -- set-up -------------------------------------------------------------------------------
    def _channel(self, group: dist.ProcessGroup | None) -> _Channel:
        """The channel of ``group`` (a collective over it on first use)."""
        key = dist.group.WORLD if group is None else group
        if key is None:
            raise RuntimeError("no process group is running. HINT: start one first")
        found = self._channels.get(key)
        if found is None:
            timeout = resolve_timeout(self.timeout_seconds, group=group)
            found = self._channels[key] = _Channel(group, self.piece_bytes, timeout)
        return found

    def open_channel(self, group: dist.ProcessGroup | None = None) -> None:
        """Create ``group``'s segment now rather than at first use (a collective); raises
        :class:`~replicator.errors.ReplicatorError` on every rank when it cannot."""
        self._channel(group)

    def make_buffers(self, specs: Sequence[BufferSpec],
                     group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
        """Buffers that live in shared memory (CPU only, within ``max_resident_bytes``)."""
        world = group_size(group)
        offsets, total = [], 0
        for n, dtype, device in specs:
            offsets.append(total)
            if device.type == "cpu":
                total += align(n * torch.empty(0, dtype=dtype).element_size())
        if (world == 1 or total == 0 or world * total > self.max_resident_bytes
                or self.compression is not None):  # compressed data travels in new tensors
            return super().make_buffers(specs, group)
        self._channel(group)
        try:  # a collective that fails on every rank alike (a full /dev/shm, say)
            segment = SharedSegment.create(world * total, group, _WHO)
        except ReplicatorError as exc:
            log.warning("%s: gradient buckets stay in ordinary memory and are copied through "
                        "the segment's slots: %s", _WHO, exc)
            return super().make_buffers(specs, group)
        me = group_rank(group)
        out = []
        for (n, dtype, device), offset in zip(specs, offsets):
            if device.type != "cpu":
                out.append(torch.empty(n, dtype=dtype, device=device))
                continue
            mine = segment.view(me * total + offset, n, dtype)
            key = (mine.data_ptr(), n, dtype)
            others = {s: segment.view(s * total + offset, n, dtype)
                      for s in range(world) if s != me}
            self._resident[key] = _Resident(segment, me, tuple(group_ranks(group)), others)
            weakref.finalize(mine, self._resident.pop, key, None)
            out.append(mine)
        return out

    # -- the work -----------------------------------------------------------------------------
    def _start(self, tensor: torch.Tensor, group: dist.ProcessGroup | None,
               what: str) -> Handle:
        try:
            resident = self._resident_for(tensor, group)
            if resident is not None:
                channel = self._channel(group)
                return _ResidentHandle(channel, channel.launch(resident.slots(tensor)), what)
            self._sum_now(tensor, group)
        except Exception as exc:
            raise algorithm_error(exc, global_rank(), what) from exc
        return DONE

    def _resident_for(self, tensor: torch.Tensor, group: dist.ProcessGroup | None
                      ) -> _Resident | None:
        resident = self._resident.get((tensor.data_ptr(), tensor.numel(), tensor.dtype))
        if resident is None or tensor.device.type != "cpu":
            return None
        if resident.rank != group_rank(group) or resident.ranks != tuple(group_ranks(group)):
            return None  # made for another group: goes through the slots
        return resident

    def _start_reduce(self, tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None,
                      what: str) -> Handle:
        return self._start(tensor, group, what)

    def _sum_now(self, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        if tensor.device.type != "cpu":
            raise TypeError(f"SharedMemoryAllReduce works on CPU tensors, got one on "
                            f"{tensor.device}. HINT: use rp.comm.NativeAllReduce() (NCCL) on GPUs")
        channel = self._channel(group)
        if tensor.numel() == 0:
            return
        resident = self._resident_for(tensor, group)
        if resident is not None:
            channel.complete(channel.launch(resident.slots(tensor)))
        else:
            channel.sum_copy(tensor.view(-1))

    # -- fingerprints (replicator.comm.fingerprint) -------------------------------------------
    def carries_fingerprints(self) -> bool:
        """True where fingerprints can travel through the segment's flags (x86 CPUs): a few
        microseconds instead of a backend round trip per checked collective."""
        return flag_barrier_is_safe()

    def post_fingerprint(self, value: int, group: dist.ProcessGroup | None = None) -> int:
        """Publish this rank's fingerprint ``value``; return its number for
        :meth:`collect_fingerprints` (a collective, in the same order on every rank)."""
        try:
            return self._channel(group).barrier.post(value)
        except Exception as exc:
            raise algorithm_error(exc, global_rank(), "fingerprint exchange") from exc

    def collect_fingerprints(self, number: int, group: dist.ProcessGroup | None = None
                             ) -> list[int]:
        """Every rank's fingerprint number ``number`` in group-rank order (waits for them)."""
        try:
            return self._channel(group).barrier.collect(number)
        except Exception as exc:
            raise algorithm_error(exc, global_rank(), "fingerprint exchange") from exc

    # -- other collectives through the segment (central storage, large reduce/gather) ----------
    def pays_for(self, tensors: Sequence[torch.Tensor]) -> bool:
        """True when moving ``tensors`` through shared memory beats the backend: CPU tensors of
        at least :attr:`LARGE_BYTES` in all."""
        total = sum(t.numel() * t.element_size() for t in tensors)
        return total >= self.LARGE_BYTES and all(t.device.type == "cpu" for t in tensors)

    def broadcast_(self, tensors: Sequence[torch.Tensor], src: int = 0,
                   group: dist.ProcessGroup | None = None) -> None:
        """Overwrite ``tensors`` on every rank of ``group`` with group rank ``src``'s, through
        the segment (a collective: every rank passes tensors of the same shapes and dtypes)."""
        views = self._byte_views(tensors, "broadcast_")
        world = group_size(group)
        if not 0 <= src < world:
            raise ValueError(f"broadcast_(src={src}): src is a group rank, 0 to {world - 1}")
        if world == 1 or not views:
            return
        what = f"shared-memory broadcast of {len(views)} tensor(s) from group rank {src}"
        try:
            channel = self._channel(group)
            me = group_rank(group)

            def read(slot_rank: int, pieces: list[tuple[torch.Tensor, int, int, int]]) -> None:
                if me == src:
                    return
                slot = channel.slot(slot_rank)
                for view, start, length, offset in pieces:
                    view[start:start + length].copy_(slot[offset:offset + length])

            channel.exchange_bytes(views, read, writer=src)
        except Exception as exc:
            raise algorithm_error(exc, global_rank(), what) from exc

    def all_gather(self, tensor: torch.Tensor,
                   group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape and dtype on every rank), in group-rank order,
        through the segment (a collective)."""
        views = self._byte_views([tensor], "all_gather")
        world = group_size(group)
        if world == 1:
            return [tensor.clone()]
        out = [torch.empty_like(tensor, memory_format=torch.contiguous_format)
               for _ in range(world)]
        if not views:
            return out
        outs = [o.view(-1).view(torch.uint8) for o in out]
        what = f"shared-memory all_gather of {_nbytes(tensor) / 1e6:.1f} MB"
        try:
            channel = self._channel(group)

            def read(slot_rank: int, pieces: list[tuple[torch.Tensor, int, int, int]]) -> None:
                slot = channel.slot(slot_rank)
                for _view, start, length, offset in pieces:
                    outs[slot_rank][start:start + length].copy_(slot[offset:offset + length])

            channel.exchange_bytes(views, read, writer=None)
        except Exception as exc:
            raise algorithm_error(exc, global_rank(), what) from exc
        return out

    @staticmethod
    def _byte_views(tensors: Sequence[torch.Tensor], call: str) -> list[torch.Tensor]:
        views = []
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                raise TypeError(f"SharedMemoryAllReduce.{call} takes CPU tensors, got "
                                f"{t.device if isinstance(t, torch.Tensor) else type(t)}. "
                                "HINT: use the strategy's collectives for GPU tensors")
            if not t.is_contiguous():
                raise ValueError(f"SharedMemoryAllReduce.{call} needs contiguous tensors "
                                 "(it works in place). HINT: pass t.contiguous()")
            if t.numel():
                views.append(t.detach().reshape(-1).view(torch.uint8))
        return views

    def __repr__(self) -> str:
        extra = f", compression={self.compression!r}" if self.compression is not None else ""
        return f"SharedMemoryAllReduce(piece_bytes={self.piece_bytes}{extra})"
