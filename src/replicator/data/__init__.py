"""The data room: input contexts, sharding, per-replica batching, prefetch, resumable state."""

from replicator.data.distributed_dataset import (
    DistributedDataset,
    distribute_dataset,
    distribute_datasets_from_function,
)
from replicator.data.distributed_iterator import DistributedIterator
from replicator.data.errors import EmptyShardError, InputPipelineError, InputTimeoutError
from replicator.data.file_dataset import FileDataset
from replicator.data.input_context import InputContext
from replicator.data.options import AutoShardPolicy, InputOptions
from replicator.data.sharding import shard

__all__ = ["AutoShardPolicy", "DistributedDataset", "DistributedIterator", "EmptyShardError",
           "FileDataset", "InputContext", "InputOptions", "InputPipelineError",
           "InputTimeoutError", "distribute_dataset", "distribute_datasets_from_function",
           "shard"]
