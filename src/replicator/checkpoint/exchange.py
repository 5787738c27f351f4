"""How ranks agree while checkpointing: small JSON messages over the collectives passed in, so
that a failure on one rank becomes the same clear error on every rank (a rank that stops
responding a ``ReplicaTimeoutError`` naming it), never a hang."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from replicator.cluster.timeouts import resolve_timeout
from replicator.comm.collectives import Collectives
from replicator.comm.groups import collective_device


def group_collectives(group: dist.ProcessGroup | None = None) -> Collectives:
    """Collectives over ``group`` (``None``: the whole job) with the group's timeout; one rank
    of one when ``torch.distributed`` is not initialized (a single-process run)."""
    if not dist.is_available() or not dist.is_initialized():
        return Collectives(0, 1, torch.device("cpu"), resolve_timeout())
    return Collectives.for_group(group, collective_device(group),
                                 resolve_timeout(group=group))


class Channel:
    """JSON messages between the ranks of a job (one collective exchange per call)."""

    def __init__(self, collectives: Collectives) -> None:
        self.collectives = collectives
        self.rank = collectives.rank
        self.world_size = collectives.world_size
        self.is_chief = collectives.rank == 0

    def all_gather(self, message: Any, what: str) -> list[Any]:
        """Every rank's ``message`` (JSON-serialisable), in rank order, on every rank."""
        payload = json.dumps(message, allow_nan=True).encode()
        if self.world_size == 1:
            return [json.loads(payload)]
        texts = self.collectives.all_gather_bytes(payload, what)
        return [json.loads(t) for t in texts]

    def from_chief(self, message: Any, what: str) -> Any:
        """The chief's ``message`` on every rank (other ranks' arguments are ignored)."""
        return self.all_gather(message if self.is_chief else None, what)[0]

    def failures(self, error: str, what: str) -> dict[int, str]:
        """Agree on who failed: ``error`` is this rank's error text, empty when it succeeded."""
        return {r: e for r, e in enumerate(self.all_gather(error, what)) if e}

    def max_flag(self, flag: bool, what: str) -> bool:
        """True on every rank when ``flag`` is true on any rank."""
        if self.world_size == 1:
            return flag
        value = torch.tensor([1.0 if flag else 0.0])
        from replicator.comm.reduce_op import ReduceOp

        return bool(self.collectives.all_reduce(value, ReduceOp.MAX, what).item() > 0)


def describe_failures(failures: dict[int, str]) -> str:
    """``rank 1: OSError: ...; rank 2: ...`` for an error message."""
    return "; ".join(f"rank {r}: {e}" for r, e in sorted(failures.items()))
