"""The cluster room: who am I, the process group, and the local launcher."""

from replicator.cluster.environment import ClusterSpec, resolve_cluster
from replicator.cluster.function_launch import launch
from replicator.cluster.launcher import run_script
from replicator.cluster.hosts import local_host_key
from replicator.cluster.process_group import current_group, initialize, shutdown
from replicator.cluster.topology import Topology

__all__ = ["ClusterSpec", "resolve_cluster", "launch", "run_script", "initialize", "shutdown",
           "current_group", "Topology", "local_host_key"]
