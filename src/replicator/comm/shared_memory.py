"""Same-host all-reduce through a shared-memory segment, no sockets (docs/collectives.md). Buffers
from :meth:`SharedMemoryAllReduce.make_buffers` live in the segment: asynchronous without a
thread, which on CPU would compete with ``backward()``."""

from __future__ import annotations

import itertools
import logging
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from replicator.cluster.timeouts import resolve_timeout
from replicator.comm.algorithms import BufferSpec, CrossDeviceOps
from replicator.comm.comm_thread import DONE, Handle
from replicator.comm.compression import Compression
from replicator.comm.groups import algorithm_error, global_rank, group_rank, group_ranks, group_size
from replicator.comm.shm_segment import ALIGN, FlagBarrier, SharedSegment, align, check_same_host
from replicator.errors import ReplicatorError

log = logging.getLogger("replicator")

DEFAULT_PIECE_BYTES = 4 << 20
DEFAULT_MAX_RESIDENT_BYTES = 2 << 30
_WHO = "shared-memory all-reduce"
#: Bytes moved by one slot fill: (uint8 view, start in it, length, offset in the slot).
_Piece = tuple[torch.Tensor, int, int, int]


@dataclass
class _Resident:
    """A buffer made by ``make_buffers``: the other ranks' copies (not this rank's, so the
    segment goes with the buffers)."""

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
    """The segment with the barrier flags and per-rank slots of one group; launches sum what is
    ready, so backward never stalls."""

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
            lo, hi = n * self.rank // self.world, n * (self.rank + 1) // self.world
            if hi > lo:  # this rank's chunk of every slot summed into its own, copied to the rest
                out = op.slots[self.rank][lo:hi]
                others = [s[lo:hi] for i, s in enumerate(op.slots) if i != self.rank]
                for other in others:
                    out.add_(other)
                for other in others:
                    other.copy_(out)
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
        """Sum ``flat`` through the slots a piece at a time, as a resident launch each."""
        piece = self.piece_bytes // flat.element_size()
        for start in range(0, flat.numel(), piece):
            m = min(piece, flat.numel() - start)
            slots = [self.segment.view(self.header + s * self.piece_bytes, m, flat.dtype)
                     for s in range(self.world)]
            slots[self.rank].copy_(flat[start:start + m])
            self.complete(self.launch(slots))
            flat[start:start + m].copy_(slots[self.rank])

    def exchange_bytes(self, mine: Sequence[torch.Tensor],
                       read: Callable[[int, torch.Tensor, list[_Piece]], None],
                       writer: int | None) -> None:
        """Move ``mine`` (``uint8`` views) through the slots a slot-full at a time, calling
        ``read(slot_rank, slot, pieces)`` after each fill."""
        self.drain()
        cap = self.piece_bytes
        batch: list[_Piece] = []
        fill = 0
        slots = [self.segment.view(self.header + s * cap, cap, torch.uint8)
                 for s in range(self.world)]

        def flush() -> None:
            if writer is None or writer == self.rank:
                own = slots[self.rank]
                for view, start, length, offset in batch:
                    own[offset:offset + length].copy_(view[start:start + length])
            number = self.barrier.arrive(FlagBarrier.INPUTS)
            self.barrier.wait_for(number, "inputs written", FlagBarrier.INPUTS)
            for s in ([writer] if writer is not None else range(self.world)):
                read(s, slots[s], batch)
            self.barrier.arrive(FlagBarrier.SUMS)
            self.barrier.wait_for(number, "inputs read", FlagBarrier.SUMS)

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
    """All-reduce through a shared-memory segment, CPU replicas on one host;
    ``max_resident_bytes``: the most ``make_buffers`` places there."""

    name = "shared_memory"

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

    def channel(self, group: dist.ProcessGroup | None = None) -> _Channel:
        """The channel of ``group`` (first use: a collective, raising on every rank on failure)."""
        key = dist.group.WORLD if group is None else group
        if key is None:
            raise RuntimeError("no process group is running. HINT: start one first")
        found = self._channels.get(key)
        if found is None:
            timeout = resolve_timeout(self.timeout_seconds, group=group)
            found = self._channels[key] = _Channel(group, self.piece_bytes, timeout)
        return found

    def make_buffers(self, specs: Sequence[BufferSpec],
                     group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
        """Buffers that live in shared memory (CPU only, within ``max_resident_bytes``)."""
        world = group_size(group)
        *offsets, total = itertools.accumulate(
            (align(n * d.itemsize) if dev.type == "cpu" else 0 for n, d, dev in specs), initial=0)
        if (world == 1 or total == 0 or world * total > self.max_resident_bytes
                or self.compression is not None):  # compressed data travels in new tensors
            return super().make_buffers(specs, group)
        self.channel(group)
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

    def _start(self, tensor: torch.Tensor, group: dist.ProcessGroup | None, what: str,
               dst: int | None = None) -> Handle:
        """Start the sum; a reduce onto ``dst`` is the same all-reduce here."""
        try:
            resident = self._resident_for(tensor, group)
            if resident is not None:
                channel = self.channel(group)
                return _ResidentHandle(channel, channel.launch(resident.slots(tensor)), what)
            self._sum_now(tensor, group)
        except Exception as exc:
            raise algorithm_error(exc, global_rank(), what) from exc
        return DONE

    def _resident_for(self, tensor: torch.Tensor, group: dist.ProcessGroup | None
                      ) -> _Resident | None:
        resident = self._resident.get((tensor.data_ptr(), tensor.numel(), tensor.dtype))
        ours = resident is not None and tensor.device.type == "cpu" and \
            resident.rank == group_rank(group) and resident.ranks == tuple(group_ranks(group))
        return resident if ours else None  # one made for another group: through the slots

    def _sum_now(self, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        if tensor.device.type != "cpu":
            raise TypeError(f"SharedMemoryAllReduce works on CPU tensors, got one on "
                            f"{tensor.device}. HINT: use rp.comm.NativeAllReduce() (NCCL) on GPUs")
        channel = self.channel(group)
        if tensor.numel() == 0:
            return
        resident = self._resident_for(tensor, group)
        if resident is not None:
            channel.complete(channel.launch(resident.slots(tensor)))
        else:
            channel.sum_copy(tensor.view(-1))

    # -- other collectives through the segment (central storage, large reduce/gather) ----------
    def pays_for(self, tensors: Sequence[torch.Tensor]) -> bool:
        """True when ``tensors`` move faster through the segment than the backend: any non-empty
        CPU tensors (docs/collectives.md has the timings)."""
        return any(t.numel() for t in tensors) and all(t.device.type == "cpu" for t in tensors)

    def broadcast_(self, tensors: Sequence[torch.Tensor], src: int = 0,
                   group: dist.ProcessGroup | None = None) -> None:
        """Overwrite ``tensors`` on every rank with group rank ``src``'s, through the segment."""
        views = self._byte_views(tensors, "broadcast_")
        world = group_size(group)
        if not 0 <= src < world:
            raise ValueError(f"broadcast_(src={src}): src is a group rank, 0 to {world - 1}")
        if world == 1 or not views:
            return
        me = group_rank(group)

        def read(_: int, slot: torch.Tensor, pieces: list[_Piece]) -> None:
            if me != src:
                for view, start, length, offset in pieces:
                    view[start:start + length].copy_(slot[offset:offset + length])

        self._exchange(views, read, src, group,
                       f"shared-memory broadcast of {len(views)} tensor(s) from group rank {src}")

    def all_gather(self, tensor: torch.Tensor,
                   group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
        """Every rank's ``tensor`` in group-rank order, through the segment."""
        views = self._byte_views([tensor], "all_gather")
        world = group_size(group)
        if world == 1:
            return [tensor.clone()]
        out = [torch.empty_like(tensor, memory_format=torch.contiguous_format)
               for _ in range(world)]
        if not views:
            return out
        outs = [o.view(-1).view(torch.uint8) for o in out]

        def read(slot_rank: int, slot: torch.Tensor, pieces: list[_Piece]) -> None:
            for _view, start, length, offset in pieces:
                outs[slot_rank][start:start + length].copy_(slot[offset:offset + length])

        nbytes = tensor.numel() * tensor.element_size()
        self._exchange(views, read, None, group,
                       f"shared-memory all_gather of {nbytes / 1e6:.1f} MB")
        return out

    def _exchange(self, views: list[torch.Tensor],
                  read: Callable[[int, torch.Tensor, list[_Piece]], None], writer: int | None,
                  group: dist.ProcessGroup | None, what: str) -> None:
        try:
            self.channel(group).exchange_bytes(views, read, writer)
        except Exception as exc:
            raise algorithm_error(exc, global_rank(), what) from exc

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

    def _fields(self) -> dict[str, object]:
        return {"piece_bytes": self.piece_bytes}
