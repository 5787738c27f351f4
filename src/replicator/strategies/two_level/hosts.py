"""The host layout of a two-level run, as one :class:`~replicator.cluster.Topology`
``{"hosts": H, "local": L}`` whose mesh lists the ranks host by host: the inner group is a host's
processes (the ``local`` axis), the outer groups the same local rank across hosts (``hosts``).
A host's processes need not be consecutive ranks (``hosts=[[0, 2], [1, 3]]``); the hosts come
from ``mesh=rp.Topology(hosts=...)`` or the environment (:mod:`replicator.cluster.hosts`).
"""

from __future__ import annotations

from typing import Any

from replicator.cluster.hosts import HostsSpec, check_hosts_spec, group_by_host, job_host_keys
from replicator.cluster.topology import DATA_AXES, Topology
from replicator.errors import ClusterConfigError

HOSTS_AXIS = "hosts"
LOCAL_AXIS = "local"


def check_mesh(mesh: Any, hosts: HostsSpec) -> None:
    """Refuse a ``mesh=`` that is no topology, or one given beside ``hosts=`` (no group needed)."""
    check_hosts_spec(hosts)
    if mesh is None:
        return
    if not isinstance(mesh, Topology):
        raise TypeError(f"mesh must be an rp.Topology (whose hosts are the outer groups), got "
                        f"{type(mesh).__name__}. HINT: mesh=rp.Topology(hosts=2)")
    if hosts is not None:
        raise ClusterConfigError(
            f"hosts={hosts!r} was given beside mesh={mesh!r}, which has hosts of its own. HINT: "
            f"declare the hosts once, on the topology: mesh=rp.Topology(hosts={hosts!r})")
    if mesh.num_ps:
        raise ClusterConfigError(
            f"mesh={mesh!r} has {mesh.num_ps} parameter server(s); a two-level strategy trains "
            "on every process of the job. HINT: build the topology without num_ps")
    other = [a for a, n in mesh.axes.items() if a not in DATA_AXES and n > 1]
    if other:
        raise ClusterConfigError(
            f"mesh={mesh!r} splits the model along {other}; a two-level strategy keeps a whole "
            "replica on every process and takes only the topology's hosts. HINT: "
            "mesh=rp.Topology(hosts=...) with the default data axis")


def host_groups(mesh: Topology | None, hosts: HostsSpec) -> list[list[int]]:
    """Each host's ranks, in order of their first rank: ``mesh``'s, else the environment's
    with ``hosts`` declared over them (a collective: the host keys are exchanged)."""
    keys = mesh.hosts if mesh is not None else job_host_keys(hosts)
    return group_by_host(list(range(len(keys))), keys)


def host_layout(groups: list[list[int]]) -> tuple[int, int]:
    """``(number of hosts, processes per host)`` of ``groups`` (each host's ranks); refuses
    hosts with different numbers of processes, which the two-level topology cannot express."""
    counts = [len(members) for members in groups]
    if len(set(counts)) > 1:
        raise ClusterConfigError(
            f"the hosts run different numbers of processes (ranks by host: {groups}); a "
            "two-level strategy "
            "needs the same number on every host. HINT: launch the same --nproc on every node, "
            "or declare equal hosts with mesh=rp.Topology(hosts=N)")
    return len(groups), counts[0]


def two_level_topology(num_hosts: int, per_host: int,
                       groups: list[list[int]] | None = None) -> Topology:
    """The topology whose ``hosts`` axis is the outer groups and ``local`` axis the inner;
    its hosts are ``groups`` (``None``: the environment's), listed host by host in its mesh:
    the inner group is a host's ranks, the outer the ``i``-th rank of every host."""
    order = None if groups is None else [rank for members in groups for rank in members]
    return Topology({HOSTS_AXIS: num_hosts, LOCAL_AXIS: per_host}, hosts=groups,
                    worker_order=order)
