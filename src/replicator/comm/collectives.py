"""Cross-replica collectives with errors that say which rank, which operation, and why
(timeouts, lost peers, and with ``check=True`` mismatched calls, found by exchanging a hash of
each call first: docs/collectives.md, "Collective integrity")."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from replicator.comm import timing
from replicator.comm.collective_tracker import CollectiveTracker
from replicator.comm.compression import pack, unpack_into
from replicator.comm.groups import TIMEOUT_WORDS, algorithm_error, group_ranks, new_private_group
from replicator.comm.reduce_op import ReduceOp
from replicator.comm.shm_segment import flag_barrier_is_safe
from replicator.errors import CollectiveMismatchError, ReplicaTimeoutError, ReplicatorError

#: Bytes of a row that :meth:`Collectives.all_gather_bytes` (and ``all_gather_many``) exchange in
#: one collective together with the rows' lengths; a longer row costs a second collective.
FRAME_BYTES = 4096

if TYPE_CHECKING:
    from replicator.comm.algorithms import CrossDeviceOps
    from replicator.comm.shared_memory import SharedMemoryAllReduce

log = logging.getLogger("replicator")


def digest(text: str) -> int:
    """A non-negative 62-bit hash of ``text`` (so ``-h`` never overflows int64)."""
    raw = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") & ((1 << 62) - 1)


def describe_tensor(tensor: torch.Tensor, axis: int | None = None) -> str:
    """``shape (4, 3) float32``; with ``axis``, that axis' size is shown (and hashed) as ``*``."""
    dims = [str(d) for d in tensor.shape]
    if axis is not None and dims:
        dims[axis] = "*"
    shape = f"({', '.join(dims)}{',' if len(dims) == 1 else ''})"
    return f"shape {shape} {dtype_name(tensor.dtype)}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@functools.cache
def _skip_prefixes() -> tuple[str, ...]:
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # replicator/
    dirs = [package, os.path.dirname(os.path.abspath(torch.__file__)),
            sysconfig.get_paths()["stdlib"]]
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


def call_site() -> str:
    """``file:line`` of the user's call: the innermost frame outside replicator, torch, stdlib."""
    skip = _skip_prefixes()
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith("<frozen") and not os.path.realpath(name).startswith(skip):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "(unknown)"


@dataclass(eq=False)
class PendingCheck:
    """A fingerprint exchange of ``coll`` in flight, its verdict ``agreed()``."""

    agreed: Callable[[], bool]
    seq: int
    description: str
    coll: Collectives
    what: str
    done: bool = False

    def wait(self) -> None:
        """Raise :class:`CollectiveMismatchError` on every rank if fingerprints differ (once)."""
        if self.done:
            return
        self.done = True
        with self.coll.guard(f"{self.what} (fingerprint)"):
            agreed = self.agreed()
        if agreed:
            return
        text = f"{self.description} (checked call #{self.seq}) at {call_site()}"
        texts = self.coll._gather_bytes(text.encode()[:4096], "exchange of collective descriptions")
        raise mismatch_error({r: t.decode(errors="replace")
                              for r, t in zip(self.coll.global_ranks, texts)})


def mismatch_error(calls: dict[int, str]) -> CollectiveMismatchError:
    """The error every rank raises when the fingerprints differ, listing each rank's call."""
    lines = "\n".join(f"  rank {r}: {text}" for r, text in sorted(calls.items()))
    return CollectiveMismatchError(
        "the replicas entered different collectives at the same point:\n" + lines + "\nHINT: every "
        "rank must make the same collective calls (reduce, gather, backward of a distributed "
        "model, barrier, ...) in the same order with the same shapes and dtypes; look for a "
        "condition that depends on the rank or on its data (e.g. `if strategy.replica_id == 0: "
        "strategy.reduce(...)`) and make every rank take the same path.", calls)


