"""The worker side of exactly-once input: batches claimed from server 0, one epoch per pass.

``ParameterServerStrategy.distribute_dataset`` returns a :class:`ClaimedBatches` when workers
run asynchronously (``staleness`` is not 0): instead of a fixed 1/N of every global batch,
each worker takes the next unclaimed per-replica batch of the epoch, so fast workers take more
batches than slow ones, and a lost worker's unfinished batches are taken over by the others
(see :mod:`replicator.ps.claims`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import Dataset
from torch.utils.data.dataloader import default_collate


class _Claimer(Protocol):
    def _claim_batch(self, stream: int, epoch: int, total: int) -> int: ...

    def _set_claim(self, claim: tuple[int, int, int] | None) -> None: ...


class ClaimedBatches:
    """Per-replica batches of ``dataset`` (``batch_size`` samples each) claimed one by one.

    Every worker cuts each epoch the same way: a permutation seeded by ``seed + epoch`` (or
    the dataset order without ``shuffle``), ``batch_size`` samples a batch, a short last batch
    dropped with ``drop_last``. Iterating once runs one epoch. ``stream`` numbers the
    strategy's distributed datasets in creation order (the same on every worker).
    """

    def __init__(self, strategy: _Claimer, stream: int, dataset: Dataset, batch_size: int, *,
                 shuffle: bool, seed: int, drop_last: bool,
                 collate_fn: Callable[[list[Any]], Any] | None = None) -> None:
        self._strategy = strategy
        self.stream = stream
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.collate_fn = collate_fn or default_collate
        self.epoch = 0
        self.size = len(dataset)  # type: ignore[arg-type]

    def __len__(self) -> int:
        """Batches in one epoch, over all workers together."""
        if self.drop_last:
            return self.size // self.batch_size
        return math.ceil(self.size / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Start the next pass at ``epoch`` (a restarted job continues where it was)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        epoch = self.epoch
        self.epoch += 1
        if self.shuffle:
            order = torch.randperm(self.size,
                                   generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            order = torch.arange(self.size)
        total = len(self)
        try:
            while True:
                index = self._strategy._claim_batch(self.stream, epoch, total)
                if index < 0:
                    return
                rows = order[index * self.batch_size:(index + 1) * self.batch_size].tolist()
                batch = self.collate_fn([self.dataset[i] for i in rows])
                self._strategy._set_claim((self.stream, epoch, index))
                yield batch
        finally:
            self._strategy._set_claim(None)
