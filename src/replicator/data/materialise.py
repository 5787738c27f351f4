"""Turn a batch *spec* (which samples, which rows) into a collated batch and its mask.

A :class:`Spec` is what a plan decides per step; it is small and picklable, so process workers
can receive it. :class:`Materialiser` does the work: read each sample (``dataset[i]`` for a
map-style dataset, the element itself for a stream), apply the per-sample ``transform``
(in parallel through ``mapper``), collate, take this replica's rows, pad, and build the mask.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from replicator.data.batch_rows import batch_rows, pad_rows, repeat_first_row, slice_rows


class Spec(NamedTuple):
    """One step of one replica: what to load and which rows to keep."""

    items: tuple          # dataset indices, stream elements, or (collated batch,)
    rows: tuple[int, int] | None  # keep rows[0]:rows[1] of the collated batch (None: all)
    real: int             # how many of the kept rows are real samples (the rest are padding)
    size: int             # rows of the result (real + masked padding)
    full: bool            # a full per-replica batch (drop mode stops before non-full ones)
    position: int         # the plan's position after this step


class LocalBatch(NamedTuple):
    """A materialised step: the batch, its per-sample mask (1 real, 0 padding; built in the
    main process from the row count, so workers send one tensor less) and where the plan
    stands after it."""

    batch: Any
    mask: torch.Tensor | int  # the row count until the device stage makes the mask tensor
    real: int
    full: bool
    position: int


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
            collate = self.collate
            if collate is None:
                from torch.utils.data import default_collate as collate
            batch = collate(samples)
        if spec.rows is not None:
            batch = slice_rows(batch, *spec.rows)
        rows = batch_rows(batch)
        if rows is not None and spec.real == 0:
            batch = repeat_first_row(batch, spec.size)
        elif rows is not None and rows < spec.size:
            batch = pad_rows(batch, spec.size)
        size = spec.size if rows is not None else spec.real
        return LocalBatch(batch, max(size, spec.real), spec.real, spec.full, spec.position)
