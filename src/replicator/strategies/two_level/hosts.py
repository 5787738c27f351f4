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


def two_level_topology(mesh: Topology | None, hosts: HostsSpec,
                       one_host: int | None = None) -> Topology:
    """The topology whose ``hosts`` axis is the outer groups and ``local`` axis the inner,
    ranks listed host by host: ``mesh``'s hosts, else the environment's with ``hosts`` declared
    over them (a collective: the host keys are exchanged); ``one_host=n``: one host of ``n``
    processes (a replica group). Hosts must run equal numbers of processes."""
    if one_host is not None:
        return Topology({HOSTS_AXIS: 1, LOCAL_AXIS: one_host})
    keys = mesh.hosts if mesh is not None else job_host_keys(hosts)
    groups = group_by_host(list(range(len(keys))), keys)
    if len({len(members) for members in groups}) > 1:
        raise ClusterConfigError(
            f"the hosts run different numbers of processes (ranks by host: {groups}); a "
            "two-level strategy needs the same number on every host. HINT: launch the same "
            "--nproc on every node, or declare equal hosts with mesh=rp.Topology(hosts=N)")
    return Topology({HOSTS_AXIS: len(groups), LOCAL_AXIS: len(groups[0])}, hosts=groups,
                    worker_order=[rank for members in groups for rank in members])