class Collectives:
    """The collectives one strategy uses, bound to a process group and a device."""

    def __init__(self, rank: int, world_size: int, device: torch.device,
                 timeout_seconds: float, tracker: CollectiveTracker | None = None,
                 group: dist.ProcessGroup | None = None, *, check: bool = True) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..world_size-1 and world_size >= 1, got rank "
                             f"{rank} of {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout_seconds = timeout_seconds
        self.group = group
        self.check = check
        self.global_ranks = group_ranks(group) if world_size > 1 else list(range(world_size))
        self.tracker = tracker or CollectiveTracker(rank, world_size, None, ranks=self.global_ranks)
        self._checked = 0
        self._synchronizers = 0
        self._in_flight: PendingCheck | None = None
        self._same_host: SharedMemoryAllReduce | None = None

    @classmethod
    def for_group(cls, group: dist.ProcessGroup | None, device: torch.device,
                  timeout_seconds: float, tracker: CollectiveTracker | None = None, *,
                  check: bool = True) -> Collectives:
        """Collectives over ``group`` (``None``: the whole job) at this process's position."""
        if not dist.is_available() or not dist.is_initialized():
            if group is not None:
                raise ValueError("Collectives.for_group got a group but torch.distributed is "
                                 "not initialized. HINT: create the strategy first")
            return cls(0, 1, device, timeout_seconds, tracker, None, check=check)
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(f"global rank {dist.get_rank()} is not a member of the group "
                             f"{dist.get_process_group_ranks(group)}. HINT: only the group's "
                             "members may build collectives over it")
        return cls(rank, dist.get_world_size(group), device, timeout_seconds, tracker, group,
                   check=check)

    def private_copy(self, purpose: str, *, check: bool = True) -> Collectives:
        """Collectives on CPU over a new gloo group of the same ranks (a collective), so a helper
        thread's calls never interleave with this group's; not through shared memory, whose
        polling waits cost a helper thread more CPU (8.9 ms per checkpoint save, 2.6 on gloo)."""
        group = new_private_group(group_ranks(self.group), purpose, self.timeout_seconds,
                                  backend="gloo")
        return Collectives(self.rank, self.world_size, torch.device("cpu"),
                           self.timeout_seconds, None, group=group, check=check)

    @property
    def global_rank(self) -> int:
        """This process's rank in the whole job (what error messages name)."""
        return self.global_ranks[self.rank]

    def next_synchronizer_index(self) -> int:
        """0, 1, ... per new gradient synchronizer: alike on every rank building the same models."""
        self._synchronizers += 1
        return self._synchronizers - 1

    def use_same_host_path(self, algorithm: CrossDeviceOps) -> bool:
        """Send fingerprints and payloads through ``algorithm``'s shared memory when it is an
        uncompressed ``SharedMemoryAllReduce`` on CPU; a collective."""
        from replicator.comm.shared_memory import SharedMemoryAllReduce

        if (self.world_size == 1 or not isinstance(algorithm, SharedMemoryAllReduce)
                or self.device.type != "cpu" or algorithm.compression is not None
                or not flag_barrier_is_safe()):  # fingerprints travel in the flags
            return False
        try:  # fails on every rank alike (another host in the group, /dev/shm full)
            algorithm.channel(self.group)
        except ReplicatorError as exc:
            log.warning("collectives stay on the backend: %s", exc)
            return False
        self._same_host = algorithm
        return True

    @property
    def uses_shared_memory(self) -> bool:
        """True when fingerprints (and large payloads) travel through shared memory."""
        return self._same_host is not None

    def _payload_path(self, tensors: Sequence[torch.Tensor]) -> SharedMemoryAllReduce | None:
        """The shared-memory algorithm when it moves ``tensors`` faster than the backend."""
        algo = self._same_host
        return algo if algo is not None and algo.pays_for(tensors) else None

    def start_check(self, what: str, detail: str, *, async_op: bool = False) -> PendingCheck | None:
        """Start the fingerprint exchange of ``what`` (``None`` when checking is off or alone);
        ``wait()`` raises ``CollectiveMismatchError``."""
        if not self.check or self.world_size == 1:
            return None
        self.settle()  # one fingerprint in flight at a time: a mismatch is known before the next
        self._checked += 1
        seq = self._checked
        h = digest(f"{what}|{detail}|{seq}")
        if self._same_host is not None:
            barrier = self._same_host.channel(self.group).barrier
            with self.guard(f"{what} (fingerprint)"):
                number = barrier.post(h)

            def agreed() -> bool:
                values = barrier.collect(number)
                return all(v == values[0] for v in values)
        else:
            buf = torch.tensor([h, -h], dtype=torch.int64, device=self.device)
            with self.guard(f"{what} (fingerprint)"):
                work = dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group,
                                       async_op=async_op)

            def agreed() -> bool:  # max(h) == -max(-h) == min(h)
                if work is not None:
                    work.wait()
                high, neg_low = buf.tolist()
                return bool(high == -neg_low)
        pending = PendingCheck(agreed, seq, f"{what}: {detail}", self, what)
        if async_op:
            self._in_flight = pending
        return pending

    def settle(self) -> None:
        """Await the verdict of a fingerprint exchange in flight before anything else is issued."""
        pending, self._in_flight = self._in_flight, None
        if pending is not None:
            pending.wait()

    def _verify(self, what: str, detail: str) -> None:
        pending = self.start_check(what, detail)
        if pending is not None:
            pending.wait()

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[int]:
        """Count ``what`` as one collective and translate the backend's failures."""
        seq = self.tracker.enter(what)
        started = timing.start(self.device)  # time spent waiting here, when timers are on
        try:
            yield seq
        except (RuntimeError, ReplicaTimeoutError) as exc:
            raise self.translate(exc, seq, what) from exc
        finally:
            timing.stop(started, self.device)

    def translate(self, exc: BaseException, seq: int, what: str) -> BaseException:
        text = str(exc).lower()
        # a wait in shared memory times out as ReplicaTimeoutError: named like the backend's
        timed_out = isinstance(exc, ReplicaTimeoutError) and not exc.named
        if isinstance(exc, ReplicatorError) and not timed_out:
            return exc
        if timed_out or any(w in text for w in TIMEOUT_WORDS):
            who = self.tracker.explain(seq, what)
            error = ReplicaTimeoutError(
                f"{what} (collective #{seq}) on rank {self.global_rank} waited "
                f"{self.timeout_seconds:g} s for the other replicas{': ' + who if who else ''}. "
                "HINT: a rank may be on another code path (a condition that depends on the rank "
                "or on its data) or stuck; every rank must make the same collective calls in the "
                "same order.")
            error.named = True
            return error
        return algorithm_error(exc, self.global_rank, f"{what} (collective #{seq})",
                               self.global_ranks)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, what: str = "all_reduce"
                   ) -> torch.Tensor:
        """Return a new tensor holding ``op`` over every replica's ``tensor``."""
        if self.world_size > 1:
            self._verify(what, f"all_reduce {op.value} of {describe_tensor(tensor)}")
        return self._all_reduce(tensor, op, what)

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, what: str) -> torch.Tensor:
        out = tensor.detach().to(self.device, copy=True)
        if op is ReduceOp.MEAN and not out.is_floating_point() and not out.is_complex():
            out = out.to(torch.get_default_dtype())
        if self.world_size > 1:
            shm = self._payload_path([out]) if out.dtype is not torch.bool else None
            with self.guard(what):
                if shm is None:
                    dist.all_reduce(out, op=op.to_dist(), group=self.group)
                elif op in (ReduceOp.SUM, ReduceOp.MEAN):
                    shm.all_reduce_sum(out, self.group)
                else:  # every rank's tensor, then the same elementwise max/min everywhere
                    stacked = torch.stack(shm.all_gather(out, self.group))
                    out = stacked.amax(0) if op is ReduceOp.MAX else stacked.amin(0)
        if op is ReduceOp.MEAN:
            out.div_(self.world_size)
        return out

    def all_reduce_many(self, tensors: Sequence[torch.Tensor], op: ReduceOp,
                        what: str = "all_reduce", structure: str = "") -> list[torch.Tensor]:
        """Reduce several tensors in one collective (float64 where exact, else one more per
        dtype); ``structure`` goes into the fingerprint."""
        if self.world_size == 1:
            return [self._all_reduce(t, op, what) for t in tensors]
        self._verify(what, f"all_reduce {op.value} of {len(tensors)} tensors"
                     + (f" of {structure}" if structure else "") + ": "
                     + "; ".join(describe_tensor(t) for t in tensors))
        packs: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            packs.setdefault(_pack_dtype(t.dtype, op), []).append(i)
        out: list[torch.Tensor | None] = [None] * len(tensors)
        for dtype, members in packs.items():
            flat = torch.cat([tensors[i].detach().reshape(-1).to(self.device, dtype)
                              for i in members])
            red = self._all_reduce(flat, op, what)
            for i, piece in zip(members, red.split([tensors[i].numel() for i in members])):
                t = tensors[i]
                keep = op is ReduceOp.MEAN and not t.is_floating_point() and not t.is_complex()
                out[i] = piece.reshape(t.shape) if keep else piece.reshape(t.shape).to(t.dtype)
        return [o for o in out if o is not None]

    def all_gather_many(self, tensors: Sequence[torch.Tensor], axis: int = 0,
                        what: str = "gather", structure: str = "") -> list[torch.Tensor]:
        """``all_gather_uneven`` of several tensors (any dtypes) in one exchange of their bytes,
        row counts in front."""
        moved: list[torch.Tensor] = []
        axes: list[int] = []
        for t in tensors:
            t = t.detach().to(self.device)
            t, a = (t.reshape(1), 0) if t.dim() == 0 else (t, axis)
            if not -t.dim() <= a < t.dim():
                raise ValueError(f"{what}: axis {a} is out of range for a tensor of shape "
                                 f"{tuple(t.shape)}")
            a %= t.dim()
            axes.append(a)
            moved.append(t.movedim(a, 0).contiguous())
        if self.world_size == 1:
            return [m.movedim(0, a).clone() for m, a in zip(moved, axes)]
        self._verify(what, f"all_gather of {len(moved)} tensors"
                     + (f" of {structure}" if structure else "") + ": "
                     + "; ".join(f"along axis {a} {describe_tensor(m.movedim(0, a), a)}"
                                 for m, a in zip(moved, axes)))
        row_bytes = [math.prod(m.shape[1:]) * m.element_size() for m in moved]
        header = torch.tensor([v for m, rb in zip(moved, row_bytes) for v in (m.shape[0], rb)],
                              dtype=torch.int64, device=self.device)
        buffer = torch.cat([header.view(torch.uint8)]
                           + [m.reshape(-1).view(torch.uint8) if m.dtype is not torch.bool
                              else m.reshape(-1).to(torch.uint8) for m in moved])
        parts, _ = self._gather_rows(buffer, what)
        pieces: list[list[torch.Tensor]] = [[] for _ in moved]
        head = header.numel() * 8
        for rank, part in enumerate(parts):
            theirs = part[:head].clone().view(torch.int64).tolist()
            offset = head
            for i, m in enumerate(moved):
                rows, rb = theirs[2 * i], theirs[2 * i + 1]
                if rb != row_bytes[i]:
                    raise ReplicatorError(
                        f"{what}: tensor {i} has rows of {rb} bytes on group rank {rank} but "
                        f"{row_bytes[i]} here (shape {tuple(m.shape)} along the gathered "
                        "axis); every replica must pass tensors whose other dimensions match")
                raw = part[offset:offset + rows * rb].clone()
                offset += rows * rb
                piece = raw.to(torch.bool) if m.dtype is torch.bool else raw.view(m.dtype)
                pieces[i].append(piece.reshape(rows, *m.shape[1:]))
        return [torch.cat(p, dim=0).movedim(0, a) for p, a in zip(pieces, axes)]

    def all_gather_uneven(self, tensor: torch.Tensor, axis: int = 0,
                          what: str = "gather") -> torch.Tensor:
        """Concatenate every replica's ``tensor`` along ``axis``; sizes along it may differ."""
        return self.all_gather_many([tensor], axis, what)[0]

    def _gather_rows(self, flat: torch.Tensor, what: str) -> tuple[list[torch.Tensor], list[int]]:
        """Every rank's 1-D uint8 ``flat`` (lengths may differ), padded to at least the longest,
        and the lengths; a second collective only for rows over :data:`FRAME_BYTES`."""
        n = flat.shape[0]
        frame = torch.zeros(8 + FRAME_BYTES, dtype=torch.uint8, device=self.device)
        frame[:8] = torch.tensor([n], dtype=torch.int64, device=self.device).view(torch.uint8)
        frame[8:8 + min(n, FRAME_BYTES)] = flat[:FRAME_BYTES]
        with self.guard(what):
            frames = self._gather_same_size(frame, small=True)
        sizes = [int(f[:8].clone().view(torch.int64)) for f in frames]
        longest = max(sizes)
        if longest <= FRAME_BYTES:
            return [f[8:] for f in frames], sizes
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        padded[:n] = flat
        with self.guard(f"{what} (rows longer than {FRAME_BYTES} bytes)"):
            return self._gather_same_size(padded, small=False), sizes

    def _gather_same_size(self, tensor: torch.Tensor, small: bool) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape on each), in shared memory when small or faster."""
        shm = self._same_host if small else self._payload_path([tensor])
        if shm is not None:
            return shm.all_gather(tensor, self.group)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.group)
        return parts

    def broadcast_(self, tensors: Sequence[torch.Tensor], src: int = 0,
                   what: str = "broadcast") -> None:
        """Overwrite ``tensors`` in place with group rank ``src``'s values, one call per dtype."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"{what}: src must be a rank of the group, 0..{self.world_size - 1}"
                             f", got {src}")
        if self.world_size == 1 or not tensors:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        self._verify(what, f"broadcast from group rank {src} of {len(tensors)} tensors ("
                     + ", ".join(f"{sum(t.numel() for t in ts)} {dtype_name(d)}"
                                 for d, ts in by_dtype.items()) + " elements)")
        for dtype, group in by_dtype.items():
            shm = self._payload_path(group)
            if shm is not None and all(t.is_contiguous() for t in group):
                with self.guard(f"{what} ({dtype})"), torch.no_grad():
                    shm.broadcast_(group, src=src, group=self.group)  # in place, no packing
                continue
            flat = pack(group, self.device)
            with self.guard(f"{what} ({dtype})"):
                if shm is not None:
                    shm.broadcast_([flat], src=src, group=self.group)
                else:
                    dist.broadcast(flat, group=self.group, group_src=src)
            unpack_into(flat, group)

    def all_gather_bytes(self, payload: bytes, what: str = "all_gather") -> list[bytes]:
        """Exchange small byte strings (e.g. JSON) without pickling anything."""
        if self.world_size == 1:
            return [bytes(payload)]
        self._verify(what, "all_gather of bytes")
        return self._gather_bytes(payload, what)

    def _gather_bytes(self, payload: bytes, what: str) -> list[bytes]:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else \
            torch.empty(0, dtype=torch.uint8)
        parts, sizes = self._gather_rows(data.to(self.device), what)
        return [bytes(p[:n].cpu().tolist()) for p, n in zip(parts, sizes)]

    def barrier(self, what: str = "barrier") -> None:
        """Wait until every replica of the group reaches this call."""
        if self.world_size == 1:
            return
        self._verify(what, "barrier")
        flag = torch.zeros(1, device=self.device)
        with self.guard(what):
            dist.all_reduce(flag, group=self.group)


def _pack_dtype(dtype: torch.dtype, op: ReduceOp) -> torch.dtype:
    """The dtype a tensor travels in in ``all_reduce_many``: float64 where exact, else its own."""
    if dtype.is_complex:
        return dtype
    if dtype in (torch.int64, torch.uint64, torch.uint32) and op is not ReduceOp.MEAN:
        return torch.int64 if dtype is not torch.uint64 else dtype
    return torch.float64
