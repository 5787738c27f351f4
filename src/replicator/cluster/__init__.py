"""The cluster room: who am I, the process group, exit codes, and the local launcher."""

from replicator.cluster.environment import ClusterSpec, resolve_cluster
from replicator.cluster.exit_codes import PREEMPTION_EXIT_CODE
from replicator.cluster.function_launch import launch
from replicator.cluster.hosts import local_host_key
from replicator.cluster.launcher import run_script
from replicator.cluster.process_group import current_group, initialize, shutdown
from replicator.cluster.resolvers import (
    ClusterResolver,
    SlurmResolver,
    TFConfigResolver,
    TorchrunResolver,
)
from replicator.cluster.topology import Topology

__all__ = ["ClusterSpec", "resolve_cluster", "launch", "run_script", "initialize", "shutdown",
           "current_group", "Topology", "local_host_key",
           "ClusterResolver", "TorchrunResolver", "TFConfigResolver", "SlurmResolver",
           "PREEMPTION_EXIT_CODE"]
