"""The whole parameter server: its strategy, the ClusterCoordinator and remote values,
variable placement, the server loop, the worker's client, sparse tables and the task queue.

The strategy registers itself with the registry of :mod:`replicator.strategies` here, so the
strategies room never imports this one; ``rp.get_strategy`` and ``rp.available_strategies`` are
taken from here, so that they know every built-in strategy, this one included."""

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
from replicator.strategies.registry import (
    available_strategies,
    find_strategy_class,
    get_strategy,
    register_strategy,
)

register_strategy(ParameterServerStrategy, "ps")

__all__ = ["partitioners", "Partitioner", "MinSizePartitioner", "FixedShardsPartitioner",
           "MaxSizePartitioner", "ParameterServerError", "ParameterServerLostError",
           "RemoteFunctionError", "TaskCancelledError", "NoWorkerError", "CallMismatchError",
           "ParameterServerStrategy", "ClusterCoordinator", "RemoteValue", "PerWorkerValues",
           "get_strategy", "available_strategies", "find_strategy_class"]
