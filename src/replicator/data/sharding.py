"""Sharding helpers for ``input_fn`` pipelines."""

from __future__ import annotations

from torch.utils.data import Dataset, Subset


def shard(dataset: Dataset, num_shards: int, index: int) -> Subset:
    """Every ``num_shards``-th sample starting at ``index`` (tf.data's ``shard``)."""
    if num_shards < 1 or not 0 <= index < num_shards:
        raise ValueError(f"shard index {index} is outside 0..{num_shards - 1}")
    n = len(dataset)  # type: ignore[arg-type]
    if n < num_shards:
        raise ValueError(f"dataset of {n} samples cannot give each of {num_shards} shards one; "
                         "use fewer replicas or more data")
    return Subset(dataset, range(index, n, num_shards))
