"""End-of-data agreement: replicas whose inputs end at different steps decide together.

Each replica reports how many batches it has ready (and whether its input has ended) in one
small all-reduce (MIN over a few int64s) on the default process group; all replicas then run
the same number of steps before the next report. With prefetch, a report covers several
steps. The collective uses the group's timeout (set by the strategy), and a failure names the
rank and what it was doing. Without a process group, or with one replica, nothing is sent.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from replicator.errors import ReplicaTimeoutError, ReplicatorError

_TIMEOUT_WORDS = ("timed out", "timeout", "deadline")


def group_world() -> int:
    """The default group's size, or 1 when no group is initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


class Agreement:
    """``exchange(values)`` -> elementwise MIN of ``values`` over all replicas."""

    def __init__(self, rank: int, replicas: int) -> None:
        self.rank = rank
        self.world = group_world() if replicas > 1 else 1
        if self.world not in (1, replicas):
            raise ReplicatorError(
                f"the input pipeline of rank {rank} is one of {replicas} replicas, but the "
                f"default process group has {self.world} processes; the end-of-data agreement "
                "runs on the default group. HINT: build the dataset with the strategy whose "
                "replicas are all the processes of the job.")
        self._device = torch.device("cpu")
        if self.world > 1 and dist.get_backend() == "nccl":
            self._device = torch.device("cuda", torch.cuda.current_device())

    def exchange(self, values: Sequence[int], what: str) -> list[int]:
        if self.world == 1:
            return list(values)
        tensor = torch.tensor(list(values), dtype=torch.int64, device=self._device)
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        except RuntimeError as exc:
            text = str(exc).lower()
            hint = ("HINT: every replica must iterate its distributed dataset in step with the "
                    "others; a replica that stopped iterating (a break or an exception on one "
                    "rank only) or is stuck in its step leaves the others waiting.")
            if any(w in text for w in _TIMEOUT_WORDS):
                raise ReplicaTimeoutError(
                    f"rank {self.rank} timed out in the input pipeline's end-of-data agreement "
                    f"({what}): the other replicas did not join. {hint}") from exc
            raise ReplicatorError(
                f"rank {self.rank} failed in the input pipeline's end-of-data agreement "
                f"({what}): {str(exc).splitlines()[0][:200]}. {hint}") from exc
        return [int(v) for v in tensor.tolist()]
