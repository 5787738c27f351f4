"""Uneven ends: replicas whose inputs end at different steps decide together when to stop.

When replicas read different streams (FILE shards, ``input_fn`` pipelines) they agree on the
end: before its first step, and whenever the steps covered by the last agreement are used up,
each replica reports how many batches it has ready (and whether its input has ended) in one
small all-reduce (MIN over a few int64s); all then run ``min(ready)`` more steps. With
prefetch, a report covers several steps. When every replica is out of data they stop
together. With ``drop_remainder=True`` they stop as soon as any replica is out of full
batches; otherwise a replica out of data yields fully masked copies of its last batch until
all are done, so every real sample is used once.

The all-reduce runs on the process group of the data-parallel replicas that the caller gives
(``None``: the default group), never on the default group by assumption: on a mesh
(data x tensor, data x pipeline) each data group agrees by itself. The collective uses the
group's timeout (set by whoever made the group); a failure names the global rank and what it
was doing. Without a process group, or with one replica, nothing is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from replicator.data.errors import EmptyShardError
from replicator.errors import ReplicaMismatchError, ReplicaTimeoutError, ReplicatorError

_TIMEOUT_WORDS = ("timed out", "timeout", "deadline")
_NO_LIMIT = 2 ** 62


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def process_rank(fallback: int) -> int:
    """This process's global rank, for messages (``fallback`` without a process group)."""
    return dist.get_rank() if _initialized() else fallback


def check_data_group(group: Any, replicas: int, where: str) -> None:
    """Check an explicitly given data-parallel ``group`` against the input context's
    ``replicas``: this process must be a member, and the group must have one process per
    replica. ``None`` (the default group) is checked when the agreement first runs."""
    if group is None:
        return
    if not _initialized():
        raise ReplicatorError(
            f"{where} was given a data-parallel group, but no process group is initialised. "
            "HINT: create the default group (the strategy does) before its subgroups, or pass "
            "group=None for a single-process input.")
    rank = dist.get_rank()
    size, group_rank = dist.get_world_size(group), dist.get_rank(group)
    if group_rank < 0:
        raise ReplicatorError(
            f"rank {rank} is not a member of the data-parallel group given to {where}, so it "
            "cannot take part in that group's input. HINT: pass the group of the data-parallel "
            "replicas this process belongs to (processes that are not replicas, such as "
            "parameter servers, build no distributed dataset).")
    if size != replicas:
        raise ReplicatorError(
            f"the input context of rank {rank} says {replicas} replicas are in sync, but the "
            f"data-parallel group given to {where} has {size} processes. HINT: build the "
            "InputContext from the same group (num_replicas_in_sync = the group's size, "
            "input_pipeline_id = this process's position in it).")


class EndAgreement:
    """Runs the end-of-data agreement of one replica on its data-parallel ``group``."""

    def __init__(self, rank: int, replicas: int, group: Any = None, *,
                 drop_remainder: bool, describe: str = "") -> None:
        self.rank = process_rank(rank)  # global, for messages
        self.group = group
        self.drop_remainder = drop_remainder
        self.describe = describe
        if group is not None:
            check_data_group(group, replicas, "the distributed dataset")
            self.world = dist.get_world_size(group)
        else:
            self.world = dist.get_world_size() if replicas > 1 and _initialized() else 1
            if self.world not in (1, replicas):
                raise ReplicatorError(
                    f"the input pipeline of rank {rank} is one of {replicas} replicas, but the "
                    f"default process group has {self.world} processes; the end-of-data "
                    "agreement runs on the data-parallel group, the default group when none is "
                    "given. HINT: pass group= (the process group of the data-parallel "
                    "replicas) to distribute_dataset / distribute_datasets_from_function, or "
                    "build the dataset with the strategy whose replicas are these processes.")
        self.group_rank = dist.get_rank(group) if self.world > 1 else 0
        self._device = torch.device("cpu")
        if self.world > 1 and dist.get_backend(group) == "nccl":
            self._device = torch.device("cuda", torch.cuda.current_device())

    def global_rank(self, group_rank: int) -> int:
        """The global rank of the group's ``group_rank``-th process."""
        if self.world == 1:
            return self.rank
        group = self.group if self.group is not None else dist.group.WORLD
        return dist.get_global_rank(cast(dist.ProcessGroup, group), group_rank)

    def exchange(self, values: Sequence[int], what: str) -> list[int]:
        """The elementwise MIN of ``values`` over the group's replicas."""
        if self.world == 1:
            return list(values)
        tensor = torch.tensor(list(values), dtype=torch.int64, device=self._device)
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
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

    def agree(self, queue: Any, *, epoch: int, step: int, fresh: bool) -> tuple[int, bool]:
        """``(steps every replica can run from here, this replica is out of data)`` from the
        ready ``queue`` of this replica (a ``prefetch`` queue); raises ``StopIteration`` when
        the replicas stop here."""
        drop = self.drop_remainder
        queue.wait(need_full=drop)
        ready, full = queue.counts()
        have = full if drop else ready
        out = queue.finished and have == 0
        world = self.world
        empty = out and fresh and step == 0
        values = [have if drop or not out else _NO_LIMIT, -have, epoch, -epoch,
                  -(world - self.group_rank) if empty else 0]
        low, neg_high, epoch_low, neg_epoch_high, empty_code = self.exchange(
            values, f"epoch {epoch}, step {step}")
        if epoch_low != -neg_epoch_high:
            raise ReplicaMismatchError(
                f"the replicas are in different epochs of their input (epochs {epoch_low} to "
                f"{-neg_epoch_high}; rank {self.rank} is in epoch {epoch}). HINT: every replica "
                "must iterate the dataset the same number of times and load the same state.")
        if empty_code < 0:
            bad = self.global_rank(world + empty_code)
            what = ("fewer samples than one per-replica batch" if drop
                    else "no samples")
            raise EmptyShardError(
                f"the input shard of rank {bad} has {what} in epoch {epoch}, so it cannot "
                f"take part in the steps ({self.describe}). HINT: give every replica "
                "data: more files or samples than replicas (AutoShardPolicy.DATA splits "
                "samples instead of files), or fewer replicas.")
        if low == 0 or -neg_high == 0:
            raise StopIteration
        return low, out
