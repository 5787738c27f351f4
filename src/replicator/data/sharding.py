"""``shard``: a replica's share of a dataset, for ``input_fn`` pipelines (tf.data's ``shard``)."""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset, Subset

from replicator.data.errors import EmptyShardError
from replicator.data.file_dataset import FileDataset


def shard(dataset: Dataset | FileDataset, num_shards: int, index: int) -> Any:
    """Shard ``index`` of ``num_shards``: every ``num_shards``-th sample starting at ``index``,
    or for a :class:`FileDataset` every ``num_shards``-th file (FILE sharding)."""
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards must be a positive integer, got {num_shards!r}")
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index {index} is outside 0..{num_shards - 1}")
    if isinstance(dataset, FileDataset):
        if dataset.num_files < num_shards:
            raise EmptyShardError(
                f"{dataset.num_files} files cannot give each of {num_shards} shards one. HINT: "
                "split the data into more files, or shard by sample (rp.data.shard of a "
                "map-style dataset).")
        return FileDataset(dataset.files[index::num_shards], dataset.reader)
    n = len(dataset)  # type: ignore[arg-type]
    if n < num_shards:
        raise EmptyShardError(f"dataset of {n} samples cannot give each of {num_shards} shards "
                              "one; use fewer replicas or more data")
    return Subset(dataset, range(index, n, num_shards))
