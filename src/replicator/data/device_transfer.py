"""Move batches to the replica's device ahead of use.

On CUDA a batch is pinned and copied on a side stream by the prefetch thread; the step's
stream waits on an event recorded after the copy, and the tensors are marked as used by the
step's stream so the allocator does not reuse their memory early. Elsewhere the copy is a plain
``.to(device)`` (a no-op on the CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from replicator.data.materialise import LocalBatch, make_mask


def _map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_map_tensors(b, fn) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map_tensors(b, fn) for b in batch)
    if isinstance(batch, dict):
        return {k: _map_tensors(v, fn) for k, v in batch.items()}
    return batch


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor on ``device`` (containers rebuilt, other leaves kept)."""
    return _map_tensors(batch, lambda t: t if t.device == device
                        else t.to(device, non_blocking=non_blocking))


def pin(batch: Any) -> Any:
    """``batch`` with every CPU tensor in pinned (page-locked) memory."""
    return _map_tensors(batch, lambda t: t.pin_memory()
                        if t.device.type == "cpu" and not t.is_pinned() else t)


Staged = tuple[LocalBatch, Any]  # the batch and the CUDA event its copy recorded (or None)


class DeviceStage:
    """Pin and copy batches for ``device`` (called in the prefetch thread), and make the
    step's stream wait for the copy (:meth:`ready`, called in the step's thread)."""

    def __init__(self, device: torch.device, fetch_to_device: bool = True,
                 pin_memory: bool | None = None) -> None:
        cuda = device.type == "cuda"
        if cuda and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.copy = fetch_to_device and device.type != "cpu"
        if pin_memory is None:
            pin_memory = cuda
        self.pin = bool(pin_memory) and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(device) if cuda and self.copy else None

    def __call__(self, item: LocalBatch) -> Staged:
        batch, mask = item.batch, item.mask
        if not isinstance(mask, torch.Tensor):
            mask = make_mask(item.real, mask)
        event = None
        if self.device.type == "cuda":
            # This runs in the prefetch thread, whose current device is not the replica's:
            # pin and copy under the replica's device (no stray context on GPU 0).
            with torch.cuda.device(self.device):
                if self.pin:
                    batch, mask = pin(batch), pin(mask)
                if self.stream is not None:
                    with torch.cuda.stream(self.stream):
                        batch = to_device(batch, self.device, non_blocking=True)
                        mask = mask.to(self.device, non_blocking=True)
                        event = torch.cuda.Event()
                        event.record(self.stream)
        elif self.pin:
            batch, mask = pin(batch), pin(mask)
        if self.copy and self.stream is None:  # another accelerator: a plain copy
            batch, mask = to_device(batch, self.device), mask.to(self.device)
        return item._replace(batch=batch, mask=mask), event

    def ready(self, staged: Staged) -> LocalBatch:
        item, event = staged
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)

            def mark(t: torch.Tensor) -> torch.Tensor:
                if t.is_cuda:
                    t.record_stream(current)
                return t
            _map_tensors(item.batch, mark)
            mark(item.mask)
        return item
