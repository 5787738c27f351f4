"""Facts about process groups that the algorithms need, the private groups they create (named by
replicator: ``new_group``'s names differ between members, docs/collectives.md), and backend
failures turned into errors naming the rank and the operation."""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections import Counter
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

from replicator.cluster.timeouts import set_group_timeout
from replicator.cluster.worker_errors import finished_peers
from replicator.errors import ClusterConfigError, ReplicaTimeoutError, ReplicatorError

TIMEOUT_WORDS = ("timed out", "timeout", "deadline")
LOST_PEER_WORDS = ("connection reset", "connection closed", "broken pipe", "connection refused",
                   "socket closed", "end of file")


def finished_peer_error(what: str, rank: int, peers: Iterable[int] | None = None
                        ) -> ReplicatorError | None:
    """An error saying a peer of ``rank`` in ``what`` finished its script normally (exit code 0),
    or ``None``."""
    if peers is None:
        peers = range(int(os.environ.get("WORLD_SIZE", "1")))
    done = finished_peers([p for p in peers if p != rank])
    if not done:
        return None
    one = len(done) == 1
    who = f"rank {done[0]}" if one else "ranks " + ", ".join(map(str, done))
    return ReplicatorError(
        f"{what} on rank {rank} failed because {who} finished {'its' if one else 'their'} "
        f"script normally (exit code 0) while rank {rank} waited for {'it' if one else 'them'}."
        " The likely cause: a collective called on some ranks only (for example under `if "
        "strategy.is_chief:`). HINT: every rank must make the same collective calls in the "
        "same order; call it on every rank and use the result on the chief only.")


def algorithm_error(exc: BaseException, rank: int, what: str,
                    peers: Iterable[int] | None = None) -> BaseException:
    """``exc`` raised in ``what`` on ``rank`` as a :class:`ReplicatorError` with a hint
    (replicator's, type and value errors pass)."""
    if isinstance(exc, (ReplicatorError, TypeError, ValueError)) or not isinstance(exc, Exception):
        return exc
    first = re.sub(r"^\[[^\]]*\]\s*", "", (str(exc).splitlines() or [""])[0])[:200]
    text = str(exc).lower()
    if any(w in text for w in TIMEOUT_WORDS):
        return ReplicaTimeoutError(
            f"{what} on rank {rank} timed out waiting for another replica ({first}). HINT: a "
            "rank may be on another code path or stuck; every rank must make the same "
            "collective calls in the same order.")
    if any(w in text for w in LOST_PEER_WORDS):
        return finished_peer_error(what, rank, peers) or ReplicatorError(
            f"{what} on rank {rank} failed because another replica exited or lost its "
            f"connection ({first}). HINT: look for that rank's own error; the launcher reports "
            "the first failure.")
    return ReplicatorError(f"{what} failed on rank {rank}: {exc}")


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
    """A group over global ``ranks`` made by its members only, named per ``purpose`` and order."""
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
        pg = dist.new_group(ranks, timeout=timeout, backend=backend,
                            use_local_synchronization=True)
        if pg is None:  # cannot happen: the caller is a member
            raise ClusterConfigError(f"rank {me} got no group for ranks {ranks}") from None
    else:
        try:
            pg, _ = helper(len(ranks), ranks.index(me), ranks, backend, store,
                           c10d.GroupName(name), timeout=timeout, group_desc=name)
        except RuntimeError as exc:
            raise algorithm_error(exc, me, f"forming the {purpose} group of ranks {ranks}") from exc
        c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    set_group_timeout(pg, timeout_seconds)
    return pg
