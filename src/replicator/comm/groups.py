"""Facts about process groups that the algorithms need: size, own position, ranks, timeout."""

from __future__ import annotations

import torch.distributed as dist

from replicator.cluster.environment import timeout_from_env
from replicator.cluster.process_group import DEFAULT_TIMEOUT_SECONDS, current_group


def group_size(group: dist.ProcessGroup | None) -> int:
    """Replicas in ``group`` (1 when no process group exists: a lone process)."""
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's position in ``group``."""
    if not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``group`` in group order."""
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def is_world(group: dist.ProcessGroup | None) -> bool:
    """True for the default group (``None``) or a group holding every rank in order."""
    return group is None or group_ranks(group) == list(range(dist.get_world_size()))


def default_timeout_seconds() -> float:
    """The collective timeout of the running job (the process group's, else the launcher's)."""
    info = current_group()
    if info is not None:
        return info.timeout_seconds
    return timeout_from_env(DEFAULT_TIMEOUT_SECONDS)


def split_into_nodes(ranks: list[int], ranks_per_node: int) -> list[list[int]]:
    """Consecutive runs of ``ranks_per_node`` ranks (the last node may hold fewer)."""
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    return [ranks[i:i + ranks_per_node] for i in range(0, len(ranks), ranks_per_node)]
