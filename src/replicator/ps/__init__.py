"""The whole parameter server: its strategy, the ClusterCoordinator and remote values,
variable placement, the server loop, the worker's client, sparse tables and the task queue.

The strategy registers itself with the registry of :mod:`replicator.strategies` here, so the
strategies room never imports this one."""

from replicator.ps import partitioners
from replicator.ps.cluster_coordinator import ClusterCoordinator, PerWorkerValues, RemoteValue
from replicator.ps.parameter_server import ParameterServerStrategy
from replicator.ps.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
)
from replicator.ps.protocol import ParameterServerError, ParameterServerLostError
from replicator.ps.task_queue import (
    CallMismatchError,
    NoWorkerError,
    RemoteFunctionError,
    TaskCancelledError,
)
from replicator.strategies.registry import register_strategy

register_strategy(ParameterServerStrategy, "ps")

__all__ = ["partitioners", "Partitioner", "MinSizePartitioner", "FixedShardsPartitioner",
           "MaxSizePartitioner", "ParameterServerError", "ParameterServerLostError",
           "RemoteFunctionError", "TaskCancelledError", "NoWorkerError", "CallMismatchError",
           "ParameterServerStrategy", "ClusterCoordinator", "RemoteValue", "PerWorkerValues"]
