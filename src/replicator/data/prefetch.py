"""The ready-batch queue between the pipeline and the step.

:class:`PrefetchQueue` is filled by a background thread (bounded: at most ``capacity`` ready
batches, so memory stays bounded and the producer pauses when the step is slow);
:class:`SyncQueue` produces a batch only when the step asks (prefetch off). Both tell the
end-of-data agreement how many batches are ready and whether the pipeline has finished.
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

from replicator.data.device_transfer import Staged
from replicator.data.errors import InputTimeoutError
from replicator.data.materialise import LocalBatch


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


@atexit.register
def _stop_all() -> None:
    """At exit, park every prefetch thread before the interpreter tears torch down under it."""
    for queue in list(_LIVE):
        queue.close(wait=True, timeout=1.0)
