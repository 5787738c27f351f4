"""Sources of a dataflow pipeline: slices of tensors, a map-style dataset, a list (of files or
URLs, optionally shuffled per epoch), a generator."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from replicator.data.batching import derived_seed, shuffled
from replicator.data.dataflow.graph import UNKNOWN, Ctx, Node, drop


def _leaves_len(structure: Any) -> int:
    if isinstance(structure, Mapping):
        lengths = {_leaves_len(v) for v in structure.values()}
    elif isinstance(structure, tuple):
        lengths = {_leaves_len(v) for v in structure}
    else:
        return len(structure)
    if len(lengths) != 1:
        raise ValueError(f"from_tensor_slices needs components of one length (dimension 0), "
                         f"got lengths {sorted(lengths)}")
    return lengths.pop()


def _slice(structure: Any, i: int) -> Any:
    if isinstance(structure, Mapping):
        return {k: _slice(v, i) for k, v in structure.items()}
    if isinstance(structure, tuple):
        return tuple(_slice(v, i) for v in structure)
    return structure[i]


class SliceSource(Node):
    """Element ``i`` is row ``i`` of every component (tensors, arrays or lists; nested in
    tuples and dicts)."""

    name = "from_tensor_slices"

    def __init__(self, tensors: Any) -> None:
        if isinstance(tensors, list) and tensors and isinstance(tensors[0], torch.Tensor):
            tensors = torch.stack(tensors)
        self.tensors = tensors
        self.length = _leaves_len(tensors)

    def iterate(self, ctx: Ctx, skip: int = 0) -> Iterator[Any]:
        for i in range(skip, self.length):
            yield _slice(self.tensors, i)

    def cardinality(self) -> int:
        return self.length


class RangeSource(Node):
    """The indices ``0 .. n-1`` (``from_dataset`` maps them through ``dataset[i]``)."""

    name = "range"

    def __init__(self, n: int) -> None:
        self.n = n

    def iterate(self, ctx: Ctx, skip: int = 0) -> Iterator[Any]:
        return iter(range(skip, self.n))

    def cardinality(self) -> int:
        return self.n


class GetItem:
    """``dataset[i]``: the loading step of ``from_dataset`` (a map, so it runs in workers)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.__name__ = f"{type(dataset).__name__}.__getitem__"

    def __call__(self, index: int) -> Any:
        return self.dataset[index]


class ListSource(Node):
    """A list of items (file paths, URLs), in a seeded order per epoch when shuffling."""

    name = "list"

    def __init__(self, items: Sequence[Any], shuffle: bool = False, seed: int = 0) -> None:
        self.items = [os.fspath(i) if isinstance(i, os.PathLike) else i for i in items]
        self.shuffle, self.seed = shuffle, seed

    def iterate(self, ctx: Ctx, skip: int = 0) -> Iterator[Any]:
        items = self.items
        if self.shuffle:
            items = shuffled(items, derived_seed(self.seed, ctx.epoch, *ctx.salt))
        return iter(items[skip:])

    def cardinality(self) -> int:
        return len(self.items)

    def order_varies(self) -> bool:
        return self.shuffle


class GeneratorSource(Node):
    """``fn()`` (or ``fn(*args)``) called once per pass; its iterator gives the elements."""

    name = "from_generator"

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...] = ()) -> None:
        if not callable(fn):
            raise TypeError(f"from_generator needs a function returning an iterator, got "
                            f"{type(fn).__name__}. HINT: pass the generator function, not "
                            "its result (from_generator(gen), not from_generator(gen()))")
        self.fn, self.args = fn, args

    def iterate(self, ctx: Ctx, skip: int = 0) -> Iterator[Any]:
        return drop(iter(self.fn(*self.args)), skip)

    def cardinality(self) -> int:
        return UNKNOWN

    def describe(self) -> str:
        return f"from_generator({getattr(self.fn, '__name__', '?')})"
