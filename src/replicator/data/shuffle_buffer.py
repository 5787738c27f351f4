"""Seeded shuffling of streams: a tf.data-style shuffle buffer and the per-epoch file order.

Everything here is a pure function of (seed, epoch, stream identity), so every replica that
reads the same stream gets the same order, and a restart that replays it gets it again.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


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
