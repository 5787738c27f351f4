"""``rp.data.Dataset``: an input pipeline in tf.data's vocabulary that is also a plain PyTorch
``IterableDataset``.

Each operator returns a new dataset; nothing runs until it is iterated. Iterating runs the
rest of the current epoch (from a saved position, after ``load_state_dict``), then moves to the
next one, so ``for epoch in range(E): for batch in ds: ...`` sees epoch 0, 1, ... Every
``shuffle`` draws its order from its seed, the epoch and the pass (see ``graph``), so the order
of an epoch is a function of the seed and the epoch only, whatever the workers.
``strategy.distribute_dataset(ds)`` splits its global batches across replicas (see
``distribute``).
"""

from __future__ import annotations

import os
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from replicator.data.dataflow import ops, sources
from replicator.data.dataflow.cache import Cache
from replicator.data.dataflow.graph import INFINITE, UNKNOWN, Ctx, Node, Runtime
from replicator.data.dataflow.options import (
    AUTOTUNE,
    Options,
    check_on_error,
    check_parallel,
)

STATE_FORMAT = "replicator.dataflow"
_END = object()
#: The pipelines of this process that have run (a runtime), and the last stats of those that
#: are gone: what ``running_stats`` reports.
_RUNNING: weakref.WeakSet[Dataset] = weakref.WeakSet()
_FINISHED: deque[dict[str, Any]] = deque(maxlen=8)


def running_stats() -> list[dict[str, Any]]:
    """``stats()`` of every pipeline of this process that has run: those that still exist,
    then the last ones collected (the bench reads them from a script it ran, whose pipelines
    may be gone by then)."""
    return [ds.stats() for ds in list(_RUNNING)] + list(_FINISHED)


def _stats(description: str, options: Options, rt: Runtime) -> dict[str, Any]:
    return {"pipeline": description, "cpu_budget": options.cpus, "ram_budget": options.ram,
            "input_wait_s": rt.input_wait_s,
            "stages": {name: t.stats() for name, t in rt.tuners.items()},
            "counters": dict(rt.counters)}


def _finish(description: str, options: Options, rt: Runtime) -> None:
    """A pipeline was collected: keep its last stats, stop its workers."""
    _FINISHED.append(_stats(description, options, rt))
    rt.close()


