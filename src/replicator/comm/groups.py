"""Facts about process groups that the algorithms need, and the private groups they create.

``new_group`` cannot make a group that only its members create under a name all compute alike:
with ``use_local_synchronization`` the name hashes how many groups this process knows, which
differs between processes, so members wait for each other until timeout.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist

from replicator.cluster.timeouts import set_group_timeout
from replicator.comm.op_errors import algorithm_error
from replicator.errors import ClusterConfigError


def unregistered(group: dist.ProcessGroup | None) -> bool:
    """True for a process group torch.distributed has no record of: one another library made
    on a store of its own (torchft's reconfigurable groups); its collectives work, but
    ``dist.get_rank`` and ``get_process_group_ranks`` do not know it."""
    if not isinstance(group, dist.ProcessGroup) or group is dist.GroupMember.WORLD:
        return False
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return True
    return False


def group_size(group: dist.ProcessGroup | None) -> int:
    """Replicas in ``group`` (1 when no process group exists: a lone process)."""
    if unregistered(group):
        return group.size()  # type: ignore[union-attr]
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's position in ``group``."""
    if unregistered(group):
        return group.rank()  # type: ignore[union-attr]
    if not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``group`` in group order (an :func:`unregistered` group's own
    positions: torch.distributed knows no global ranks for it)."""
    if unregistered(group):
        return list(range(group.size()))  # type: ignore[union-attr]
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where small tensors for collectives over ``group`` must live (a GPU for NCCL)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_member(group: dist.ProcessGroup | None, call: str) -> None:
    """Raise a clear error when this process is not a member of ``group``."""
    if group is not None and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"{call} on rank {global_rank()}: this process is not a member of the "
                         "group it was given. HINT: call it only on the processes of the group "
                         "(new_group returns a non-member marker on the others)")


_CREATED: Counter[tuple[str, tuple[int, ...]]] = Counter()
_CREATED_IN: list[object] = [None]  # the default group the counts belong to (by identity)
_CREATED_LOCK = threading.Lock()


def new_private_group(ranks: list[int], purpose: str, timeout_seconds: float,
                      backend: str | None = None) -> dist.ProcessGroup:
    """A group over global ``ranks`` created by its members only, named per ``purpose`` and order
    of creation."""
    ranks = sorted(ranks)
    me = global_rank()
    if me not in ranks:
        raise ValueError(f"rank {me} cannot create a group of ranks {ranks} it is not in")
    with _CREATED_LOCK:
        if _CREATED_IN[0] is not dist.group.WORLD:  # a new world: its members count afresh
            _CREATED.clear()
            _CREATED_IN[0] = dist.group.WORLD
        number = _CREATED[(purpose, tuple(ranks))]
        _CREATED[(purpose, tuple(ranks))] += 1
    digest = hashlib.sha1(",".join(map(str, ranks)).encode(), usedforsecurity=False)
    name = f"replicator-{purpose}-{digest.hexdigest()[:16]}-{number}"
    timeout = timedelta(seconds=timeout_seconds)
    backend = backend or dist.get_backend()
    try:
        from torch.distributed import distributed_c10d as c10d

        helper = c10d._new_process_group_helper
        store = c10d._get_default_store()
    except (ImportError, AttributeError):  # a torch without the helper: torch names the group
        pg = _local_new_group(ranks, timeout, backend)
        set_group_timeout(pg, timeout_seconds)
        return pg
    try:
        pg, _ = helper(len(ranks), ranks.index(me), ranks, backend, store,
                       c10d.GroupName(name),
                       timeout=timeout, group_desc=name)
    except RuntimeError as exc:
        raise algorithm_error(exc, me, f"forming the {purpose} group of ranks {ranks}") from exc
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    set_group_timeout(pg, timeout_seconds)
    return pg


def _local_new_group(ranks: list[int], timeout: timedelta, backend: str) -> dist.ProcessGroup:
    group = dist.new_group(ranks, timeout=timeout, backend=backend,
                           use_local_synchronization=True)
    if group is None:  # cannot happen: the caller is a member
        raise ClusterConfigError(f"rank {global_rank()} got no group for ranks {ranks}")
    return group
