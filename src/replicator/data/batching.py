"""Where a batch is split: the global order of an epoch, shuffling, and cutting each global
batch into per-replica batches.

* Order: the global order of sample indices depends only on the seed and the epoch
  (:func:`global_order`), so one replica with batch B and N replicas with B/N each see the same
  global batches, step by step. Streams are shuffled by a seeded buffer (:func:`buffer_shuffle`)
  and files by a seeded permutation (:func:`shuffled`), all pure functions of (seed, epoch,
  stream identity), so every replica reading the same stream gets the same order, and a restart
  that replays it gets it again.
* Split: replica ``r`` takes the ``r``-th contiguous slice of each global batch
  (:func:`replica_part`, :func:`slice_bounds`). The last global batch of an epoch may be short
  (``L < B`` samples). With ``drop_remainder`` it is dropped on every replica; otherwise it is
  split as evenly as possible and a replica whose slice is empty gets, by ``partial_batch``,
  one masked copy of a sample (``"mask"``, the default: every replica's step sees at least one
  row) or a batch of 0 rows (``"empty"``, tf.distribute's behaviour).
* Rows: a collated batch's rows are along dimension 0 of every tensor (a list of plain values
  such as ``default_collate`` makes of strings counts as one row per value); :func:`slice_rows`
  and :func:`pad_rows` take a replica's slice of a collated global batch and pad a short batch
  with copies of its first row.
* Assembly: a :class:`Spec` is what a plan decides per step (which samples, which rows); it is
  small and picklable, so process workers can receive it. :class:`Materialiser` reads each
  sample (``dataset[i]`` for a map-style dataset, the element itself for a stream), applies the
  per-sample ``transform`` (in parallel through ``mapper``), collates, takes this replica's
  rows, pads, and the result's mask marks real rows 1 and padding 0.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import torch
from torch.utils.data import Sampler, default_collate

T = TypeVar("T")


# -- order: seeded shuffles and the global order of an epoch -----------------------------------
def derived_seed(seed: int, epoch: int, *parts: int) -> int:
    """A seed for one epoch of one stream (deterministic, independent of ``PYTHONHASHSEED``)."""
    value = (seed * 1_000_003 + epoch) & 0xFFFF_FFFF_FFFF
    for part in parts:
        value = (value * 1_000_033 + part + 1) & 0xFFFF_FFFF_FFFF
    return value


def shuffled(items: list[T], seed: int) -> list[T]:
    """A seeded permutation of ``items`` (a new list)."""
    out = list(items)
    random.Random(seed).shuffle(out)
    return out


def buffer_shuffle(stream: Iterable[Any], buffer_size: int, seed: int) -> Iterator[Any]:
    """Shuffle a stream through a buffer of ``buffer_size`` elements (tf.data's ``shuffle``):
    each output is a random element of the buffer, replaced by the next input."""
    rng = random.Random(seed)
    buffer: list[Any] = []
    for item in stream:
        if len(buffer) < buffer_size:
            buffer.append(item)
            continue
        j = rng.randrange(buffer_size)
        buffer[j], item = item, buffer[j]
        yield item
    rng.shuffle(buffer)
    yield from buffer


def global_order(num_samples: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """Indices of one epoch in global order (a seeded permutation, or 0..n-1)."""
    if not shuffle:
        return list(range(num_samples))
    gen = torch.Generator()
    gen.manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=gen).tolist()


# -- split: each replica's part of a global batch ----------------------------------------------
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


#: How a replica with no sample of a short last batch is served: one masked copy of a sample
#: (every step sees a row), or a batch of 0 rows (tf.distribute's behaviour).
PARTIAL_BATCH_MODES = ("mask", "empty")


def check_partial_batch(mode: object, pad_last_batch: bool = False) -> str:
    """Validate ``partial_batch=``; a clear error for an unknown mode or a contradiction."""
    if mode not in PARTIAL_BATCH_MODES:
        raise ValueError(
            f"partial_batch must be 'mask' (a replica left without a sample of the last "
            f"batch gets one masked copy of a sample, mask 0; the default) or 'empty' (it "
            f"gets a batch of 0 rows, as tf.distribute gives), got {mode!r}")
    if mode == "empty" and pad_last_batch:
        raise ValueError(
            "partial_batch='empty' gives a replica without a sample 0 rows, but "
            "InputOptions(pad_last_batch=True) pads every replica to the full per-replica "
            "batch; choose one of them")
    return str(mode)


def replica_part(length: int, global_batch_size: int, rank: int, world: int, *,
                 drop_remainder: bool, pad_last_batch: bool,
                 empty_part: bool = False) -> Part | None:
    """Which positions of a global batch of ``length`` replica ``rank`` takes (``None``: the
    batch is dropped). See the module doc for the rule on a short last batch;
    ``empty_part``: a replica without a sample gets 0 rows (``partial_batch="empty"``)."""
    full = length >= global_batch_size
    if not full and drop_remainder:
        return None
    start, stop = slice_bounds(length, rank, world)
    real = stop - start
    per_replica = global_batch_size // world
    size = per_replica if (full or pad_last_batch) else (
        real if empty_part else max(real, 1))
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


# -- rows of a collated batch ------------------------------------------------------------------
def _is_row_list(value: Any) -> bool:
    return isinstance(value, list) and not any(
        isinstance(v, (torch.Tensor, list, tuple, Mapping)) or hasattr(v, "shape") for v in value)


def _map_leaves(batch: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(batch, torch.Tensor) or _is_row_list(batch) or (
            hasattr(batch, "shape") and hasattr(batch, "__getitem__")):
        return fn(batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_map_leaves(b, fn) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map_leaves(b, fn) for b in batch)
    if isinstance(batch, Mapping):
        return type(batch)({k: _map_leaves(v, fn) for k, v in batch.items()})  # type: ignore[call-arg]
    return batch


def batch_rows(batch: Any) -> int | None:
    """The number of rows of a batch (dim 0 of its first tensor), ``None`` if it has none."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    if _is_row_list(batch):
        return len(batch)
    if hasattr(batch, "shape") and hasattr(batch, "__getitem__") and len(batch.shape):
        return int(batch.shape[0])
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            rows = batch_rows(item)
            if rows is not None:
                return rows
    return None


def slice_rows(batch: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of every leaf."""
    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() == 0:
            return leaf
        return leaf[start:stop]
    return _map_leaves(batch, cut)


def pad_rows(batch: Any, size: int) -> Any:
    """Append copies of row 0 until every leaf has ``size`` rows (masked padding)."""
    def pad(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0 or leaf.shape[0] >= size:
                return leaf
            if leaf.shape[0] == 0:
                raise ValueError("cannot pad an empty batch: it has no row to copy")
            extra = leaf[:1].expand(size - leaf.shape[0], *leaf.shape[1:])
            return torch.cat([leaf, extra])
        if isinstance(leaf, list):
            return leaf + [leaf[0]] * (size - len(leaf)) if leaf else leaf
        if hasattr(leaf, "shape") and len(leaf.shape) and leaf.shape[0] < size:
            import numpy as np

            return np.concatenate([leaf] + [leaf[:1]] * (size - leaf.shape[0]))
        return leaf
    return _map_leaves(batch, pad)


def repeat_first_row(batch: Any, size: int) -> Any:
    """A batch of ``size`` copies of row 0 (a fully masked batch for a replica out of data);
    ``size`` 0 gives the batch's structure with 0 rows (``partial_batch="empty"``)."""
    return pad_rows(slice_rows(batch, 0, min(size, 1)), size)


# -- assembly: a step's spec becomes a batch and its mask --------------------------------------
class Spec(NamedTuple):
    """One step of one replica: what to load and which rows to keep."""

    items: tuple          # dataset indices, stream elements, or (collated batch,)
    rows: tuple[int, int] | None  # keep rows[0]:rows[1] of the collated batch (None: all)
    real: int             # how many of the kept rows are real samples (the rest are padding)
    size: int             # rows of the result (real + masked padding)
    full: bool            # a full per-replica batch (drop mode stops before non-full ones)
    position: int         # the plan's position after this step
    length: int = 0       # rows of the global batch this part is cut from (0: not known,
    #                       per-replica pipelines)


class LocalBatch(NamedTuple):
    """A materialised step: the batch, its per-sample mask (1 real, 0 padding; built in the
    main process from the row count, so workers send one tensor less) and where the plan
    stands after it."""

    batch: Any
    mask: torch.Tensor | int  # the row count until the device stage makes the mask tensor
    real: int
    full: bool
    position: int
    length: int = 0  # rows of the global batch (0: not known), see Spec


def make_mask(real: int, size: int) -> torch.Tensor:
    """``[1.0] * real + [0.0] * (size - real)`` as a float32 tensor."""
    mask = torch.zeros(size, dtype=torch.float32)
    mask[:real] = 1.0
    return mask


@dataclass
class Materialiser:
    """Loads, transforms and collates the samples of a :class:`Spec` (picklable when its
    parts are, so process workers can run it)."""

    dataset: Any = None                      # map-style: items are indices into it
    transform: Callable[[Any], Any] | None = None
    collate: Callable[[list[Any]], Any] | None = None
    collated: bool = False                   # items is (an already collated batch,)

    def load(self, item: Any) -> Any:
        sample = self.dataset[item] if self.dataset is not None else item
        return self.transform(sample) if self.transform is not None else sample

    def __call__(self, spec: Spec,
                 mapper: Callable[[Callable[[Any], Any], Iterable[Any]], Iterator[Any]] = map
                 ) -> LocalBatch:
        samples = list(spec.items) if self.collated else list(mapper(self.load, spec.items))
        return self.assemble(spec, samples)

    def assemble(self, spec: Spec, samples: list[Any]) -> LocalBatch:
        """Collate loaded samples, keep this replica's rows, pad, and build the mask."""
        if self.collated:
            batch = samples[0]
        else:
            collate = self.collate if self.collate is not None else default_collate
            batch = collate(samples)
        if spec.rows is not None:
            batch = slice_rows(batch, *spec.rows)
        rows = batch_rows(batch)
        if rows is not None and spec.real == 0:
            batch = repeat_first_row(batch, spec.size)
        elif rows is not None and rows < spec.size:
            batch = pad_rows(batch, spec.size)
        size = spec.size if rows is not None else spec.real
        return LocalBatch(batch, max(size, spec.real), spec.real, spec.full, spec.position,
                          spec.length)
