"""Parameter servers: variable placement, the server loop, the worker's client, sparse tables
and the coordinator's task queue."""

from replicator.ps import partitioners
from replicator.ps.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
)
from replicator.ps.protocol import ParameterServerError, ParameterServerLostError
from replicator.ps.task_queue import NoWorkerError, RemoteFunctionError, TaskCancelledError

__all__ = ["partitioners", "Partitioner", "MinSizePartitioner", "FixedShardsPartitioner",
           "MaxSizePartitioner", "ParameterServerError", "ParameterServerLostError",
           "RemoteFunctionError", "TaskCancelledError", "NoWorkerError"]
