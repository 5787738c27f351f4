"""Which samples each replica reads, step by step: one plan per way of sharding the input.

A plan yields :class:`~replicator.data.batching.Spec` objects for ``(epoch, position)``, so a
pipeline can start mid-epoch exactly where a saved state left off. The position is in the
plan's own unit (``position_unit``): samples of the global order for global-batch plans (so it
survives a change of the number of replicas or of the batch size), steps otherwise.

* DATA / OFF: :class:`IndexPlan` (a map-style dataset) and :class:`StreamPlan` (a stream, or
  files read by every replica) split every global batch across replicas (see ``batching``);
  :class:`LoaderPlan` runs a user loader whose global batches cannot be rebuilt sample by
  sample, and keeps this replica's rows. :class:`PerReplicaPlan` runs an ``input_fn``
  pipeline, which already yields this replica's batches; :func:`shard` is the ``input_fn``
  user's way to take a share of a dataset.
* FILE: :class:`FileShardPlan`: each replica reads its own files of a :class:`FileDataset`,
  and resumes exactly, even on another world. In epoch ``e`` the files are put in a seeded
  order (when shuffling); shard ``r`` of ``N`` is files ``r, r + N, r + 2N, ...`` of that order,
  read one after the other and, when shuffling, mixed by a seeded shuffle buffer. Replica ``r``
  reads shard ``r`` in per-replica batches of ``B / N``.

``known_end`` plans end their epochs at the same step on every replica by construction (every
replica knows the global order and its length), so they need no collective. Plans whose
replicas read different streams (FILE shards, ``input_fn`` pipelines) agree on the end at run
time (see ``agreement``).

FILE resume: all replicas take one step per step, so the position is one number of steps, and
shard ``r`` has given ``min(steps * B/N, len(shard r))`` samples. A restart with another
number of replicas ``M`` finishes the interrupted epoch on the *original* shards: shard ``r``
continues on replica ``r % M`` (a replica may carry several shards one after the other, or
none). Each such change adds a *phase* ``[world, per_replica_batch, steps]`` to the state; the
offsets into the shards are recomputed from the phases (counting the samples of a shard where
a replica carried several). The next epoch uses the new number of replicas from its start.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain, islice
from typing import Any, ClassVar

import torch
from torch.utils.data import Dataset, IterableDataset, Subset

from replicator.data.batching import (
    Spec,
    batch_rows,
    buffer_shuffle,
    derived_seed,
    global_order,
    replica_part,
    shuffled,
    slice_bounds,
)
from replicator.data.errors import EmptyShardError, InputPipelineError

# -- files and shard() -------------------------------------------------------------------------
FileReader = Callable[[str], Iterable[Any]]


class FileDataset(IterableDataset):
    """The samples of ``files``, read one file after the other by ``reader(path)``.

    ``reader`` returns (or yields) the samples of one file. Under ``AutoShardPolicy.FILE``
    each replica reads only its own files; under ``DATA`` every replica reads them all.
    It is also a plain ``IterableDataset`` (iterating it reads every file in order).
    """

    def __init__(self, files: Sequence[str | os.PathLike[str]], reader: FileReader) -> None:
        if isinstance(files, (str, bytes, os.PathLike)):
            raise TypeError("FileDataset takes a list of files, got a single path. HINT: "
                            "write FileDataset([path], reader)")
        self.files = [os.fspath(f) for f in files]
        if not self.files:
            raise ValueError("FileDataset needs at least one file, got an empty list")
        if not callable(reader):
            raise TypeError(f"FileDataset needs a reader function reader(path) -> samples, got "
                            f"{type(reader).__name__}")
        self.reader = reader

    def read(self, path: str) -> Iterator[Any]:
        """The samples of one file, with the file named in any error."""
        try:
            yield from self.reader(path)
        except Exception as exc:
            name = getattr(self.reader, "__name__", "the reader")
            raise InputPipelineError(f"reading {path!r} with {name} failed: "
                                     f"{type(exc).__name__}: {exc}") from exc

    def __iter__(self) -> Iterator[Any]:
        for path in self.files:
            yield from self.read(path)

    @property
    def num_files(self) -> int:
        """How many files (the number of samples is known only by reading them)."""
        return len(self.files)

    def __repr__(self) -> str:
        name = getattr(self.reader, "__name__", "?")
        return f"FileDataset({len(self.files)} files, reader={name})"


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


# -- plans: DATA and OFF (global batches split across replicas) --------------------------------
class Plan(ABC):
    """The per-replica schedule of one input pipeline."""

    kind: ClassVar[str]
    known_end: ClassVar[bool] = True
    element_level: ClassVar[bool] = True   # specs name samples (workers can load them)
    position_unit: ClassVar[str] = "samples"

    @abstractmethod
    def specs(self, epoch: int, position: int) -> Iterator[Spec]:
        """This replica's steps of ``epoch`` from ``position`` on."""

    def steps_per_epoch(self) -> int | None:
        """Steps of a whole epoch when known without reading, else ``None``."""
        return None

    def template_spec(self, epoch: int) -> Spec | None:
        """A one-sample spec to build a fully masked batch from, for a replica that has had no
        batch of its own yet (``None``: not needed, or not possible)."""
        return None

    def state(self, epoch: int, position: int) -> dict[str, Any]:
        """Extra JSON-serialisable state (beyond epoch and position)."""
        return {}

    def load_state(self, state: dict[str, Any], epoch: int, position: int) -> int:
        """Restore what :meth:`state` returned; returns the position to continue from."""
        return position

    def fresh(self, epoch: int, position: int) -> bool:
        """True at the very start of an epoch (not a resumed one): an empty replica there
        means an empty shard."""
        return position == 0

    def describe(self) -> str:
        return self.kind


