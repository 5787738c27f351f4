"""Variable partitioners (tf.distribute's ``variable_partitioner``: shards along dimension 0)
and placement: biggest first, each to the least loaded server, from shapes alone, so every
worker computes the same placement without talking."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch


class Partitioner(ABC):
    """How many shards (along dimension 0) a variable of ``shape`` and ``dtype`` gets."""

    @abstractmethod
    def num_shards(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """The number of shards, at least 1."""

    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> list[int]:
        """TensorFlow's form: the number of partitions along each axis (only axis 0 splits)."""
        return [self.num_shards(shape, dtype)] + [1] * max(0, len(shape) - 1)

    def __repr__(self) -> str:
        args = ", ".join(f"{k.lstrip('_')}={v}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


def _check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class FixedShardsPartitioner(Partitioner):
    """Split every variable into ``num_shards`` shards (fewer if it has fewer rows)."""

    def __init__(self, num_shards: int) -> None:
        self._num_shards = _check_positive("num_shards", num_shards)

    def num_shards(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        rows = shape[0] if len(shape) else 1
        return max(1, min(self._num_shards, rows))


class MinSizePartitioner(Partitioner):
    """Split a variable into shards of at least ``min_shard_bytes``, at most ``max_shards`` of them
    (and never more than its rows): big variables spread over servers, small ones stay whole."""

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1) -> None:
        self.min_shard_bytes = _check_positive("min_shard_bytes", min_shard_bytes)
        self.max_shards = _check_positive("max_shards", max_shards)

    def num_shards(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        rows = shape[0] if len(shape) else 1
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        by_size = max(1, nbytes // self.min_shard_bytes)
        return max(1, min(self.max_shards, by_size, rows))


class MaxSizePartitioner(Partitioner):
    """Split a variable into as few shards as keep each at most ``max_shard_bytes`` (whole
    rows; a row bigger than that is a shard of its own), at most ``max_shards`` of them
    (tf.distribute's ``MaxSizePartitioner``): a big embedding table spreads over the servers."""

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None) -> None:
        self.max_shard_bytes = _check_positive("max_shard_bytes", max_shard_bytes)
        self.max_shards = None if max_shards is None else _check_positive("max_shards", max_shards)

    def num_shards(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        rows = shape[0] if len(shape) else 1
        row_bytes = math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()
        rows_per_shard = max(1, self.max_shard_bytes // max(1, row_bytes))
        shards = max(1, math.ceil(rows / rows_per_shard))
        if self.max_shards is not None:
            shards = min(shards, self.max_shards)
        return max(1, min(shards, rows))


@dataclass(frozen=True)
class Shard:
    """Rows ``[start, end)`` of variable ``var_index`` (``name``), held by server ``server``
    (0-based among the servers) under the wire id ``shard_id``."""

    shard_id: int
    var_index: int
    name: str
    part: int
    parts: int
    start: int
    end: int
    server: int
    nbytes: int


def place(variables: Sequence[tuple[str, torch.Tensor]], num_servers: int,
          partitioner: Partitioner | None = None, first_shard_id: int = 0,
          loads: list[int] | None = None) -> list[Shard]:
    """Shards of ``variables`` and their servers; ``loads`` (bytes already on each server)
    is updated in place, so modules set up one after another keep the servers even."""
    loads = loads if loads is not None else [0] * num_servers
    shards: list[Shard] = []  # placed below
    for index, (name, t) in enumerate(variables):
        shape = tuple(t.shape)
        parts = partitioner.num_shards(shape, t.dtype) if partitioner is not None else 1
        if t.dim() == 0:
            parts = 1
        rows = shape[0] if shape else 1
        bounds = [rows * i // parts for i in range(parts + 1)]
        row_bytes = t.numel() * t.element_size() // max(1, rows)
        for part in range(parts):
            size = (bounds[part + 1] - bounds[part]) * row_bytes if shape else t.element_size()
            shards.append(Shard(first_shard_id + len(shards), index, name, part, parts,
                                bounds[part], bounds[part + 1], server=-1, nbytes=size))
    for i in sorted(range(len(shards)), key=lambda i: (-shards[i].nbytes, i)):
        target = min(range(num_servers), key=lambda s: (loads[s], s))
        shards[i] = replace(shards[i], server=target)
        loads[target] += shards[i].nbytes
    return shards
