"""The data room: input contexts, sharding, per-replica batching."""

from replicator.data.distributed_dataset import (
    DistributedDataset,
    distribute_dataset,
    distribute_datasets_from_function,
)
from replicator.data.input_context import InputContext
from replicator.data.sharding import shard

__all__ = ["DistributedDataset", "InputContext", "distribute_dataset",
           "distribute_datasets_from_function", "shard"]
