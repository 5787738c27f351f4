"""Running ahead of the step: the ready-batch queue and the copy of each batch to the device.

Queue: :class:`PrefetchQueue` is filled by a background thread (bounded: at most ``capacity``
ready batches, so memory stays bounded and the producer pauses when the step is slow);
:class:`SyncQueue` produces a batch only when the step asks (prefetch off). Both tell the
end-of-data agreement how many batches are ready and whether the pipeline has finished.

Device: on CUDA a batch is pinned and copied on a side stream by the prefetch thread; the
step's stream waits on an event recorded after the copy, and the tensors are marked as used by
the step's stream so the allocator does not reuse their memory early. Elsewhere the copy is a
plain ``.to(device)`` (a no-op on the CPU).
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

from replicator.data.batching import LocalBatch, make_mask
from replicator.data.errors import InputTimeoutError


# -- device copy -------------------------------------------------------------------------------
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
            if isinstance(item.mask, torch.Tensor):
                mark(item.mask)
        return item


# -- ready-batch queue -------------------------------------------------------------------------
class _Queue(ABC):
    def __init__(self) -> None:
        self._items: deque[Staged] = deque()
        self.finished = False
        self._error: BaseException | None = None

    def counts(self) -> tuple[int, int]:
        """``(ready batches, ready full batches)``."""
        items = list(self._items)
        return len(items), sum(1 for item, _ in items if item.full)

    def _satisfied(self, need_full: bool) -> bool:
        if self._error is not None or self.finished:
            return True
        ready, full = self.counts()
        return (full if need_full else ready) > 0

    @abstractmethod
    def wait(self, need_full: bool = False) -> None:
        """Until a (full) batch is ready or the pipeline finished; raises its error."""

    def pop(self) -> Staged | None:
        """The next batch, or ``None`` at the end of the pipeline."""
        self.wait(False)
        if self._items:
            return self._items.popleft()
        if self._error is not None:
            raise self._error
        return None

    def close(self, wait: bool = False) -> None:
        """Stop producing and drop what is buffered."""
        return None


class SyncQueue(_Queue):
    """Prefetch off: the step's thread produces each batch when it needs one."""

    def __init__(self, source: Iterator[LocalBatch], stage: Callable[[LocalBatch], Staged]
                 ) -> None:
        super().__init__()
        self._source = source
        self._stage = stage

    def wait(self, need_full: bool = False) -> None:
        while not self._satisfied(need_full):
            try:
                self._items.append(self._stage(next(self._source)))
            except StopIteration:
                self.finished = True
        if self._error is not None:
            raise self._error

    def close(self, wait: bool = False) -> None:
        self._items.clear()
        close = getattr(self._source, "close", None)
        if callable(close):
            close()


class PrefetchQueue(_Queue):
    """A background thread keeps up to ``capacity`` batches ready."""

    def __init__(self, source: Iterator[LocalBatch], stage: Callable[[LocalBatch], Staged], *,
                 capacity: int, timeout_seconds: float, name: str, who: str = "") -> None:
        super().__init__()
        self._who = who
        self._cond = threading.Condition()
        self._stop = False
        self._capacity = capacity
        self._timeout = timeout_seconds
        self._thread = threading.Thread(target=self._fill, args=(source, stage), name=name,
                                        daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def _fill(self, source: Iterator[LocalBatch], stage: Callable[[LocalBatch], Staged]) -> None:
        try:
            for item in source:
                staged = stage(item)
                with self._cond:
                    while len(self._items) >= self._capacity and not self._stop:
                        self._cond.wait(0.1)
                    if self._stop:
                        break
                    self._items.append(staged)
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the step's thread
            with self._cond:
                self._error = exc
        finally:
            close = getattr(source, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:  # noqa: BLE001 - closing after an error
                    pass
            with self._cond:
                self.finished = True
                self._cond.notify_all()

    def counts(self) -> tuple[int, int]:
        with self._cond:
            return super().counts()

    def wait(self, need_full: bool = False) -> None:
        deadline = time.monotonic() + self._timeout
        with self._cond:
            while not self._satisfied(need_full):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise InputTimeoutError(
                        f"{self._who + ': ' if self._who else ''}no batch from the input "
                        f"pipeline within {self._timeout:g} s. HINT: a "
                        "sample may be very slow to read or stuck (a network file, a lock); "
                        "raise InputOptions(timeout_seconds=...) if it is only slow.")
                self._cond.wait(min(left, 1.0))
            if self._error is not None and not self._items:
                raise self._error

    def pop(self) -> Staged | None:
        self.wait(False)
        with self._cond:
            if self._items:
                item = self._items.popleft()
                self._cond.notify_all()
                return item
            if self._error is not None:
                raise self._error
            return None

    def close(self, wait: bool = False, timeout: float | None = None) -> None:
        """Stop the thread; ``wait``: also until it has let go of its source (at most
        ``timeout``, by default the pipeline's, in case it is inside a slow read)."""
        with self._cond:
            self._stop = True
            self._items.clear()
            self._cond.notify_all()
        if wait and self._thread is not threading.current_thread():
            self._thread.join(self._timeout if timeout is None else timeout)


def make_queue(source: Iterator[LocalBatch], stage: Callable[[LocalBatch], Staged], *,
               prefetch: int, timeout_seconds: float, name: str, who: str = "") -> Any:
    """A :class:`PrefetchQueue` of ``prefetch`` batches, or a :class:`SyncQueue` for 0."""
    if prefetch <= 0:
        return SyncQueue(source, stage)
    return PrefetchQueue(source, stage, capacity=prefetch, timeout_seconds=timeout_seconds,
                         name=name, who=who)


_LIVE: weakref.WeakSet[PrefetchQueue] = weakref.WeakSet()


#: Longest wait at exit for the prefetch threads to finish the batch they are preparing.
EXIT_WAIT_SECONDS = 60.0


@atexit.register
def _stop_all() -> None:
    """At exit, stop every prefetch thread and wait until it has finished the batch in hand.

    A daemon thread still inside torch's C++ code (a transform, a collate, a copy) when the
    interpreter finalizes is ended by ``pthread_exit`` as soon as it returns, and that forced
    unwinding through torch's ``noexcept`` frames aborts the process ("terminate called
    without an active exception"): a finished job would exit with SIGABRT. So the wait is
    generous (a slow transform finishes its batch), shared by all queues, not 1 s each.
    """
    queues = list(_LIVE)
    for queue in queues:
        queue.close()
    deadline = time.monotonic() + EXIT_WAIT_SECONDS
    for queue in queues:
        queue.close(wait=True, timeout=max(0.0, deadline - time.monotonic()))
