"""The cluster room, worker side: who am I (rank, host, role, topology), the process group."""

from typing import TYPE_CHECKING

from replicator.cluster.env_names import PREEMPTION_EXIT_CODE
from replicator.lazy_names import lazy_getattr

if TYPE_CHECKING:
    from replicator.cluster.environment import ClusterSpec, resolve_cluster
    from replicator.cluster.hosts import local_host_key
    from replicator.cluster.process_group import current_group, initialize, shutdown
    from replicator.cluster.resolvers import (
        ClusterResolver,
        SlurmResolver,
        TFConfigResolver,
        TorchrunResolver,
    )
    from replicator.cluster.topology import Topology

__all__ = ["ClusterSpec", "resolve_cluster", "initialize", "shutdown",
           "current_group", "Topology", "local_host_key",
           "ClusterResolver", "TorchrunResolver", "TFConfigResolver", "SlurmResolver",
           "PREEMPTION_EXIT_CODE"]

#: Imported on first use: the launcher imports this room's light modules (ports, environment
#: names, error files) without torch, which the process group and the topology need.
__getattr__ = lazy_getattr(__name__, {
    "ClusterSpec": "replicator.cluster.environment",
    "resolve_cluster": "replicator.cluster.environment",
    "local_host_key": "replicator.cluster.hosts",
    **dict.fromkeys(["current_group", "initialize", "shutdown"],
                    "replicator.cluster.process_group"),
    **dict.fromkeys(["ClusterResolver", "SlurmResolver", "TFConfigResolver", "TorchrunResolver"],
                    "replicator.cluster.resolvers"),
    "Topology": "replicator.cluster.topology",
})
