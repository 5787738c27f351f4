"""``cache()``: the elements of the first complete pass, kept in memory or in a file, replayed by
every later pass (and epoch).

A cache is filled only by a pass that reads its input to the end; a pass left early leaves it
empty, and the next pass fills it. A file cache is written to a temporary name and renamed when
complete, so a crash never leaves a partial cache that a later run would take for whole. The
input of a cache must give the same elements in every epoch: a ``shuffle`` (or a shuffled file
list) before ``cache()`` is refused, since replaying the first epoch's order would make the
order depend on whether the cache was filled.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from typing import Any

from replicator.data.dataflow.graph import Ctx, Node
from replicator.data.errors import InputPipelineError


class Cache(Node):
    name = "cache"

    def __init__(self, up: Node, path: str | os.PathLike[str] | None) -> None:
        if up.order_varies():
            raise ValueError(
                "cache() after shuffle() (or after a shuffled list_files/interleave) would "
                "replay the first epoch's order in every epoch. HINT: put cache() before "
                "shuffle(): ds.map(decode).cache().shuffle(n)")
        self.inputs = (up,)
        self.path = None if path is None or path == "" else os.fspath(path)

    def describe(self) -> str:
        return f"cache({self.path or 'memory'})"

    def cardinality(self) -> int:
        return self.up.cardinality()

    def iterate(self, ctx: Ctx, skip: int = 0) -> Iterator[Any]:
        stored = self._stored(ctx)
        if stored is not None:
            ctx.runtime.count("cache_hits")
            return stored(skip)
        ctx.runtime.count("cache_fills")
        return self._fill(ctx, skip)

    def _stored(self, ctx: Ctx) -> Any:
        if self.path is None:
            elements = ctx.runtime.caches.get(id(self))
            if elements is None:
                return None
            return lambda skip: iter(elements[skip:])
        if not os.path.exists(self.path):
            return None
        return lambda skip: _read_file(self.path, skip)  # type: ignore[arg-type]

    def _fill(self, ctx: Ctx, skip: int) -> Iterator[Any]:
        elements: list[Any] = []
        tmp = f"{self.path}.tmp-{os.getpid()}" if self.path else None
        out = open(tmp, "wb") if tmp else None
        try:
            for i, element in enumerate(self.up.iterate(ctx)):
                if out is not None:
                    pickle.dump(element, out, protocol=pickle.HIGHEST_PROTOCOL)
                else:
                    elements.append(element)
                if i >= skip:
                    yield element
            if out is not None:
                out.close()
                os.replace(tmp, self.path)  # type: ignore[arg-type]
            else:
                ctx.runtime.caches[id(self)] = elements
        finally:
            if out is not None and not out.closed:
                out.close()
            if tmp and os.path.exists(tmp):
                os.remove(tmp)


def _read_file(path: str, skip: int) -> Iterator[Any]:
    with open(path, "rb") as f:
        i = 0
        while True:
            try:
                element = pickle.load(f)
            except EOFError:
                return
            except Exception as exc:
                raise InputPipelineError(
                    f"the cache file {path} is damaged at element {i} ({type(exc).__name__}: "
                    f"{exc}). HINT: delete it; the next pass writes it again") from exc
            if i >= skip:
                yield element
            i += 1