def _split(items: list[Any], position: int, global_batch_size: int, rank: int, world: int,
           drop_remainder: bool, pad_last_batch: bool, load_all: bool,
           empty_part: bool = False) -> Spec | None:
    """The spec of this replica's part of one global batch (``None``: dropped)."""
    part = replica_part(len(items), global_batch_size, rank, world,
                        drop_remainder=drop_remainder, pad_last_batch=pad_last_batch,
                        empty_part=empty_part)
    if part is None:
        return None
    real = part.stop - part.start
    if load_all:
        rows = (part.start, part.stop) if real else (0, 1)
        return Spec(tuple(items), rows, real, part.size, part.full, position + len(items),
                    len(items))
    mine = tuple(items[part.start:part.stop]) if real else (items[0],)
    return Spec(mine, None, real, part.size, part.full, position + len(items), len(items))


class GlobalSplitPlan(Plan):
    """Common settings of the plans that split global batches."""

    def __init__(self, global_batch_size: int, rank: int, world: int, *, shuffle: bool,
                 seed: int, drop_remainder: bool, pad_last_batch: bool, load_all: bool,
                 empty_part: bool = False) -> None:
        self.global_batch_size = global_batch_size
        self.rank, self.world = rank, world
        self.shuffle, self.seed = shuffle, seed
        self.drop_remainder, self.pad_last_batch = drop_remainder, pad_last_batch
        self.load_all = load_all
        self.empty_part = empty_part  # partial_batch="empty"

    def describe(self) -> str:
        how = "OFF: whole global batches loaded" if self.load_all else "DATA sharding"
        return (f"{self.kind}, global batches of {self.global_batch_size} over {self.world} "
                f"replicas, {how}")

    def _split(self, items: list[Any], position: int) -> Spec | None:
        return _split(items, position, self.global_batch_size, self.rank, self.world,
                      self.drop_remainder, self.pad_last_batch, self.load_all, self.empty_part)


