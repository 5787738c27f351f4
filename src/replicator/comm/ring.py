"""Ring all-reduce over point-to-point sends: reduce-scatter, then all-gather, each chunk sent in
``segment_bytes`` segments so adding one overlaps receiving the next."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from replicator.comm.algorithms import CrossDeviceOps
from replicator.comm.compression import Compression
from replicator.comm.groups import group_rank, group_size

DEFAULT_SEGMENT_BYTES = 2 << 20
DEFAULT_DEPTH = 16


def _sent(work: dist.Work | None) -> dist.Work:
    """The handle of a point-to-point call (``None`` only outside the group: never here)."""
    if work is None:
        raise RuntimeError("ring all-reduce: a point-to-point call returned no handle")
    return work


def _wait(work: dist.Work | None, group: dist.ProcessGroup | None, src: int, where: str) -> None:
    """Wait for a receive; a failure says which neighbour and which step."""
    try:
        _sent(work).wait()
    except RuntimeError as exc:
        peer = dist.get_global_rank(group, src) if group is not None else src
        raise RuntimeError(f"receiving from rank {peer} in {where}: {exc}") from exc


class RingAllReduce(CrossDeviceOps):
    """The ring. ``segment_bytes``: the unit that travels (2 MB); ``depth``: receives in flight
    per step (16); its receive buffers (at most ``depth x segment_bytes``) are kept for reuse."""

    name = "ring"

    def __init__(self, segment_bytes: int = DEFAULT_SEGMENT_BYTES, depth: int = DEFAULT_DEPTH,
                 *, compression: Compression | None = None,
                 timeout_seconds: float | None = None) -> None:
        super().__init__(compression=compression, timeout_seconds=timeout_seconds)
        if segment_bytes < 1:
            raise ValueError(f"segment_bytes must be >= 1, got {segment_bytes}")
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.segment_bytes = segment_bytes
        self.depth = depth
        self._local = threading.local()

    def _pool(self, tensor: torch.Tensor, seg: int, chunk: int) -> list[torch.Tensor]:
        """``depth`` receive buffers of ``seg`` elements, reused (and grown) across calls."""
        seg = min(seg, max(1, chunk))
        slots = min(self.depth, -(-chunk // seg))
        pools = self._local.__dict__.setdefault("pools", {})
        key = (tensor.dtype, tensor.device)
        flat = pools.get(key)
        if flat is None or flat.numel() < seg * slots:
            flat = torch.empty(seg * slots, dtype=tensor.dtype, device=tensor.device)
            pools[key] = flat
        return [flat[(i % slots) * seg:(i % slots + 1) * seg] for i in range(self.depth)]

    def _sum_now(self, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        world, me = group_size(group), group_rank(group)
        n = tensor.numel()
        if world == 1 or n == 0:
            return
        flat = tensor.view(-1)
        seg = max(1, self.segment_bytes // tensor.element_size())
        bounds = [i * n // world for i in range(world + 1)]
        right, left = (me + 1) % world, (me - 1) % world

        def chunk(c: int) -> list[tuple[int, int]]:
            return [(a, min(a + seg, bounds[c + 1])) for a in range(bounds[c], bounds[c + 1], seg)]

        pool = self._pool(tensor, seg, bounds[1] - bounds[0] + 1)
        # On gloo every receive is announced to the sender before data flows, so the
        # all-gather receives are posted first, with their own tag, and no step waits for an
        # announcement. They write straight into place; that is safe because a chunk's final
        # sum can only arrive after this rank's last contribution to it has been sent.
        early = dist.get_backend(group) == "gloo"
        ag_tag = 1 if early else 0
        gather_steps = [chunk((me - step) % world) for step in range(world - 1)]
        posted_gathers = [[dist.irecv(flat[a:z], group=group, group_src=left, tag=ag_tag)
                           for a, z in segs] for segs in gather_steps] if early else None
        sends = [dist.isend(flat[a:z], group=group, group_dst=right) for a, z in chunk(me)]
        # reduce-scatter: at step s, receive chunk me-s-1, add, forward it (next step's send)
        for step in range(world - 1):
            segs = chunk((me - step - 1) % world)
            inflight: list[tuple[dist.Work, int, int, torch.Tensor]] = []
            posted = 0
            while posted < len(segs) or inflight:
                while posted < len(segs) and len(inflight) < self.depth:
                    a, z = segs[posted]
                    buf = pool[posted % self.depth][:z - a]
                    inflight.append((_sent(dist.irecv(buf, group=group, group_src=left)), a, z,
                                     buf))
                    posted += 1
                work, a, z, buf = inflight.pop(0)
                _wait(work, group, left, f"reduce-scatter step {step + 1} of {world - 1}")
                flat[a:z].add_(buf)
                tag = ag_tag if step == world - 2 else 0
                sends.append(dist.isend(flat[a:z], group=group, group_dst=right, tag=tag))
        # all-gather: at step s, receive the summed chunk me-s straight into place
        for step, segs in enumerate(gather_steps):
            recvs = posted_gathers[step] if posted_gathers is not None else \
                [dist.irecv(flat[a:z], group=group, group_src=left) for a, z in segs]
            where = f"all-gather step {step + 1} of {world - 1}"
            if step == world - 2:  # nothing to forward: one wake-up for the whole step
                for recv in reversed(recvs):
                    _wait(recv, group, left, where)
                continue
            for recv, (a, z) in zip(recvs, segs):
                _wait(recv, group, left, where)
                sends.append(dist.isend(flat[a:z], group=group, group_dst=right, tag=ag_tag))
        for send in sends:
            _sent(send).wait()

    def _fields(self) -> dict[str, object]:
        return {"segment_bytes": self.segment_bytes, "depth": self.depth}
