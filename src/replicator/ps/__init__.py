"""Parameter servers: variable placement, the server loop, and the worker's client."""

from replicator.ps import partitioners
from replicator.ps.partitioners import FixedShardsPartitioner, MinSizePartitioner, Partitioner
from replicator.ps.protocol import ParameterServerError, ParameterServerLostError

__all__ = ["partitioners", "Partitioner", "MinSizePartitioner", "FixedShardsPartitioner",
           "ParameterServerError", "ParameterServerLostError"]