class IndexPlan(GlobalSplitPlan):
    """A map-style dataset of ``num_samples``: a seeded global order of indices per epoch,
    each global batch split across replicas (DATA: load only this replica's samples; OFF:
    load the whole global batch and keep this replica's rows)."""

    kind = "global_index"

    def __init__(self, num_samples: int, global_batch_size: int, rank: int, world: int,
                 **settings: Any) -> None:
        super().__init__(global_batch_size, rank, world, **settings)
        self.num_samples = num_samples

    def specs(self, epoch: int, position: int) -> Iterator[Spec]:
        order = global_order(self.num_samples, self.shuffle, self.seed, epoch)
        p = position
        while p < self.num_samples:
            spec = self._split(order[p:p + self.global_batch_size], p)
            if spec is None:
                return
            yield spec
            p = spec.position

    def steps_per_epoch(self) -> int | None:
        full, rest = divmod(self.num_samples, self.global_batch_size)
        return full + (1 if rest and not self.drop_remainder else 0)


class StreamPlan(GlobalSplitPlan):
    """A stream (IterableDataset, or files read by every replica) read by every replica in the
    same seeded order; each replica keeps its part of every ``global_batch_size`` elements."""

    kind = "global_stream"

    def __init__(self, open_stream: Callable[[int], Iterable[Any]], global_batch_size: int,
                 rank: int, world: int, *, shuffle_buffer: int, **settings: Any) -> None:
        super().__init__(global_batch_size, rank, world, **settings)
        self.open_stream = open_stream
        self.shuffle_buffer = shuffle_buffer

    def stream(self, epoch: int) -> Iterator[Any]:
        stream = iter(self.open_stream(epoch))
        if self.shuffle:
            stream = buffer_shuffle(stream, self.shuffle_buffer, derived_seed(self.seed, epoch))
        return stream

    def stream_from(self, epoch: int, position: int) -> Iterator[Any] | None:
        """The stream of ``epoch`` after its first ``position`` elements (``None``: it has
        fewer). Read and dropped here; a stream that can skip ahead overrides this."""
        stream = self.stream(epoch)
        if sum(1 for _ in islice(stream, position)) < position:
            return None
        return stream

    def specs(self, epoch: int, position: int) -> Iterator[Spec]:
        stream = self.stream_from(epoch, position)
        if stream is None:
            return
        p = position
        while True:
            items = list(islice(stream, self.global_batch_size))
            if not items:
                return
            spec = self._split(items, p)
            if spec is None:
                return
            yield spec
            p = spec.position
            if len(items) < self.global_batch_size:
                return


