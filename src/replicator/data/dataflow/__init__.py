"""The dataflow pipeline: ``rp.data.Dataset`` with tf.data's operators, AUTOTUNE, sharded tar
datasets on any fsspec store, exact resume for any number of replicas.

* ``dataset``: :class:`Dataset`, its constructors and operators, iteration, state, stats.
* ``options``: :data:`AUTOTUNE`, :class:`Options` (CPU and RAM budgets).
* ``graph``: nodes, the pass context and the runtime shared by the operators.
* ``sources``, ``ops``, ``cache``: the sources and operators; ``ops.lower`` fuses maps into
  batches.
* ``work``: what a worker runs; ``engine``: the worker pools (processes handing results back
  through shared memory, or threads); ``autotune``: how each stage picks its parallelism.
* ``shards``: WebDataset-layout tar shards: listing, reading, writing, the local shard cache.
* ``distribute``: a dataset as ``strategy.distribute_dataset``'s global-batch pipeline.
"""

from replicator.data.dataflow.dataset import INFINITE, UNKNOWN, Dataset
from replicator.data.dataflow.options import AUTOTUNE, Options

__all__ = ["AUTOTUNE", "Dataset", "INFINITE", "Options", "UNKNOWN"]
