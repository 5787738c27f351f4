"""Exact data across replica groups: each step's global batch, split over that step's quorum.

torchft's own sampler is fixed per replica group, so a lost group's samples are skipped and the
global batch shrinks while it is away. Here the global batch of committed step ``t`` is a pure
function of ``t`` (epoch ``t // steps_per_epoch``, the epoch's seeded order from
:func:`~replicator.data.batching.global_order`, the same order ``distribute_dataset`` uses), and
it is split over the groups of the quorum that runs step ``t``: with 2 of 3 groups alive each
takes half. A step redone by a new quorum takes the same global batch, split anew, so every
sample of an epoch is trained exactly once and the optimisation is that of one device.

Within a group of ``K`` processes the batch is cut in units of ``K`` samples (one per rank),
so every rank of a group holds the same count and the group's gradient average is the mean
over its samples; across groups each group's mean is weighted by its share of the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    default_collate,
)

from replicator.data.batching import global_order, slice_bounds


@dataclass(frozen=True)
class Share:
    """This process's samples of one step and the weight of its group's gradient mean."""

    step: int
    epoch: int
    index: int            # the batch's position in its epoch
    indices: list[int]    # dataset indices this process trains on
    group_weight: float   # this group's samples / the global batch's samples
    global_size: int      # samples in the step's global batch


class StepSplit:
    """The global batches of a map-style dataset, addressed by step (see the module doc).

    ``num_samples`` samples, global batches of ``global_batch_size``, seeded shuffle per epoch
    (``shuffle``, ``seed``), ``drop_remainder`` for a short last batch; ``group_size``: the
    processes of one replica group (``K``).
    """

    def __init__(self, num_samples: int, global_batch_size: int, *, shuffle: bool, seed: int,
                 drop_remainder: bool, group_size: int = 1, max_groups: int = 1) -> None:
        if global_batch_size < 1:
            raise ValueError(f"the global batch size must be positive, got {global_batch_size}")
        if global_batch_size % group_size:
            raise ValueError(
                f"global batch size {global_batch_size} is not divisible by the {group_size} "
                f"processes of a replica group, so a group's ranks would train on different "
                f"numbers of samples. HINT: use a multiple of {group_size}")
        if global_batch_size // group_size < max_groups:
            raise ValueError(
                f"global batch size {global_batch_size} gives {global_batch_size // group_size} "
                f"units of {group_size} samples for up to {max_groups} replica groups, so some "
                f"group would train on nothing. HINT: use a global batch of at least "
                f"{max_groups * group_size}")
        rest = num_samples % global_batch_size
        if rest and not drop_remainder and rest % group_size:
            raise ValueError(
                f"the last global batch holds {rest} samples, which the {group_size} processes "
                f"of a replica group cannot share evenly. HINT: drop_remainder=True, or a "
                f"dataset size that leaves a multiple of {group_size}")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.shuffle, self.seed, self.drop_remainder = shuffle, seed, drop_remainder
        self.group_size = group_size
        full = num_samples // global_batch_size
        self.steps_per_epoch = full + (1 if rest and not drop_remainder else 0)
        if self.steps_per_epoch == 0:
            raise ValueError(f"the dataset's {num_samples} samples make no global batch of "
                             f"{global_batch_size}. HINT: a smaller batch or drop_remainder=False")
        self._order: tuple[int, list[int]] | None = None

    def locate(self, step: int) -> tuple[int, int]:
        """``(epoch, index in epoch)`` of committed step ``step``."""
        return divmod(step, self.steps_per_epoch)

    def global_indices(self, step: int) -> list[int]:
        """The dataset indices of step ``step``'s global batch, in global order."""
        epoch, index = self.locate(step)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, global_order(self.num_samples, self.shuffle, self.seed, epoch))
        order = self._order[1]
        return order[index * self.global_batch_size:(index + 1) * self.global_batch_size]

    def share(self, step: int, participant: int, participants: int, group_rank: int) -> Share:
        """Step ``step``'s samples for rank ``group_rank`` of the group that is participant
        ``participant`` of ``participants`` in the step's quorum."""
        if not 0 <= participant < participants:
            raise ValueError(f"participant {participant} is not in 0..{participants - 1}")
        epoch, index = self.locate(step)
        batch = self.global_indices(step)
        k = self.group_size
        units = len(batch) // k
        start, stop = slice_bounds(units, participant, participants)
        group = batch[start * k:stop * k]
        mine = group[group_rank::k]
        return Share(step, epoch, index, mine, len(group) / len(batch), len(batch))


@dataclass
class MapInput:
    """A map-style dataset with its collate function and the settings of its global order."""

    dataset: Any
    global_batch_size: int
    shuffle: bool
    drop_remainder: bool
    collate: Callable[[list[Any]], Any]

    def load(self, indices: list[int]) -> Any:
        """The collated batch of ``indices``."""
        return self.collate([self.dataset[i] for i in indices])


def map_input(data: Any, *, batch_size: int | None, shuffle: bool | None,
              drop_remainder: bool | None) -> MapInput:
    """What live recovery needs from ``distribute_dataset``'s input: a map-style dataset read
    by index (a ``Dataset`` with ``batch_size=``, or a plain ``DataLoader`` over one)."""
    collate: Callable[[list[Any]], Any] = default_collate
    if isinstance(data, DataLoader):
        sampler = data.sampler
        plain = data.batch_size is not None and type(data.batch_sampler) is BatchSampler and (
            type(sampler) is SequentialSampler
            or (type(sampler) is RandomSampler and not sampler.replacement))
        if not plain or isinstance(data.dataset, IterableDataset):
            raise TypeError(
                "live recovery across replica groups reads each step's global batch by index, "
                "so it needs a DataLoader over a map-style dataset with batch_size= and "
                "shuffle=True/False (no custom sampler). HINT: pass the Dataset with "
                "batch_size=GLOBAL_BATCH")
        batch_size = data.batch_size if batch_size is None else batch_size
        shuffle = isinstance(sampler, RandomSampler) if shuffle is None else shuffle
        drop_remainder = data.drop_last if drop_remainder is None else drop_remainder
        collate = data.collate_fn
        data = data.dataset
    elif not isinstance(data, Dataset) or isinstance(data, IterableDataset) \
            or not hasattr(data, "__len__"):
        raise TypeError(
            f"live recovery across replica groups reads each step's global batch by index, so "
            f"it needs a map-style Dataset (with __len__ and __getitem__) or a DataLoader over "
            f"one, got {type(data).__name__}")
    if batch_size is None:
        raise ValueError("distribute_dataset(dataset) needs batch_size=GLOBAL_BATCH, or a "
                         "DataLoader built with the global batch size")
    return MapInput(data, int(batch_size), bool(shuffle), bool(drop_remainder), collate)


__all__ = ["Share", "StepSplit", "MapInput", "map_input"]