# -- plans: a user loader's global batches, and input_fn pipelines -----------------------------
def set_epoch_on(loader: Any, epoch: int) -> None:
    """Call ``set_epoch`` on a loader, or on its sampler / batch sampler, where it exists."""
    for obj in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        set_epoch = getattr(obj, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
            return


def seed_loader(loader: Any, seed: int, epoch: int) -> None:
    """Re-seed a loader's own randomness from ``seed`` and ``epoch``: the ``generator`` of the
    loader (which seeds its workers), its sampler and its batch sampler. An epoch's order is
    then the same in a restarted process, so skipping the batches handed out resumes it."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    holders = (loader, getattr(loader, "sampler", None), batch_sampler,
               getattr(batch_sampler, "sampler", None))
    for k, obj in enumerate(holders):
        if obj is not None and hasattr(obj, "generator"):
            obj.generator = torch.Generator().manual_seed(derived_seed(seed, epoch, k))


def _skip(iterator: Iterator[Any], count: int) -> bool:
    """Consume ``count`` items; False when the iterator ended first."""
    return sum(1 for _ in islice(iterator, count)) == count


class LoaderPlan(Plan):
    """A user loader yielding *global* batches that cannot be rebuilt sample by sample (a
    custom sampler or batch sampler, or ``AutoShardPolicy.OFF`` on an IterableDataset loader):
    every replica runs it and keeps its rows of each batch. Position: global batches."""

    kind = "global_loader"
    element_level = False
    position_unit = "steps"

    def __init__(self, loader: Iterable[Any], global_batch_size: int | None, rank: int,
                 world: int, *, drop_remainder: bool, pad_last_batch: bool,
                 empty_part: bool = False, seed: int = 0) -> None:
        self.loader, self.seed = loader, seed
        self.global_batch_size = global_batch_size
        self.rank, self.world = rank, world
        self.drop_remainder, self.pad_last_batch = drop_remainder, pad_last_batch
        self.empty_part = empty_part  # partial_batch="empty"

    def specs(self, epoch: int, position: int) -> Iterator[Spec]:
        set_epoch_on(self.loader, epoch)
        seed_loader(self.loader, self.seed, epoch)
        batches = iter(self.loader)
        if not _skip(batches, position):
            return
        step = position
        for batch in batches:
            rows = batch_rows(batch)
            if rows is None:
                raise TypeError(f"a batch of type {type(batch).__name__} has no tensor to split "
                                "across replicas. HINT: yield tensors (or tuples/dicts of them)")
            size = self.global_batch_size
            if size is not None and rows > size:
                raise ValueError(f"the loader yielded a batch of {rows} rows, more than the "
                                 f"global batch size {size}")
            step += 1
            if size is None:  # batches of varying size: split each evenly, never drop
                start, stop = slice_bounds(rows, self.rank, self.world)
                real = stop - start
                size = real if self.empty_part else max(real, 1)
                yield Spec((batch,), (start, stop) if real else (0, 1), real, size, True, step,
                           rows)
                continue
            spec = _split([None] * rows, 0, size, self.rank, self.world,
                          self.drop_remainder, self.pad_last_batch, True, self.empty_part)
            if spec is None:
                return
            yield Spec((batch,), spec.rows, spec.real, spec.size, spec.full, step, rows)

    def describe(self) -> str:
        return f"{self.kind}, each replica splits the batches of {type(self.loader).__name__}"

    def steps_per_epoch(self) -> int | None:
        try:
            return len(self.loader)  # type: ignore[arg-type]
        except TypeError:
            return None


class PerReplicaPlan(Plan):
    """An ``input_fn`` pipeline: the user's iterable already yields this replica's batches.
    Position: steps.

    A batch is full when it has the loader's ``batch_size`` rows (a DataLoader's), or, for
    an iterable that declares none, as many rows as the epoch's first batch. With
    ``drop_remainder`` the plan ends before the first short batch, so with the end-of-data
    agreement every replica stops at the first short batch of any replica.
    """

    kind = "per_replica"
    known_end = False
    element_level = False
    position_unit = "steps"

    def __init__(self, loader: Iterable[Any], drop_remainder: bool = False) -> None:
        self.loader = loader
        self.drop_remainder = drop_remainder

    def specs(self, epoch: int, position: int) -> Iterator[Spec]:
        set_epoch_on(self.loader, epoch)
        declared = getattr(self.loader, "batch_size", None)
        expected = declared if isinstance(declared, int) and declared > 0 else None
        for step, batch in enumerate(self.loader, start=1):
            rows = batch_rows(batch)
            rows = 1 if rows is None else rows
            expected = rows if expected is None else expected
            full = rows >= expected
            if step <= position:
                continue  # already used before a restart (read for the reference size)
            if not full and self.drop_remainder:
                return
            yield Spec((batch,), None, rows, rows, full, step)

    def describe(self) -> str:
        return f"{self.kind}, batches of the input_fn's {type(self.loader).__name__}"

    def template_spec(self, epoch: int) -> Spec | None:
        set_epoch_on(self.loader, epoch)
        for batch in self.loader:
            rows = batch_rows(batch) or 1
            return Spec((batch,), None, 0, rows, True, 0)
        return None


# -- plans: FILE shards ------------------------------------------------------------------------
Phase = tuple[int, int, int]  # (world, per-replica batch size, steps)


class FileShardPlan(Plan):
    """Per-replica batches from this replica's files (``AutoShardPolicy.FILE``)."""

    kind = "file_shards"
    known_end = False
    position_unit = "steps"

    def __init__(self, files: FileDataset, global_batch_size: int, rank: int, world: int, *,
                 shuffle: bool, seed: int, shuffle_buffer: int, drop_remainder: bool,
                 pad_last_batch: bool) -> None:
        self.files = files
        self.rank, self.world = rank, world
        self.per_replica = global_batch_size // world
        self.shuffle, self.seed, self.shuffle_buffer = shuffle, seed, shuffle_buffer
        self.drop_remainder, self.pad_last_batch = drop_remainder, pad_last_batch
        self.phases: list[Phase] = []      # earlier phases of epoch ``phases_epoch``
        self.phases_epoch: int | None = None
        self._lengths: dict[tuple[int, int, int], int] = {}

    def describe(self) -> str:
        return f"FILE shards ({len(self.files.files)} files, {self.world} replicas)"

    # -- shards ---------------------------------------------------------------------------------
    def file_order(self, epoch: int) -> list[str]:
        files = self.files.files
        return shuffled(files, derived_seed(self.seed, epoch)) if self.shuffle else list(files)

    def shard_stream(self, epoch: int, shard_world: int, index: int) -> Iterator[Any]:
        paths = self.file_order(epoch)[index::shard_world]
        stream: Iterator[Any] = chain.from_iterable(self.files.read(p) for p in paths)
        if self.shuffle:
            stream = buffer_shuffle(stream, self.shuffle_buffer,
                                    derived_seed(self.seed, epoch, shard_world, index))
        return stream

    def _length(self, epoch: int, shard_world: int, index: int) -> int:
        key = (epoch, shard_world, index)
        if key not in self._lengths:
            self._lengths[key] = sum(1 for _ in self.shard_stream(epoch, shard_world, index))
        return self._lengths[key]

    def _phases(self, epoch: int) -> list[Phase]:
        return self.phases if self.phases_epoch == epoch else []

    def segments(self, epoch: int) -> tuple[int, list[tuple[int, int]]]:
        """``(shard_world, [(shard index, samples already given), ...])`` for this replica."""
        phases = self._phases(epoch)
        if not phases:
            return self.world, [(self.rank, 0)]
        n0 = phases[0][0]
        offsets = [0] * n0
        for world, per_replica, steps in phases:
            for q in range(world):
                left = steps * per_replica
                mine = list(range(q, n0, world))
                for i, r in enumerate(mine):
                    if left <= 0:
                        break
                    if i == len(mine) - 1:  # overshoot past the end is harmless
                        offsets[r] += left
                        break
                    took = min(left, max(0, self._length(epoch, n0, r) - offsets[r]))
                    offsets[r] += took
                    left -= took
        return n0, [(r, offsets[r]) for r in range(self.rank, n0, self.world)]

    # -- plan -----------------------------------------------------------------------------------
    def specs(self, epoch: int, position: int) -> Iterator[Spec]:
        shard_world, segments = self.segments(epoch)
        stream: Iterator[Any] = chain.from_iterable(
            islice(self.shard_stream(epoch, shard_world, r), offset, None)
            for r, offset in segments)
        b = self.per_replica
        if sum(1 for _ in islice(stream, position * b)) < position * b:
            return
        step = position
        while True:
            items = list(islice(stream, b))
            if not items:
                return
            full = len(items) == b
            if not full and self.drop_remainder:
                return
            step += 1
            size = b if (full or self.pad_last_batch) else len(items)
            yield Spec(tuple(items), None, len(items), size, full, step)
            if not full:
                return

    def template_spec(self, epoch: int) -> Spec | None:
        for path in self.file_order(epoch):
            for sample in self.files.read(path):
                return Spec((sample,), None, 0, self.per_replica, True, 0)
        return None

    def fresh(self, epoch: int, position: int) -> bool:
        return position == 0 and not self._phases(epoch)

    def state(self, epoch: int, position: int) -> dict[str, Any]:
        phases = [list(p) for p in self._phases(epoch)]
        return {"phases": phases + [[self.world, self.per_replica, position]]}

    def load_state(self, state: dict[str, Any], epoch: int, position: int) -> int:
        raw = state.get("phases") or []
        try:
            phases = [(int(w), int(b), int(s)) for w, b, s in raw]
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the input state's 'phases' must be a list of [world, batch, "
                             f"steps] triples, got {raw!r}") from exc
        self._lengths.clear()
        self.phases_epoch = epoch
        if phases and phases[-1][:2] == (self.world, self.per_replica):
            self.phases = phases[:-1]   # same layout: continue the last phase
            return phases[-1][2]
        self.phases = phases           # new layout: a new phase starts here
        return 0
