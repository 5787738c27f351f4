"""Cross-replica collectives with errors that say which rank, which operation, and why.

Every call goes through :meth:`Collectives.guard`, which counts the operation for the progress
tracker and turns the backend's timeout and lost-peer errors into
:class:`~replicator.errors.ReplicaTimeoutError` / :class:`~replicator.errors.ReplicatorError`.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from replicator.comm.op_errors import LOST_PEER_WORDS as _LOST_PEER_WORDS
from replicator.comm.op_errors import TIMEOUT_WORDS as _TIMEOUT_WORDS
from replicator.comm.progress import CollectiveTracker
from replicator.comm.reduce_op import ReduceOp
from replicator.errors import ReplicaTimeoutError, ReplicatorError


class Collectives:
    """The collectives one strategy uses, bound to a process group and a device."""

    def __init__(self, rank: int, world_size: int, device: torch.device,
                 timeout_seconds: float, tracker: CollectiveTracker | None = None,
                 group: dist.ProcessGroup | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout_seconds = timeout_seconds
        self.tracker = tracker or CollectiveTracker(rank, world_size, None)
        self.group = group

    # -- error translation ------------------------------------------------------------------
    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[int]:
        """Count ``what`` as one collective and translate the backend's failures."""
        seq = self.tracker.enter(what)
        try:
            yield seq
        except RuntimeError as exc:
            raise self.translate(exc, seq, what) from exc

    def translate(self, exc: BaseException, seq: int, what: str) -> Exception:
        if isinstance(exc, ReplicatorError):
            return exc
        text = str(exc).lower()
        if any(w in text for w in _TIMEOUT_WORDS):
            who = self.tracker.explain(seq, what)
            return ReplicaTimeoutError(
                f"{what} (collective #{seq}) on rank {self.rank} waited {self.timeout_seconds:g} s"
                f" for the other replicas{': ' + who if who else ''}. HINT: a rank may be on "
                "another code path (a condition that depends on the rank or on its data) or "
                "stuck; every rank must make the same collective calls in the same order.")
        if any(w in text for w in _LOST_PEER_WORDS):
            detail = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).splitlines()[0])[:160]
            return ReplicatorError(
                f"{what} (collective #{seq}) on rank {self.rank} failed because another replica "
                f"exited or lost its connection ({detail}). HINT: look "
                "for that rank's own error; the launcher reports the first failure.")
        return ReplicatorError(f"{what} (collective #{seq}) failed on rank {self.rank}: {exc}")

    # -- collectives --------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, what: str = "all_reduce"
                   ) -> torch.Tensor:
        """Return a new tensor holding ``op`` over every replica's ``tensor``."""
        out = tensor.detach().to(self.device, copy=True)
        if op is ReduceOp.MEAN and not out.is_floating_point() and not out.is_complex():
            out = out.to(torch.get_default_dtype())
        if self.world_size > 1:
            with self.guard(what):
                dist.all_reduce(out, op=op.to_dist(), group=self.group)
        if op is ReduceOp.MEAN:
            out.div_(self.world_size)
        return out

    def all_reduce_many(self, tensors: Sequence[torch.Tensor], op: ReduceOp,
                        what: str = "all_reduce") -> list[torch.Tensor]:
        """Reduce several tensors in one collective per dtype (flattened together)."""
        if self.world_size == 1:
            return [self.all_reduce(t, op, what) for t in tensors]
        flat = torch.cat([t.detach().reshape(-1).to(self.device, torch.float64) for t in tensors])
        red = self.all_reduce(flat, op, what)
        out, offset = [], 0
        for t in tensors:
            n = t.numel()
            piece = red[offset:offset + n].reshape(t.shape)
            out.append(piece if op is ReduceOp.MEAN and not t.is_floating_point()
                       else piece.to(t.dtype))
            offset += n
        return out

    def all_gather_uneven(self, tensor: torch.Tensor, axis: int = 0,
                          what: str = "gather") -> torch.Tensor:
        """Concatenate every replica's ``tensor`` along ``axis``; sizes along it may differ."""
        tensor = tensor.detach().to(self.device)
        if tensor.dim() == 0:
            tensor = tensor.reshape(1)
            axis = 0
        axis = axis % tensor.dim()
        if self.world_size == 1:
            return tensor.clone()
        meta = torch.tensor([tensor.dim(), tensor.shape[axis]], dtype=torch.int64,
                            device=self.device)
        metas = [torch.empty_like(meta) for _ in range(self.world_size)]
        with self.guard(f"{what} (sizes)"):
            dist.all_gather(metas, meta, group=self.group)
        sizes = [int(m[1]) for m in metas]
        if any(int(m[0]) != tensor.dim() for m in metas):
            raise ReplicatorError(f"{what}: replicas passed tensors of different ranks "
                                  f"{[int(m[0]) for m in metas]}; all must have the same rank")
        moved = tensor.movedim(axis, 0).contiguous()
        padded = torch.zeros((max(sizes), *moved.shape[1:]), dtype=moved.dtype,
                             device=self.device)
        padded[: moved.shape[0]] = moved
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        with self.guard(what):
            try:
                dist.all_gather(parts, padded, group=self.group)
            except RuntimeError as exc:
                if "size" in str(exc).lower() or "shape" in str(exc).lower():
                    raise ReplicatorError(
                        f"{what}: replicas passed tensors whose shapes differ beyond axis "
                        f"{axis}; only the gathered axis may differ") from exc
                raise
        joined = torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0)
        return joined.movedim(0, axis)

    def broadcast_(self, tensors: Sequence[torch.Tensor], src: int = 0,
                   what: str = "broadcast") -> None:
        """Overwrite ``tensors`` in place with replica ``src``'s values, one call per dtype."""
        if self.world_size == 1 or not tensors:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for dtype, group in by_dtype.items():
            flat = torch.cat([t.detach().reshape(-1).to(self.device) for t in group])
            with self.guard(f"{what} ({dtype})"):
                dist.broadcast(flat, src=src, group=self.group)
            offset = 0
            with torch.no_grad():
                for t in group:
                    n = t.numel()
                    t.copy_(flat[offset:offset + n].view_as(t))
                    offset += n

    def all_gather_bytes(self, payload: bytes, what: str = "all_gather") -> list[bytes]:
        """Exchange small byte strings (e.g. JSON) without pickling anything."""
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else \
            torch.empty(0, dtype=torch.uint8)
        gathered = self.all_gather_uneven(data.to(self.device), 0, what)
        lengths = self.all_gather_uneven(torch.tensor([len(payload)], device=self.device), 0,
                                         f"{what} (lengths)")
        out, offset = [], 0
        for n in lengths.tolist():
            out.append(bytes(gathered[offset:offset + n].cpu().tolist()))
            offset += n
        return out

    def barrier(self, what: str = "barrier") -> None:
        if self.world_size == 1:
            return
        flag = torch.zeros(1, device=self.device)
        with self.guard(what):
            dist.all_reduce(flag, group=self.group)
