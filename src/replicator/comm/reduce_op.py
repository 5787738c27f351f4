"""ReduceOp: the cross-replica reductions, by name or enum."""

from __future__ import annotations

import enum

import torch.distributed as dist


class ReduceOp(enum.Enum):
    """How values from all replicas combine: ``"sum"``, ``"mean"``, ``"min"``, ``"max"``."""

    SUM = "sum"
    MEAN = "mean"
    MIN = "min"
    MAX = "max"

    @classmethod
    def parse(cls, op: ReduceOp | str) -> ReduceOp:
        """``"sum"`` -> ``ReduceOp.SUM``; an unknown name raises ``ValueError`` listing names."""
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str):
            key = op.strip().lower()
            if key in ("avg", "average"):
                key = "mean"
            for member in cls:
                if member.value == key:
                    return member
        names = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"unknown reduce op {op!r}; use one of {names} or rp.ReduceOp")

    def to_dist(self) -> dist.ReduceOp.RedOpType:
        """The backend op; MEAN is computed as SUM followed by a division."""
        return {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MEAN: dist.ReduceOp.SUM,
                ReduceOp.MIN: dist.ReduceOp.MIN, ReduceOp.MAX: dist.ReduceOp.MAX}[self]
