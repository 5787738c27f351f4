"""What a worker runs: a chunk of elements through a map, or a whole batch (load, map,
collate). Both are module-level classes, so process workers started by spawn can receive them;
with ``on_error="skip"`` a failing element is left out and described for the stats.

In a process worker the default collate writes each batch's tensors straight into shared
memory (as DataLoader's workers do): the queue then hands the batch over as a handle without
copying it again. Stacking into private memory first cost a second copy of the batch, and the
page faults of fresh memory for it, in every task: about a tenth of the task time of an
ImageNet-style decode (``benchmarks/ingestion.py``). The shared memory of a batch the consumer
has let go of is reused for a later one (:mod:`buffers`): its pages are already there.
Each tensor the map makes is copied into its row of the batch as soon as it is made (tf.data's
map-and-batch fusion, :class:`_Rows`), while it is still in the cache, and freed at once; the
collate then finds the rows in place.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate_fn_map

from replicator.data.dataflow.buffers import Key, WorkerBuffers, populate, worker_buffers
from replicator.data.errors import InputPipelineError

_IN_PROCESS_WORKER = False
_BUFFERS: WorkerBuffers | None = None


def mark_process_worker(releases: Any = None) -> None:
    """Called first in each worker process: its batches are collated into shared memory, in
    buffers the consumer names back on ``releases`` (a pipe's read end) once done with them."""
    global _IN_PROCESS_WORKER, _BUFFERS
    _IN_PROCESS_WORKER = True
    _BUFFERS = worker_buffers(releases)


def handed_over(ok: bool) -> list[Key]:
    """The buffers the task just run hands to the consumer (none if it failed)."""
    _FILLING.clear()
    return _BUFFERS.settle(ok) if _BUFFERS is not None else []


def take_back_buffers() -> None:
    """Free the buffers the consumer gave back beyond the few kept for reuse (an idle worker)."""
    if _BUFFERS is not None:
        _BUFFERS.take_back()


def _shared_storage(nbytes: int) -> torch.UntypedStorage:
    if _BUFFERS is not None and nbytes:
        return _BUFFERS.storage(nbytes)
    storage = torch.UntypedStorage._new_shared(nbytes)
    populate(storage)
    return storage


class _Rows:
    """A batch's shared buffers, filled a row at a time: each tensor of a sample goes to row
    ``kept`` of the buffer for its place in the sample (allocated when the first sample
    arrives) and is replaced by that row; a tensor that does not fit its buffer stays as it is,
    and the collate stacks that place as before."""

    def __init__(self, rows: int) -> None:
        self.rows, self.kept = rows, 0
        self.buffers: list[torch.Tensor | None] = []

    def place(self, sample: Any) -> Any:
        counter = [0]
        placed = self._place(sample, counter)
        self.kept += 1
        return placed

    def _place(self, obj: Any, counter: list[int]) -> Any:
        if type(obj) is torch.Tensor:
            index = counter[0]
            counter[0] += 1
            return self._row(index, obj)
        if isinstance(obj, dict):
            return {k: self._place(v, counter) for k, v in obj.items()} \
                if type(obj) is dict else obj
        if type(obj) in (tuple, list):
            return type(obj)(self._place(v, counter) for v in obj)
        return obj

    def _row(self, index: int, t: torch.Tensor) -> torch.Tensor:
        if index == len(self.buffers):
            self.buffers.append(self._buffer(t) if self.kept == 0 and _fits(t) else None)
        buf = self.buffers[index] if index < len(self.buffers) else None
        if buf is None or not _fits(t) or t.dtype != buf.dtype or t.shape != buf.shape[1:]:
            return t
        row = buf[self.kept]
        row.copy_(t)
        return row

    def _buffer(self, t: torch.Tensor) -> torch.Tensor:
        shape = (self.rows, *t.shape)
        return _shared_tensor(shape, t.dtype)

    def holds(self, batch: list[torch.Tensor]) -> torch.Tensor | None:
        """The rows ``batch`` is, as one tensor, if they are this batch's first rows of one
        buffer in order."""
        base = batch[0]._base
        if base is None or len(batch) > self.rows or not any(base is b for b in self.buffers):
            return None
        step = base.stride(0)
        if all(t._base is base and t.storage_offset() == i * step for i, t in enumerate(batch)):
            return base[:len(batch)]
        return None


def _fits(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.layout == torch.strided and not t.is_nested \
        and not t.requires_grad and t.numel() > 0


def _shared_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor of ``shape`` over a batch buffer of shared memory."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    strides: list[int] = []
    step = 1
    for size in reversed(shape):
        strides.insert(0, step)
        step *= size
    return torch.empty(0, dtype=dtype).set_(_shared_storage(nbytes), 0, shape, strides)


_FILLING: list[_Rows] = []  # the rows of the batch task a process worker runs now, if any


def _stack(batch: list[torch.Tensor], *,
           collate_fn_map: dict[Any, Callable[..., Any]] | None = None) -> torch.Tensor:
    """torch's tensor collate, into a new shared-memory storage in a process worker (or the
    rows already filled, :class:`_Rows`)."""
    filled = _FILLING[0].holds(batch) if _FILLING else None
    if filled is not None:
        return filled
    elem = batch[0]
    if not (_IN_PROCESS_WORKER and elem.device.type == "cpu" and elem.layout == torch.strided
            and not elem.is_nested and all(t.dtype == elem.dtype and t.shape == elem.shape
                                           and not t.requires_grad for t in batch)):
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    shape = (len(batch), *elem.shape)
    return torch.stack(batch, 0, out=_shared_tensor(shape, elem.dtype))


_COLLATE_MAP: dict[Any, Callable[..., Any]] = {**default_collate_fn_map, torch.Tensor: _stack}


def default_batch_collate(samples: list[Any]) -> Any:
    """torch's ``default_collate``, whose tensors are stacked into shared memory in a process
    worker (the batch crosses to the consumer without another copy)."""
    return collate(samples, collate_fn_map=_COLLATE_MAP)


def describe_element(element: Any) -> str:
    """A short name for an element in messages: a shard sample's key and shard, else its
    start."""
    if isinstance(element, dict) and "__key__" in element:
        url = element.get("__url__")
        return f"sample {element['__key__']!r}" + (f" of shard {url}" if url else "")
    text = repr(element)
    return f"element {text[:60]}{'...' if len(text) > 60 else ''}"


def _apply(fns: tuple[Callable[[Any], Any], ...], element: Any) -> Any:
    for fn in fns:
        element = fn(element)
    return element


class MapChunk:
    """Apply ``fns`` to each element of a chunk: ``(outputs, failures)``."""

    def __init__(self, fns: tuple[Callable[[Any], Any], ...], on_error: str) -> None:
        self.fns, self.on_error = fns, on_error

    def __call__(self, elements: list[Any], place: Callable[[Any], Any] | None = None
                 ) -> tuple[list[Any], list[str]]:
        outputs, failures = [], []
        for element in elements:
            try:
                out = _apply(self.fns, element)
                outputs.append(place(out) if place is not None else out)
            except Exception as exc:
                if self.on_error != "skip":
                    raise InputPipelineError(
                        f"map failed on {describe_element(element)}: {type(exc).__name__}: "
                        f"{exc}. HINT: fix the data or the function, or pass "
                        "on_error='skip' to skip such samples (counted in stats())") from exc
                failures.append(f"{describe_element(element)}: {type(exc).__name__}: {exc}")
        return outputs, failures


class BatchWork:
    """Map and collate one batch: ``(batch, samples kept, failures)``."""

    def __init__(self, fns: tuple[Callable[[Any], Any], ...], on_error: str,
                 collate: Callable[[list[Any]], Any]) -> None:
        self.chunk = MapChunk(fns, on_error)
        self.collate = collate

    def load(self, elements: list[Any]) -> tuple[list[Any], list[str]]:
        """The mapped samples; in a process worker whose collate is the default one, their
        tensors already sit in the rows of the batch (until the task ends)."""
        place = None
        if _IN_PROCESS_WORKER and self.chunk.fns and default_batch_collate in (
                self.collate, getattr(self.collate, "collate", None)):
            _FILLING[:] = [_Rows(len(elements))]
            place = _FILLING[0].place
        samples, failures = self.chunk(elements, place) if self.chunk.fns else \
            (list(elements), [])
        if not samples:
            raise InputPipelineError(
                f"every sample of a batch of {len(elements)} failed; the first: {failures[0]}")
        return samples, failures

    def __call__(self, elements: list[Any]) -> tuple[Any, int, list[str]]:
        samples, failures = self.load(elements)
        return self.collate(samples), len(samples), failures
