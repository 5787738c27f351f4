"""The host layout of a two-level run: which processes train together, which exchange.

The inner group is a host's processes; the outer groups join the processes of the same local
rank across hosts. Both are axes of one :class:`~replicator.cluster.Topology`:
``{"hosts": H, "local": L}`` over the job's ranks, row-major, so a host's processes must be
``L`` consecutive ranks (what ``replicator run --nnodes``, torchrun and SLURM give).
Hosts are read from each process's host key (``REPLICATOR_HOST``, ``TF_CONFIG``, or the
hostname and node rank; see :mod:`replicator.cluster.hosts`), or declared with ``hosts=N``:
then ranks ``0..L-1`` are host 0, the next ``L`` host 1, and so on.
"""

from __future__ import annotations

import torch.distributed as dist

from replicator.cluster.hosts import exchange_host_keys, group_by_host
from replicator.cluster.topology import Topology
from replicator.errors import ClusterConfigError

HOSTS_AXIS = "hosts"
LOCAL_AXIS = "local"


def host_layout(hosts: int | None) -> tuple[int, int]:
    """``(number of hosts, processes per host)`` of this job (a collective when ``hosts`` is
    ``None``: the host keys are exchanged). Refuses layouts the topology cannot express."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if hosts is not None:
        if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 1:
            raise ValueError(f"hosts must be a positive integer or None, got {hosts!r}")
        if world % hosts:
            raise ClusterConfigError(
                f"hosts={hosts} does not divide the job's {world} processes; every host runs "
                f"the same number of processes. HINT: choose hosts among "
                f"{[d for d in range(1, world + 1) if world % d == 0]}, or launch a multiple of "
                f"{hosts} processes")
        return hosts, world // hosts
    keys = exchange_host_keys(None)
    by_host = group_by_host(list(range(world)), keys)
    counts = [len(members) for members in by_host]
    if len(set(counts)) > 1:
        layout = ", ".join(f"{keys[m[0]]}: {len(m)}" for m in by_host)
        raise ClusterConfigError(
            f"the hosts run different numbers of processes ({layout}); a two-level strategy "
            "needs the same number on every host. HINT: launch the same --nproc on every node, "
            "or declare the layout with hosts=N")
    per_host = counts[0]
    if any(members != list(range(i * per_host, (i + 1) * per_host))
           for i, members in enumerate(by_host)):
        raise ClusterConfigError(
            f"the processes of a host are not consecutive ranks (hosts by rank: {keys}). "
            "HINT: launch with replicator run --nnodes, torchrun or SLURM, which number a "
            "node's processes together, or declare the layout with hosts=N")
    return len(by_host), per_host


def two_level_topology(num_hosts: int, per_host: int) -> Topology:
    """The topology whose ``hosts`` axis is the outer groups and ``local`` axis the inner."""
    return Topology({HOSTS_AXIS: num_hosts, LOCAL_AXIS: per_host})
