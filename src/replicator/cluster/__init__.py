"""The cluster room: who am I (rank, host, role, topology), the process group, exit codes.

Worker side only: the parent side (spawn, relay, restarts) is :mod:`replicator.launch`."""

from replicator.cluster.environment import ClusterSpec, resolve_cluster
from replicator.cluster.exit_codes import PREEMPTION_EXIT_CODE
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