def _count(value: object, what: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{what} must be an integer >= {low}, got {value!r}")
    return value


class Dataset(IterableDataset):
    """A dataflow pipeline (build it with the ``from_*`` constructors, then chain operators)."""

    def __init__(self, node: Node, options: Options | None = None) -> None:
        self._node = node
        self.options = options or Options()
        self._lowered: Node | None = None
        self._runtime: Runtime | None = None
        self._epoch = 0
        self._position = 0
        self._active: Iterator[Any] | None = None

    # -- sources --------------------------------------------------------------------------------
    @staticmethod
    def from_tensor_slices(tensors: Any) -> Dataset:
        """Element ``i`` is row ``i`` of each component (a tensor, array or list, or tuples
        and dicts of them), as ``tf.data.Dataset.from_tensor_slices``."""
        return Dataset(sources.SliceSource(tensors))

    @staticmethod
    def from_dataset(dataset: Any, num_parallel_calls: int = AUTOTUNE) -> Dataset:
        """A map-style dataset: element ``i`` is ``dataset[i]``, loaded in parallel workers."""
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise TypeError(f"from_dataset needs a map-style dataset (with __getitem__ and "
                            f"__len__), got {type(dataset).__name__}. HINT: for a stream use "
                            "from_generator(lambda: iter(stream))")
        return Dataset(sources.RangeSource(len(dataset))).map(
            sources.GetItem(dataset), num_parallel_calls=num_parallel_calls)

    @staticmethod
    def from_generator(fn: Callable[..., Iterable[Any]], args: Sequence[Any] = ()) -> Dataset:
        """``fn(*args)`` is called at each pass; its iterator gives the elements."""
        return Dataset(sources.GeneratorSource(fn, tuple(args)))

    @staticmethod
    def list_files(pattern_or_urls: str | Sequence[str], shuffle: bool = False,
                   seed: int = 0) -> Dataset:
        """The files matching a glob pattern (local or an fsspec URL such as
        ``s3://bucket/train-*.tar``), or the list given, sorted; ``shuffle=True``: in a seeded
        order per epoch."""
        from replicator.data.dataflow.shards import expand_urls

        return Dataset(sources.ListSource(expand_urls(pattern_or_urls), shuffle, seed))

    @staticmethod
    def from_shards(urls: str | Sequence[str] | Dataset, *, on_error: str = "raise",
                    cache_dir: str | None = None, cache_limit_bytes: int | None = None,
                    prefetch_shards: int = 2) -> Dataset:
        """Samples of WebDataset-layout tar shards (see ``shards``): each a dict of the
        members' extensions to their bytes, with ``"__key__"`` and ``"__url__"``."""
        from replicator.data.dataflow.shards import ShardSource

        source = urls.lowered() if isinstance(urls, Dataset) else urls
        return Dataset(ShardSource(source, on_error=check_on_error(
            on_error), cache_dir=cache_dir, cache_limit_bytes=cache_limit_bytes,
            prefetch_shards=_count(prefetch_shards, "prefetch_shards")))

    # -- operators ------------------------------------------------------------------------------
    def _then(self, node: Node) -> Dataset:
        return Dataset(node, self.options)

    def map(self, fn: Callable[[Any], Any], num_parallel_calls: int | None = AUTOTUNE,
            deterministic: bool = True, on_error: str = "raise") -> Dataset:
        """``fn`` on every element, in ``num_parallel_calls`` workers (``AUTOTUNE``: tuned;
        ``None``: in the consumer's thread). ``on_error="skip"``: a failing element is left out,
        counted in ``stats()`` and logged once."""
        if not callable(fn):
            raise TypeError(f"map needs a function, got {type(fn).__name__}")
        return self._then(ops.Map(self._node, fn, check_parallel(num_parallel_calls, "map's "
                                  "num_parallel_calls"), bool(deterministic),
                                  check_on_error(on_error)))

    def filter(self, predicate: Callable[[Any], Any]) -> Dataset:
        """Only the elements for which ``predicate`` is true."""
        if not callable(predicate):
            raise TypeError(f"filter needs a function, got {type(predicate).__name__}")
        return self._then(ops.Filter(self._node, predicate))

    def shuffle(self, buffer_size: int, seed: int | None = None) -> Dataset:
        """Shuffle through a buffer of ``buffer_size`` elements; the order is a function of
        ``seed`` (default ``Options.seed``), the epoch and the pass only."""
        return self._then(ops.Shuffle(self._node, _count(buffer_size, "buffer_size", 1), seed))

    def repeat(self, count: int | None = None) -> Dataset:
        """The input ``count`` times (``None``: forever), each pass shuffled anew."""
        if count is not None:
            _count(count, "repeat's count")
        return self._then(ops.Repeat(self._node, count))

    def batch(self, batch_size: int, drop_remainder: bool = False,
              collate_fn: Callable[[list[Any]], Any] | None = None) -> Dataset:
        """Groups of ``batch_size`` elements, collated (``default_collate`` unless given)."""
        return self._then(ops.Batch(self._node, _count(batch_size, "batch_size", 1),
                                    bool(drop_remainder), collate_fn))

    def cache(self, filename: str | os.PathLike[str] | None = None) -> Dataset:
        """Keep the elements of the first complete pass in memory (or in ``filename``) and
        replay them in later passes."""
        return self._then(Cache(self._node, filename))

    def prefetch(self, buffer_size: int = AUTOTUNE) -> Dataset:
        """A background thread keeps ``buffer_size`` elements ready (``AUTOTUNE``: tuned)."""
        return self._then(ops.Prefetch(self._node, check_parallel(buffer_size,
                                                                  "prefetch's buffer_size")))

    def take(self, count: int) -> Dataset:
        """The first ``count`` elements (``-1``: all)."""
        if count != -1:
            _count(count, "take's count")
        return self._then(ops.Take(self._node, count))

    def skip(self, count: int) -> Dataset:
        """All but the first ``count`` elements."""
        return self._then(ops.Skip(self._node, _count(count, "skip's count")))

    def shard(self, num_shards: int, index: int) -> Dataset:
        """Every ``num_shards``-th element from ``index`` on: one replica's share in an
        ``input_fn`` of ``distribute_datasets_from_function``."""
        n = _count(num_shards, "num_shards", 1)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n:
            raise ValueError(f"shard index {index!r} is outside 0..{n - 1}")
        return self._then(ops.Shard(self._node, n, index))

    def interleave(self, fn: Callable[[Any], Any], cycle_length: int = 4,
                   block_length: int = 1, num_parallel_calls: int | None = None) -> Dataset:
        """``fn(element)`` gives a dataset (or iterable) per input element; ``cycle_length`` of
        them are read at once, ``block_length`` elements from each in turn."""
        parallel = check_parallel(num_parallel_calls, "interleave's num_parallel_calls")
        return self._then(ops.Interleave(self._node, fn, _count(cycle_length, "cycle_length", 1),
                                         _count(block_length, "block_length", 1), parallel))

    def with_options(self, options: Options) -> Dataset:
        """The same pipeline with ``options`` (set fields win over this dataset's)."""
        if not isinstance(options, Options):
            raise TypeError(f"with_options takes rp.data.Options, got {type(options).__name__}")
        return Dataset(self._node, self.options.merge(options))

    # -- iteration ------------------------------------------------------------------------------
    def lowered(self) -> Node:
        if self._lowered is None:
            self._lowered = ops.lower(self._node)
        return self._lowered

    @property
    def runtime(self) -> Runtime:
        if self._runtime is None:
            self._runtime = Runtime(self.options)
            weakref.finalize(self, _finish, self.describe(), self.options, self._runtime)
            _RUNNING.add(self)
        return self._runtime

    def __iter__(self) -> Iterator[Any]:
        if self._active is not None:
            close = getattr(self._active, "close", None)
            if close is not None:
                close()
        self._active = self._pass(self._epoch, self._position)
        return self._active

    def _pass(self, epoch: int, position: int) -> Iterator[Any]:
        info = get_worker_info()
        if info is not None and info.num_workers > 1:
            raise TypeError(
                f"an rp.data.Dataset read by a DataLoader with num_workers={info.num_workers} "
                "would give every sample once per worker; it runs its own workers. HINT: "
                "iterate it directly, or use DataLoader(ds, batch_size=None, num_workers=0)")
        runtime = self.runtime
        source = iter(self.lowered().iterate(Ctx(epoch, runtime), position))
        try:
            while True:
                start = time.perf_counter()
                element = next(source, _END)
                runtime.waited(time.perf_counter() - start)
                if element is _END:
                    break
                self._position += 1
                yield element
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()
        self._epoch, self._position = epoch + 1, 0

    def cardinality(self) -> int:
        """Elements of one epoch: a count, ``rp.data.INFINITE`` (-1) or ``UNKNOWN`` (-2)."""
        return self.lowered().cardinality()

    def __len__(self) -> int:
        n = self.cardinality()
        if n < 0:
            raise TypeError(f"this dataset's length is {'infinite' if n == INFINITE else 'unknown'}"
                            " (known only by reading it)")
        return n

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def input_wait_seconds(self) -> float:
        """Seconds its consumer (the training loop) spent waiting for the next element."""
        return self.runtime.input_wait_s

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning at the next iteration."""
        self._epoch, self._position = _count(epoch, "epoch"), 0

    # -- state and stats -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position (epoch, elements handed out in it) as JSON data."""
        return {"format": STATE_FORMAT, "epoch": self._epoch, "position": self._position,
                "seed": self.options.seed, "pipeline": self.describe()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next element is the one that was next."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError("load_state_dict needs a state from rp.data.Dataset.state_dict()")
        if state.get("pipeline") != self.describe():
            raise ValueError(f"the state was saved by the pipeline {state.get('pipeline')!r}, "
                             f"this one is {self.describe()!r}. HINT: build the same pipeline")
        self._epoch = _count(state["epoch"], "epoch")
        self._position = _count(state["position"], "position")

    def describe(self) -> str:
        """The operators, source first, as they run (after fusion)."""
        return " -> ".join(n.describe() for n in self.lowered().chain())

    def stats(self) -> dict[str, Any]:
        """What the pipeline chose and measured: per parallel stage its parallelism, depth,
        mean task time and the share of time its consumer waited; the budgets; the seconds
        the training loop waited for input (``input_wait_s``); counters (skipped samples and
        shards, shard fetches, cache hits)."""
        return _stats(self.describe(), self.options, self.runtime)

    def close(self) -> None:
        """Stop the workers (iterating again starts new ones)."""
        if self._runtime is not None:
            self._runtime.close()
            self._runtime = None

    def __repr__(self) -> str:
        return f"rp.data.Dataset({self.describe()})"


__all__ = ["Dataset", "INFINITE", "UNKNOWN", "running_stats"]
