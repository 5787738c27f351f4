"""The data room: each replica's share of the input, batched, prefetched and resumable.

Where things are:

* ``context``: :class:`InputContext` (this process's count and position on the data axis),
  :class:`AutoShardPolicy`, :class:`InputOptions`.
* ``batching``: where a batch is split: the seeded global order of an epoch, shuffling, and
  cutting each global batch into per-replica batches (``replica_part``, ``slice_bounds``,
  ``slice_rows``), with masked padding for a short last batch.
* ``sharding``: which samples each replica reads, step by step, for each shard policy
  (DATA/OFF global-batch plans, FILE shards of a :class:`FileDataset`, ``input_fn``
  pipelines) and :func:`shard`.
* ``pipeline``: building a replica's pipeline from what the user has, and the engines that
  load it (inline, threads, processes).
* ``prefetch``: the ready-batch queue and the copy to the replica's device.
* ``agreement``: uneven ends: replicas agree, on their data-parallel group, when to stop.
* ``dataset``: :class:`DistributedDataset` / :class:`DistributedIterator`,
  :func:`distribute_dataset`, :func:`distribute_datasets_from_function`, resumable state.
* ``errors``: the input pipeline's errors.
* ``dataflow``: :class:`Dataset`, the tf.data-style pipeline (sources, operators, AUTOTUNE,
  sharded tar datasets, exact resume), :class:`Options`, :data:`AUTOTUNE`.
"""

from replicator.data.context import AutoShardPolicy, InputContext, InputOptions
from replicator.data.dataflow import AUTOTUNE, INFINITE, UNKNOWN, Dataset, Options
from replicator.data.dataflow.shards import ShardError, write_shards
from replicator.data.dataset import (
    DistributedDataset,
    DistributedIterator,
    distribute_dataset,
    distribute_datasets_from_function,
)
from replicator.data.errors import EmptyShardError, InputPipelineError, InputTimeoutError
from replicator.data.sharding import FileDataset, shard

__all__ = ["AUTOTUNE", "INFINITE", "UNKNOWN", "AutoShardPolicy", "Dataset", "Options",
           "DistributedDataset", "DistributedIterator", "EmptyShardError",
           "FileDataset", "InputContext", "InputOptions", "InputPipelineError",
           "InputTimeoutError", "ShardError", "distribute_dataset",
           "distribute_datasets_from_function", "shard", "write_shards"]
