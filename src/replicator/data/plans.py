"""Plans: which samples each step of one replica gets, epoch by epoch, from any position.

A plan yields :class:`~replicator.data.materialise.Spec` objects for ``(epoch, position)``,
so a pipeline can start mid-epoch exactly where a saved state left off. The position is in
the plan's own unit (``position_unit``): samples of the global order for global-batch plans
(so it survives a change of the number of replicas or of the batch size), steps otherwise.

``known_end`` plans end their epochs at the same step on every replica by construction (every
replica knows the global order and its length), so they need no collective. Plans whose
replicas read different streams (FILE shards, ``input_fn`` pipelines) agree on the end at run
time (see ``distributed_iterator``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any, ClassVar

from replicator.data.batch_rows import batch_rows
from replicator.data.global_batch import global_order, replica_part, slice_bounds
from replicator.data.materialise import Spec
from replicator.data.shuffle_buffer import buffer_shuffle, derived_seed


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
           drop_remainder: bool, pad_last_batch: bool, load_all: bool) -> Spec | None:
    """The spec of this replica's part of one global batch (``None``: dropped)."""
    part = replica_part(len(items), global_batch_size, rank, world,
                        drop_remainder=drop_remainder, pad_last_batch=pad_last_batch)
    if part is None:
        return None
    real = part.stop - part.start
    if load_all:
        rows = (part.start, part.stop) if real else (0, 1)
        return Spec(tuple(items), rows, real, part.size, part.full, position + len(items))
    mine = tuple(items[part.start:part.stop]) if real else (items[0],)
    return Spec(mine, None, real, part.size, part.full, position + len(items))


class GlobalSplitPlan(Plan):
    """Common settings of the plans that split global batches."""

    def __init__(self, global_batch_size: int, rank: int, world: int, *, shuffle: bool,
                 seed: int, drop_remainder: bool, pad_last_batch: bool, load_all: bool) -> None:
        self.global_batch_size = global_batch_size
        self.rank, self.world = rank, world
        self.shuffle, self.seed = shuffle, seed
        self.drop_remainder, self.pad_last_batch = drop_remainder, pad_last_batch
        self.load_all = load_all

    def describe(self) -> str:
        how = "OFF: whole global batches loaded" if self.load_all else "DATA sharding"
        return (f"{self.kind}, global batches of {self.global_batch_size} over {self.world} "
                f"replicas, {how}")

    def _split(self, items: list[Any], position: int) -> Spec | None:
        return _split(items, position, self.global_batch_size, self.rank, self.world,
                      self.drop_remainder, self.pad_last_batch, self.load_all)


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

    def specs(self, epoch: int, position: int) -> Iterator[Spec]:
        stream = self.stream(epoch)
        if sum(1 for _ in islice(stream, position)) < position:
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


def set_epoch_on(loader: Any, epoch: int) -> None:
    """Call ``set_epoch`` on a loader, or on its sampler / batch sampler, where it exists."""
    for obj in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        if callable(getattr(obj, "set_epoch", None)):
            obj.set_epoch(epoch)
            return


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
                 world: int, *, drop_remainder: bool, pad_last_batch: bool) -> None:
        self.loader = loader
        self.global_batch_size = global_batch_size
        self.rank, self.world = rank, world
        self.drop_remainder, self.pad_last_batch = drop_remainder, pad_last_batch

    def specs(self, epoch: int, position: int) -> Iterator[Spec]:
        set_epoch_on(self.loader, epoch)
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
                yield Spec((batch,), (start, stop) if real else (0, 1), real, max(real, 1),
                           True, step)
                continue
            spec = _split([None] * rows, 0, size, self.rank, self.world,
                          self.drop_remainder, self.pad_last_batch, True)
            if spec is None:
                return
            yield Spec((batch,), spec.rows, spec.real, spec.size, spec.full, step)

    def describe(self) -> str:
        return f"{self.kind}, each replica splits the batches of {type(self.loader).__name__}"

    def steps_per_epoch(self) -> int | None:
        try:
            return len(self.loader)  # type: ignore[arg-type]
        except TypeError:
            return None


class PerReplicaPlan(Plan):
    """An ``input_fn`` pipeline: the user's iterable already yields this replica's batches.
    Position: steps."""

    kind = "per_replica"
    known_end = False
    element_level = False
    position_unit = "steps"

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader

    def specs(self, epoch: int, position: int) -> Iterator[Spec]:
        set_epoch_on(self.loader, epoch)
        batches = iter(self.loader)
        if not _skip(batches, position):
            return
        for step, batch in enumerate(batches, start=position + 1):
            rows = batch_rows(batch)
            rows = 1 if rows is None else rows
            yield Spec((batch,), None, rows, rows, True, step)

    def describe(self) -> str:
        return f"{self.kind}, batches of the input_fn's {type(self.loader).__name__}"

    def template_spec(self, epoch: int) -> Spec | None:
        set_epoch_on(self.loader, epoch)
        for batch in self.loader:
            rows = batch_rows(batch) or 1
            return Spec((batch,), None, 0, rows, True, 0)
        return None
