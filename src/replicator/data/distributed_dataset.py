"""DistributedDataset: what ``strategy.distribute_dataset`` returns: each replica's batches.

``distribute_dataset`` takes *global* batches (a ``DataLoader`` with the global batch size, or
a dataset plus ``batch_size=``) and gives each replica its slice, reading only the samples that
replica needs. ``distribute_datasets_from_function`` calls the user's ``input_fn`` once per
process with an :class:`InputContext`; that loader already yields per-replica batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler

from replicator.data.device_transfer import to_device
from replicator.data.global_batch import GlobalBatchSplitSampler, slice_bounds
from replicator.data.input_context import InputContext


class DistributedDataset:
    """Iterate to get this replica's batches, already on the replica's device.

    Each new iteration is a new epoch (reshuffled from the seed when shuffling).
    """

    def __init__(self, loader: Iterable[Any], device: torch.device, *,
                 sampler: GlobalBatchSplitSampler | None = None,
                 slicer: Callable[[Any], Any] | None = None) -> None:
        self.loader = loader
        self.device = device
        self.sampler = sampler
        self.slicer = slicer
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        if self.sampler is not None:
            self.sampler.set_epoch(self.epoch)
        elif hasattr(getattr(self.loader, "sampler", None), "set_epoch"):
            self.loader.sampler.set_epoch(self.epoch)  # type: ignore[union-attr]
        self.epoch += 1
        non_blocking = self.device.type == "cuda"
        for batch in self.loader:
            if self.slicer is not None:
                batch = self.slicer(batch)
            yield to_device(batch, self.device, non_blocking)


def _slice_batch(batch: Any, rank: int, world: int) -> Any:
    if isinstance(batch, torch.Tensor):
        start, stop = slice_bounds(batch.shape[0], rank, world)
        return batch[start:stop]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_slice_batch(b, rank, world) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_slice_batch(b, rank, world) for b in batch)
    if isinstance(batch, dict):
        return {k: _slice_batch(v, rank, world) for k, v in batch.items()}
    return batch


def distribute_dataset(data: DataLoader | Dataset, ctx: InputContext, device: torch.device, *,
                       batch_size: int | None = None, shuffle: bool | None = None,
                       seed: int = 0, drop_last: bool | None = None) -> DistributedDataset:
    """Split global batches across replicas (see module doc)."""
    rank, world = ctx.input_pipeline_id, ctx.num_replicas_in_sync
    loader_kwargs: dict[str, Any] = {}
    if isinstance(data, DataLoader):
        dataset = data.dataset
        if batch_size is None:
            batch_size = data.batch_size
        if batch_size is None:
            raise ValueError("distribute_dataset needs the global batch size: give the "
                             "DataLoader batch_size=GLOBAL_BATCH (not a custom batch_sampler), "
                             "or pass batch_size=")
        if shuffle is None:
            shuffle = isinstance(data.sampler, RandomSampler)
        if drop_last is None:
            drop_last = data.drop_last
        loader_kwargs = dict(collate_fn=data.collate_fn, num_workers=data.num_workers,
                             pin_memory=data.pin_memory, worker_init_fn=data.worker_init_fn,
                             timeout=data.timeout)
        if data.num_workers > 0:
            loader_kwargs["multiprocessing_context"] = data.multiprocessing_context
            loader_kwargs["persistent_workers"] = data.persistent_workers
    elif isinstance(data, Dataset):
        dataset = data
        if batch_size is None:
            raise ValueError("distribute_dataset(dataset) needs batch_size=GLOBAL_BATCH, or "
                             "pass a DataLoader built with the global batch size")
    else:
        raise TypeError(f"distribute_dataset takes a DataLoader or a Dataset, got "
                        f"{type(data).__name__}. HINT: for per-replica input pipelines use "
                        "distribute_datasets_from_function(input_fn).")
    if isinstance(dataset, IterableDataset):
        if batch_size % world:
            raise ValueError(f"global batch size {batch_size} is not divisible by the {world} "
                             "replicas in sync")
        loader = data if isinstance(data, DataLoader) else DataLoader(dataset,
                                                                      batch_size=batch_size)
        return DistributedDataset(loader, device,
                                  slicer=lambda b: _slice_batch(b, rank, world))
    sampler = GlobalBatchSplitSampler(len(dataset), batch_size, rank, world,
                                      shuffle=bool(shuffle), seed=seed,
                                      drop_last=bool(drop_last))
    loader = DataLoader(dataset, batch_sampler=sampler, **loader_kwargs)
    return DistributedDataset(loader, device, sampler=sampler)


def distribute_datasets_from_function(input_fn: Callable[[InputContext], Iterable[Any]],
                                      ctx: InputContext,
                                      device: torch.device) -> DistributedDataset:
    """Build this process's pipeline with ``input_fn(ctx)``; batches are per replica."""
    if not callable(input_fn):
        raise TypeError("distribute_datasets_from_function needs a function input_fn(ctx)")
    loader = input_fn(ctx)
    if not isinstance(loader, Iterable):
        raise TypeError(f"input_fn returned {type(loader).__name__}, which is not iterable; "
                        "return a DataLoader or another iterable of per-replica batches")
    return DistributedDataset(loader, device)
