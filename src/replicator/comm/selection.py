"""Pick the all-reduce algorithm from ``CommunicationOptions.implementation``; ``"auto"`` chooses
alike on every rank (docs/collectives.md)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from replicator.cluster.hosts import exchange_host_keys
from replicator.comm.algorithms import CrossDeviceOps, NativeAllReduce, ReductionToOneDevice
from replicator.comm.hierarchical import HierarchicalAllReduce
from replicator.comm.options import CommunicationOptions
from replicator.comm.ring import RingAllReduce
from replicator.comm.shared_memory import SharedMemoryAllReduce
from replicator.comm.shm_segment import (
    SharedSegment,
    check_same_host,
    shared_memory_problem,
    shm_dir,
)
from replicator.errors import ClusterConfigError

log = logging.getLogger("replicator")
_LOGGED: set[str] = set()
#: The algorithm each ``implementation`` names ("auto" on CPU may pick another, see above).
_ALGORITHMS: dict[str, type[CrossDeviceOps]] = {
    "auto": NativeAllReduce, "nccl": NativeAllReduce, "gloo": NativeAllReduce,
    "ring": RingAllReduce, "hierarchical": HierarchicalAllReduce,
    "reduce_to_one": ReductionToOneDevice, "shared_memory": SharedMemoryAllReduce}


@dataclass(frozen=True)
class AutoChoice:
    """What ``"auto"`` picks, and one sentence saying why."""

    name: str
    reason: str


def _gloo(why: str) -> AutoChoice:
    return AutoChoice("gloo", f"{why}; falling back to gloo's all-reduce")


def describe_auto(device: torch.device | None = None, hosts: int = 1,
                  local_replicas: int = 1) -> AutoChoice:
    """What ``"auto"`` would choose on this process's facts alone (for ``replicator env``)."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        return AutoChoice("nccl", "the replicas compute on CUDA devices: NCCL's own "
                          "all-reduce is the fastest there")
    problem = shared_memory_problem(max(1, local_replicas))
    if problem:
        return _gloo(f"shared memory cannot be used: {problem}")
    if hosts > 1:
        return AutoChoice("hierarchical", f"the replicas run on {hosts} hosts: shared memory "
                          "inside each host, gloo between one leader per host")
    return AutoChoice("shared_memory", f"every replica runs on this host and {shm_dir()} is "
                      "usable: a shared-memory all-reduce, no sockets")


def choose_auto(device: torch.device, group: dist.ProcessGroup | None) -> AutoChoice:
    """``"auto"``'s choice for ``group``, the same on every rank (a collective)."""
    if device.type == "cuda":
        return describe_auto(device)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return AutoChoice("gloo", "a single replica: nothing to reduce")
    keys = exchange_host_keys(group)
    hosts = len(set(keys))
    local = max(keys.count(k) for k in set(keys))
    problem = shared_memory_problem(max(1, local))
    flag = torch.tensor([0 if problem else 1], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    if int(flag) == 0:
        problem = problem or "another replica cannot use its shared memory (its log says why)"
        return _gloo(f"shared memory cannot be used: {problem}")
    if hosts > 1:
        return describe_auto(device, hosts, local)
    try:  # collectives that raise on every rank alike when any rank fails
        check_same_host(group, "shared-memory all-reduce")
        SharedSegment.create(SharedMemoryAllReduce().piece_bytes, group,
                             "shared-memory all-reduce (trial)")
    except Exception as exc:  # noqa: BLE001 - every rank sees the failure and falls back
        return _gloo(f"creating a shared-memory segment failed ({exc})")
    return describe_auto(device, hosts, local)


def algorithm_for(options: CommunicationOptions, device: torch.device,
                  group: dist.ProcessGroup | None = None) -> CrossDeviceOps:
    """The algorithm ``options.implementation`` names, for replicas computing on ``device``."""
    impl = options.implementation
    if impl == "nccl" and device.type != "cuda":
        raise ClusterConfigError(
            f"CommunicationOptions(implementation='nccl') needs CUDA devices, but the replicas "
            f"compute on {device}. HINT: use implementation='auto' (gloo on CPU) or 'ring'.")
    if impl == "gloo" and device.type == "cuda":
        raise ClusterConfigError(
            "CommunicationOptions(implementation='gloo') was given for CUDA replicas, whose "
            "process group is NCCL. HINT: use implementation='auto' or 'nccl' on GPUs.")
    if impl == "auto" and device.type == "cpu" and dist.is_initialized():
        choice, rank = choose_auto(device, group), dist.get_rank()
        fell_back = choice.name == "gloo" and "single replica" not in choice.reason
        if (rank == 0 or fell_back) and f"{choice.name}|{choice.reason}" not in _LOGGED:
            log.log(logging.WARNING if fell_back else logging.INFO,
                    "CommunicationOptions(implementation='auto') chose %s on rank %d: %s",
                    choice.name, rank, choice.reason)
        _LOGGED.add(f"{choice.name}|{choice.reason}")  # each choice logged once
        if choice.name in ("shared_memory", "hierarchical"):
            impl = choice.name
    if impl == "shared_memory" and device.type != "cpu":
        raise ClusterConfigError(
            f"CommunicationOptions(implementation='shared_memory') works on CPU replicas, "
            f"these compute on {device}. HINT: use implementation='auto' (NCCL) on GPUs.")
    return _ALGORITHMS[impl](timeout_seconds=options.timeout_seconds)
