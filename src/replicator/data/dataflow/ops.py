"""The operators of a dataflow pipeline, and :func:`lower`, which rearranges a pipeline for
speed without changing a single element of its output.

``lower`` moves each deterministic ``map`` that stops on errors below ``shuffle``, ``take``,
``skip`` and ``repeat`` (a buffer shuffle's permutation does not depend on the values, so
shuffling and then mapping gives exactly the elements of mapping and then shuffling), then
fuses the maps directly before a ``batch`` into it: one worker task loads, maps and collates a
whole batch, and hands it back through shared memory at once. So ``ds.map(decode).shuffle(n)``
shuffles the undecoded elements and decodes in the batch task, and a resumed pipeline skips
undecoded elements.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

from replicator.data.batching import buffer_shuffle, derived_seed
from replicator.data.dataflow.graph import INFINITE, UNKNOWN, Ctx, Node, drop
from replicator.data.dataflow.options import AUTOTUNE
from replicator.data.dataflow.work import (
    BatchWork,
    MapChunk,
    default_batch_collate,
    describe_element,
)
from replicator.data.errors import InputTimeoutError

CHUNK = 4  # elements per worker task of an unfused map


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


class Map(Node):
    name = "map"

    def __init__(self, up: Node, fn: Callable[[Any], Any], parallel: int, deterministic: bool,
                 on_error: str) -> None:
        self.inputs = (up,)
        self.fn, self.parallel = fn, parallel
        self.deterministic, self.on_error = deterministic, on_error

    @property
    def pure(self) -> bool:
        """Exactly one output per input, in order: movable and fusable."""
        return self.deterministic and self.on_error == "raise"

    def iterate(self, ctx: Ctx, skip: int = 0) -> Iterator[Any]:
        work = MapChunk((self.fn,), self.on_error)
        up = self.up.iterate(ctx, skip if self.pure else 0)
        deterministic = _deterministic(ctx, self.deterministic)
        if self.parallel == 1:
            out: Iterator[Any] = (y for x in up for y in _report(ctx, work([x])))
        else:
            pool = ctx.runtime.pool(id(self), f"map({_name(self.fn)})", work, self.parallel)
            chunks = iter(lambda: list(islice(up, CHUNK)), [])
            out = (y for r in pool.imap(chunks, deterministic, _describe_chunk)
                   for y in _report(ctx, r))
        return out if self.pure else drop(out, skip)

    def cardinality(self) -> int:
        return self.up.cardinality() if self.pure else UNKNOWN

    def describe(self) -> str:
        return f"map({_name(self.fn)})"


def _deterministic(ctx: Ctx, own: bool) -> bool:
    forced = ctx.runtime.options.deterministic
    return own if forced is None else forced


def _describe_chunk(items: list[Any]) -> str:
    return ", ".join(describe_element(x) for x in items[:3])


def _report(ctx: Ctx, result: tuple[list[Any], list[str]]) -> list[Any]:
    outputs, failures = result
    for failure in failures:
        ctx.runtime.count("skipped_samples")
        ctx.runtime.warn_once("sample", f"skipped a sample that failed: {failure}")
    return outputs


class Filter(Node):
    name = "filter"

    def __init__(self, up: Node, predicate: Callable[[Any], Any]) -> None:
        self.inputs, self.predicate = (up,), predicate

    def iterate(self, ctx: Ctx, skip: int = 0) -> Iterator[Any]:
        return drop((x for x in self.up.iterate(ctx) if self.predicate(x)), skip)


class Shuffle(Node):
    name = "shuffle"

    def __init__(self, up: Node, buffer_size: int, seed: int | None) -> None:
        self.inputs, self.buffer_size, self.seed = (up,), buffer_size, seed

    def iterate(self, ctx: Ctx, skip: int = 0) -> Iterator[Any]:
        seed = self.seed if self.seed is not None else ctx.runtime.options.seed
        return drop(buffer_shuffle(self.up.iterate(ctx), self.buffer_size,
                                   derived_seed(seed, ctx.epoch, *ctx.salt)), skip)

    def cardinality(self) -> int:
        return self.up.cardinality()

    def order_varies(self) -> bool:
        return True


class Repeat(Node):
    name = "repeat"

    def __init__(self, up: Node, count: int | None) -> None:
        self.inputs, self.count = (up,), count

    def iterate(self, ctx: Ctx, skip: int = 0) -> Iterator[Any]:
        size = self.up.cardinality()
        r = 0
        if size > 0 and skip:
            r, skip = divmod(skip, size)
        while self.count is None or r < self.count:
            got = 0
            for x in self.up.iterate(ctx.nested(r), skip):
                got += 1
                yield x
            if got == 0 and size != 0 and skip == 0:
                return  # an empty input repeated forever is empty
            skip = 0
            r += 1

    def cardinality(self) -> int:
        size = self.up.cardinality()
        if self.count is None:
            return 0 if size == 0 else INFINITE
        return size * self.count if size >= 0 else size


class Take(Node):
    name = "take"

    def __init__(self, up: Node, count: int) -> None:
        self.inputs, self.count = (up,), count

    def iterate(self, ctx: Ctx, skip: int = 0) -> Iterator[Any]:
        if self.count >= 0 and skip >= self.count:
            return iter(())
        stop = None if self.count < 0 else self.count - skip
        return islice(self.up.iterate(ctx, skip), stop)

    def cardinality(self) -> int:
        size = self.up.cardinality()
        if self.count < 0 or size == UNKNOWN:
            return size
        return self.count if size == INFINITE else min(size, self.count)


class Skip(Node):
    name = "skip"

    def __init__(self, up: Node, count: int) -> None:
        self.inputs, self.count = (up,), count

    def iterate(self, ctx: Ctx, skip: int = 0) -> Iterator[Any]:
        return self.up.iterate(ctx, self.count + skip)

    def cardinality(self) -> int:
        size = self.up.cardinality()
        return max(0, size - self.count) if size >= 0 else size


class Shard(Node):
    """Every ``num_shards``-th element from ``index`` on (tf.data's ``shard``)."""

    name = "shard"

    def __init__(self, up: Node, num_shards: int, index: int) -> None:
        self.inputs, self.num_shards, self.index = (up,), num_shards, index

    def iterate(self, ctx: Ctx, skip: int = 0) -> Iterator[Any]:
        up = self.up.iterate(ctx, skip * self.num_shards)
        return islice(up, self.index, None, self.num_shards)

    def cardinality(self) -> int:
        size = self.up.cardinality()
        return max(0, -(-(size - self.index) // self.num_shards)) if size >= 0 else size


class Batch(Node):
    """Groups of ``size`` elements, collated; ``maps`` (fused by :func:`lower`) run in the same
    worker task, so a batch crosses from a worker in one hand-over."""

    name = "batch"

    def __init__(self, up: Node, size: int, drop_remainder: bool,
                 collate: Callable[[list[Any]], Any] | None, parallel: int = AUTOTUNE) -> None:
        self.inputs, self.size, self.drop_remainder = (up,), size, drop_remainder
        self.collate, self.parallel = collate, parallel
        self.maps: tuple[Map, ...] = ()

    def work(self) -> BatchWork:
        on_error = "skip" if any(m.on_error == "skip" for m in self.maps) else "raise"
        return BatchWork(tuple(m.fn for m in self.maps), on_error,
                         self.collate or default_batch_collate)

    def iterate(self, ctx: Ctx, skip: int = 0) -> Iterator[Any]:
        up = self.up.iterate(ctx, skip * self.size)
        groups = iter(lambda: list(islice(up, self.size)), [])
        if self.drop_remainder:
            groups = (g for g in groups if len(g) == self.size)
        work = self.work()
        if not self.maps:
            return (_report_batch(ctx, work(g)) for g in groups)
        parallel = min(m.parallel for m in self.maps if m.parallel != AUTOTUNE) \
            if any(m.parallel != AUTOTUNE for m in self.maps) else AUTOTUNE
        deterministic = _deterministic(ctx, all(m.deterministic for m in self.maps))
        pool = ctx.runtime.pool(id(self), self.describe(), work, parallel)
        return (_report_batch(ctx, r) for r in pool.imap(groups, deterministic, _describe_chunk))

    def cardinality(self) -> int:
        size = self.up.cardinality()
        if size < 0 or any(not m.pure for m in self.maps):
            return size if size == INFINITE else UNKNOWN
        return size // self.size if self.drop_remainder else -(-size // self.size)

    def describe(self) -> str:
        inner = "".join(f"map({_name(m.fn)})+" for m in self.maps)
        return f"{inner}batch({self.size})"


def _report_batch(ctx: Ctx, result: tuple[Any, int, list[str]]) -> Any:
    batch, _kept, failures = result
    _report(ctx, ([], failures))
    return batch


class Prefetch(Node):
    """A background thread keeps up to ``depth`` elements ready (``AUTOTUNE``: starts at 2 and
    deepens while the consumer finds the buffer empty, up to 16)."""

    name = "prefetch"

    def __init__(self, up: Node, depth: int) -> None:
        self.inputs, self.depth = (up,), depth

    def iterate(self, ctx: Ctx, skip: int = 0) -> Iterator[Any]:
        return _Prefetcher(self.up.iterate(ctx, skip), self.depth, ctx)

    def cardinality(self) -> int:
        return self.up.cardinality()


_END = object()


class _Prefetcher(Iterator[Any]):
    def __init__(self, source: Iterator[Any], depth: int, ctx: Ctx) -> None:
        self.auto = depth == AUTOTUNE
        self.capacity = 2 if self.auto else depth
        self.timeout = ctx.runtime.options.timeout_seconds
        self.items: queue.Queue[Any] = queue.Queue()
        self.room = threading.Semaphore(self.capacity)
        self.stop = threading.Event()
        self.stats = ctx.runtime.tuner("prefetch", 1)
        self.thread = threading.Thread(target=self._fill, args=(source,), daemon=True,
                                       name="replicator-data-prefetch")
        self.thread.start()

    def _fill(self, source: Iterator[Any]) -> None:
        try:
            for item in source:
                while not self.room.acquire(timeout=0.1):
                    if self.stop.is_set():
                        return
                if self.stop.is_set():
                    return
                self.items.put((True, item))
            self.items.put((True, _END))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            self.items.put((False, exc))
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    def __next__(self) -> Any:
        start = time.perf_counter()
        if self.items.empty() and self.auto and self.capacity < 16:
            self.capacity += 1  # found empty: one deeper
            self.room.release()
            self.stats.depth = self.capacity
        try:
            ok, item = self.items.get(timeout=self.timeout)
        except queue.Empty:
            self.close()
            raise InputTimeoutError(f"prefetch got no element in {self.timeout:.0f} s. "
                                    "HINT: raise Options(timeout_seconds=)") from None
        self.stats.waited(time.perf_counter() - start)
        self.stats.record(0.0, 0)
        if not ok:
            self.close()
            raise item
        if item is _END:
            self.close()
            raise StopIteration
        self.room.release()
        return item

    def close(self) -> None:
        self.stop.set()

    def __del__(self) -> None:
        self.stop.set()


class Interleave(Node):
    """``cycle_length`` inputs open at once, ``block_length`` elements from each in turn; with
    ``num_parallel_calls`` > 1 each open input is read ahead by a thread."""

    name = "interleave"

    def __init__(self, up: Node, fn: Callable[[Any], Any], cycle_length: int, block_length: int,
                 parallel: int) -> None:
        self.inputs, self.fn = (up,), fn
        self.cycle_length, self.block_length, self.parallel = cycle_length, block_length, parallel

    def _open(self, ctx: Ctx, index: int, element: Any) -> Iterator[Any]:
        inner = self.fn(element)
        if callable(getattr(inner, "lowered", None)):  # an rp.data.Dataset
            source = inner.lowered().iterate(ctx.nested(index))
        else:
            source = iter(inner)
        return _ReadAhead(source, ctx) if self.parallel != 1 else source

    def iterate(self, ctx: Ctx, skip: int = 0) -> Iterator[Any]:
        return drop(self._cycle(ctx), skip)

    def _cycle(self, ctx: Ctx) -> Iterator[Any]:
        elements = enumerate(self.up.iterate(ctx))
        slots: list[Iterator[Any] | None] = []
        for index, element in islice(elements, self.cycle_length):
            slots.append(self._open(ctx, index, element))
        while any(s is not None for s in slots):
            for i, slot in enumerate(slots):
                if slot is None:
                    continue
                got = list(islice(slot, self.block_length))
                yield from got
                if len(got) < self.block_length:
                    nxt = next(elements, None)
                    slots[i] = None if nxt is None else self._open(ctx, *nxt)

    def order_varies(self) -> bool:
        return True  # the inner pipelines may shuffle; treat as varying


class _ReadAhead(Iterator[Any]):
    """Read an iterator ahead in a thread (up to 64 elements); the thread ends when this
    reader is dropped (a pass left early)."""

    def __init__(self, source: Iterator[Any], ctx: Ctx) -> None:
        self.timeout = ctx.runtime.options.timeout_seconds
        self.items: queue.Queue[Any] = queue.Queue(64)
        self.stop = threading.Event()
        threading.Thread(target=_read_ahead, args=(source, self.items, self.stop), daemon=True,
                         name="replicator-data-interleave").start()

    def __del__(self) -> None:
        self.stop.set()

    def __next__(self) -> Any:
        try:
            ok, item = self.items.get(timeout=self.timeout)
        except queue.Empty:
            raise InputTimeoutError(f"an interleaved input gave no element in "
                                    f"{self.timeout:.0f} s") from None
        if not ok:
            raise item
        if item is _END:
            raise StopIteration
        return item


def _read_ahead(source: Iterator[Any], items: queue.Queue[Any], stop: threading.Event) -> None:
    def put(entry: tuple[bool, Any]) -> bool:
        while not stop.is_set():
            try:
                items.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False
    try:
        for item in source:
            if not put((True, item)):
                return
        put((True, _END))
    except BaseException as exc:  # noqa: BLE001 - handed to the consumer
        put((False, exc))


# -- lowering ------------------------------------------------------------------------------------
_MOVABLE = (Shuffle, Take, Skip, Repeat, Shard)


def lower(node: Node) -> Node:
    """The same pipeline with pure maps moved below order operators and fused into batches."""
    node = node.with_inputs(tuple(lower(n) for n in node.inputs))
    if isinstance(node, _MOVABLE) and isinstance(node.up, Map) and node.up.pure:
        inner = node.up
        return inner.with_inputs((lower(node.with_inputs((inner.up,))),))
    if isinstance(node, Batch) and isinstance(node.up, Map) and not node.maps:
        maps: list[Map] = []
        up: Node = node.up
        while isinstance(up, Map):
            maps.insert(0, up)
            up = up.up
        fused = node.with_inputs((up,))
        assert isinstance(fused, Batch)
        fused.maps = tuple(maps)
        return fused
    return node

