"""Process-wide timers of how long the training thread waits in collectives; off by default
(``REPLICATOR_COMM_TIMING=1`` or :func:`enable`): on CUDA a timed call synchronizes the device."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import astuple, dataclass

import torch

#: The environment variable that turns the timers on in a process (``"1"``).
ENV = "REPLICATOR_COMM_TIMING"

#: ``None`` until first asked: the environment is read then, not at import (a worker forked
#: from a preloaded server sets its environment after the import).
_enabled: bool | None = None
_lock = threading.Lock()
_local = threading.local()
#: exposed seconds, calls, background seconds, background calls (``CommTime``'s fields)
_totals: list[float] = [0.0, 0, 0.0, 0]
_regions: dict[str, float] = {}
_open_regions: set[str] = set()  # main thread only: a nested region of a name counts once


@dataclass(frozen=True)
class CommTime:
    """Totals since the last reset: main-thread waits (``exposed``) and other threads'
    communication (``background``)."""

    exposed: float = 0.0
    calls: int = 0
    background: float = 0.0
    background_calls: int = 0

    def __sub__(self, other: CommTime) -> CommTime:
        return CommTime(*(a - b for a, b in zip(astuple(self), astuple(other))))


def enable(on: bool = True) -> None:
    """Turn the timers on (or off) in this process."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    global _enabled
    if _enabled is None:
        _enabled = os.environ.get(ENV, "") == "1"
    return _enabled


def _synchronize(device: torch.device | None) -> None:
    """Wait for the work queued on a CUDA ``device`` (nothing to wait for elsewhere)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def start(device: torch.device | None = None) -> float | None:
    """Mark a collective's start for :func:`stop`; ``None`` when off or nested (counted once)."""
    if not (_enabled if _enabled is not None else enabled()):
        return None
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    if depth:
        return None
    _synchronize(device)
    return time.perf_counter()


def stop(token: float | None, device: torch.device | None = None) -> None:
    """End the collective started by :func:`start` (safe with ``None``)."""
    if token is None and not (_enabled if _enabled is not None else enabled()):
        return
    _local.depth = max(0, getattr(_local, "depth", 0) - 1)
    if token is None:
        return
    _synchronize(device)
    elapsed = time.perf_counter() - token
    at = 0 if threading.current_thread() is threading.main_thread() else 2
    with _lock:
        _totals[at] += elapsed
        _totals[at + 1] += 1


@contextlib.contextmanager
def region(name: str) -> Iterator[None]:
    """Count the main thread's time inside the block under ``name`` (``"checkpoint"``, say);
    nested once, free when off."""
    if not (_enabled if _enabled is not None else enabled()) or name in _open_regions or \
            threading.current_thread() is not threading.main_thread():
        yield
        return
    t0 = time.perf_counter()
    _open_regions.add(name)
    try:
        yield
    finally:
        _open_regions.discard(name)
        with _lock:
            _regions[name] = _regions.get(name, 0.0) + time.perf_counter() - t0


def region_seconds(name: str) -> float:
    """The total time counted under ``name`` by :func:`region` since the last reset."""
    with _lock:
        return _regions.get(name, 0.0)


def snapshot() -> CommTime:
    """The totals so far (cheap; take one before and after a region and subtract)."""
    with _lock:
        return CommTime(_totals[0], int(_totals[1]), _totals[2], int(_totals[3]))


def reset() -> None:
    """Set every total back to zero."""
    with _lock:
        _totals[:] = [0.0, 0, 0.0, 0]
        _regions.clear()
