"""The pieces every node of a dataflow pipeline shares: :class:`Node`, the pass context
:class:`Ctx` and the :class:`Runtime` that holds one pipeline's workers and counters.

A node yields its elements for ``(epoch, salt)`` from ``skip`` on: ``salt`` tells passes of one
epoch apart (the ``r``-th pass of a ``repeat``, the ``i``-th input of an ``interleave``), so a
seeded node (``shuffle``, a shuffled file list) gives every pass its own order, a function of
the seed, the epoch and the salt only. ``skip`` is how a resumed pipeline starts mid-epoch:
nodes that know how many inputs ``skip`` outputs take (a source, a 1:1 map, a batch of a known
size, ``take``/``skip``, a sized ``repeat``, a filled cache) pass it on without computing the
skipped elements; others read and drop them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import Any

from replicator.data.dataflow.autotune import TrainingMeter, Tuner
from replicator.data.dataflow.options import (
    AUTOTUNE,
    Options,
    available_cores,
    local_training_processes,
)

log = logging.getLogger("replicator.data")

INFINITE = -1
UNKNOWN = -2


class Runtime:
    """One pipeline's workers (pools, kept across epochs), caches and counters."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.pools: dict[Any, Any] = {}
        self.tuners: dict[str, Tuner] = {}
        self.caches: dict[int, Any] = {}
        self.counters: dict[str, int] = {}
        self.input_wait_s = 0.0  # the training loop blocked in next(), waiting for an element
        self.logged: set[str] = set()
        self.lock = threading.Lock()
        self._meter: TrainingMeter | None = None

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counters[name] = self.counters.get(name, 0) + n

    def waited(self, seconds: float) -> None:
        """The training loop waited ``seconds`` for the next element (or batch)."""
        with self.lock:
            self.input_wait_s += seconds

    def warn_once(self, kind: str, message: str) -> None:
        """Log ``message`` the first time a problem of ``kind`` occurs."""
        with self.lock:
            if kind in self.logged:
                return
            self.logged.add(kind)
        log.warning("%s (further ones are counted in stats(), not logged)", message)

    def tuner(self, name: str, parallel: int, stages: int = 1) -> Tuner:
        if name not in self.tuners:
            cpus = self.options.cpus
            fixed = None if parallel == AUTOTUNE else parallel
            self.tuners[name] = Tuner(name, max_parallelism=cpus, fixed=fixed,
                                      ram_bytes=max(1, self.options.ram // max(1, stages)),
                                      meter=self.meter)
        return self.tuners[name]

    @property
    def meter(self) -> TrainingMeter | None:
        """The measure of training's cores (``None`` when ``cpu_budget`` was given)."""
        if self.options.cpu_budget is not None:
            return None
        if self._meter is None:
            self._meter = TrainingMeter(available_cores(), local_training_processes(),
                                        self.options.cpus)
        return self._meter

    def pool(self, key: Any, name: str, fn: Any, parallel: int) -> Any:
        from replicator.data.dataflow.engine import Pool

        if key not in self.pools:
            opts = self.options
            self.pools[key] = Pool(fn, self.tuner(name, parallel, stages=2),
                                   mode=opts.worker_type, start_method=opts.start_method,
                                   name=f"replicator-data-{name}", timeout_s=opts.timeout_seconds)
        return self.pools[key]

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()


@dataclass(frozen=True)
class Ctx:
    """Where a pass is: the epoch, the salt of nested passes, the runtime."""

    epoch: int
    runtime: Runtime
    salt: tuple[int, ...] = field(default=())

    def nested(self, part: int) -> Ctx:
        return replace(self, salt=self.salt + (part,))


class Node:
    """One operator of a pipeline (immutable; ``with_inputs`` makes a changed copy)."""

    inputs: tuple[Node, ...] = ()
    name = "node"

    def iterate(self, ctx: Ctx, skip: int = 0) -> Iterator[Any]:
        raise NotImplementedError

    def cardinality(self) -> int:
        """Elements of one pass: a count, ``INFINITE`` or ``UNKNOWN``."""
        return UNKNOWN

    def with_inputs(self, inputs: tuple[Node, ...]) -> Node:
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.inputs = inputs
        return copy

    @property
    def up(self) -> Node:
        return self.inputs[0]

    def order_varies(self) -> bool:
        """True when the elements' order depends on the epoch or the salt (a shuffle)."""
        return any(n.order_varies() for n in self.inputs)

    def describe(self) -> str:
        return self.name

    def chain(self) -> list[Node]:
        """This node and its first inputs down to the source, source first."""
        out: list[Node] = []
        node: Node | None = self
        while node is not None:
            out.append(node)
            node = node.inputs[0] if node.inputs else None
        return out[::-1]


def drop(iterator: Iterator[Any], count: int) -> Iterator[Any]:
    """``iterator`` without its first ``count`` elements (read and dropped)."""
    if count:
        next(islice(iterator, count, count), None)
    return iterator
