"""Split every global batch across replicas, with the same shuffled order for any world size.

The global order of sample indices depends only on the seed and the epoch, so one replica with
batch B and N replicas with B/N each see the same global batches, step by step. Replica ``r``
takes the ``r``-th contiguous slice of each global batch.

The last global batch of an epoch may be short (``L < B`` samples). With ``drop_remainder`` it
is dropped on every replica; otherwise it is split as evenly as possible (:func:`slice_bounds`)
and a replica whose slice is empty gets one masked copy of a sample, so it still runs the step.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch.utils.data import Sampler


def global_order(num_samples: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """Indices of one epoch in global order (a seeded permutation, or 0..n-1)."""
    if not shuffle:
        return list(range(num_samples))
    gen = torch.Generator()
    gen.manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=gen).tolist()


def slice_bounds(batch_len: int, rank: int, world: int) -> tuple[int, int]:
    """The ``[start, stop)`` slice of a batch of ``batch_len`` that replica ``rank`` takes:
    as even as possible, the first ``batch_len % world`` replicas one larger."""
    base, extra = divmod(batch_len, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def check_divisible(global_batch_size: int, world: int) -> int:
    """The per-replica batch size; a clear error when the global one does not split evenly."""
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) \
            or global_batch_size < 1:
        raise ValueError(f"the global batch size must be a positive integer, got "
                         f"{global_batch_size!r}")
    if global_batch_size % world:
        raise ValueError(
            f"global batch size {global_batch_size} is not divisible by the {world} "
            f"replicas in sync. HINT: use a multiple of {world} so every replica gets the same "
            f"number of samples, e.g. {max(world, global_batch_size - global_batch_size % world)}.")
    return global_batch_size // world


class Part(NamedTuple):
    """This replica's part of one global batch of ``length`` samples."""

    start: int      # first position (in the global batch) of this replica's real samples
    stop: int       # one past the last
    size: int       # rows this replica's batch has (real + masked padding)
    full: bool      # the global batch had the full size


def replica_part(length: int, global_batch_size: int, rank: int, world: int, *,
                 drop_remainder: bool, pad_last_batch: bool) -> Part | None:
    """Which positions of a global batch of ``length`` replica ``rank`` takes (``None``: the
    batch is dropped). See the module doc for the rule on a short last batch."""
    full = length >= global_batch_size
    if not full and drop_remainder:
        return None
    start, stop = slice_bounds(length, rank, world)
    real = stop - start
    per_replica = global_batch_size // world
    size = per_replica if (full or pad_last_batch) else max(real, 1)
    return Part(start, stop, size, full)


class GlobalBatchSplitSampler(Sampler[list[int]]):
    """A batch sampler yielding this replica's part of each global batch (for a DataLoader).

    A last global batch with fewer samples than replicas would leave some replica with nothing
    to compute on, so it is dropped with a warning; use ``drop_last=True`` to drop every
    partial last batch. (The distributed dataset pads such a batch with masked samples instead.)
    """

    def __init__(self, num_samples: int, global_batch_size: int, rank: int, world: int, *,
                 shuffle: bool, seed: int = 0, drop_last: bool = False) -> None:
        if global_batch_size < world:
            raise ValueError(f"global batch size {global_batch_size} is smaller than the "
                             f"{world} replicas; each replica needs at least one sample")
        check_divisible(global_batch_size, world)
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.rank, self.world = rank, world
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _num_batches(self) -> int:
        full, rest = divmod(self.num_samples, self.global_batch_size)
        return full + (1 if rest >= self.world and not self.drop_last else 0)

    def __len__(self) -> int:
        return self._num_batches()

    def __iter__(self) -> Iterator[list[int]]:
        order = global_order(self.num_samples, self.shuffle, self.seed, self.epoch)
        rest = self.num_samples % self.global_batch_size
        if 0 < rest < self.world and not self.drop_last:
            warnings.warn(f"the last global batch has {rest} samples for {self.world} replicas "
                          "and is dropped", stacklevel=2)
        for b in range(self._num_batches()):
            batch = order[b * self.global_batch_size:(b + 1) * self.global_batch_size]
            start, stop = slice_bounds(len(batch), self.rank, self.world)
            yield batch[start:stop]
