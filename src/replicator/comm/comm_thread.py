"""The communication lane: a background thread with a private copy of the world process group.

Algorithms made of several dependent steps (ring, hierarchical, reduce-to-one, compressed
all-reduce) run on the lane so that ``backward()`` goes on while they communicate. The private
group keeps their collectives from interleaving with those the main thread issues on the default
group: two threads issuing collectives on one group could pair different operations across
ranks. Tasks run one at a time in submission order, which is the same on every rank, so the
lane's collectives always match.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from replicator.comm.groups import default_timeout_seconds
from replicator.comm.handles import ThreadHandle
from replicator.comm.op_errors import algorithm_error

#: Seconds a handle waits beyond the collective timeout (the collectives inside fail first).
WAIT_MARGIN_SECONDS = 10.0


class Lane:
    """One background thread and a private process group spanning the whole world."""

    def __init__(self, timeout_seconds: float) -> None:
        self.world = dist.group.WORLD
        self.rank = dist.get_rank()
        self.timeout_seconds = timeout_seconds
        self.group = dist.new_group(list(range(dist.get_world_size())),
                                    timeout=timedelta(seconds=timeout_seconds))
        self._streams: dict[torch.device, Any] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="replicator-comm", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None], what: str, tensor: torch.Tensor,
               wait_seconds: float | None = None) -> ThreadHandle:
        """Run ``fn()`` on the lane after everything submitted before; return its handle."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        ready = done = None
        if tensor.is_cuda:
            ready, done = torch.cuda.Event(), torch.cuda.Event()
            ready.record()
        self._queue.put((fn, what, tensor.device, ready, done, future))
        timeout = (wait_seconds or self.timeout_seconds) + WAIT_MARGIN_SECONDS
        return ThreadHandle(future, what, self.rank, timeout, done)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, what, device, ready, done, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if ready is not None:
                    self._run_on_side_stream(fn, device, ready, done)
                else:
                    fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                future.set_exception(algorithm_error(exc, self.rank, what))
            else:
                future.set_result(True)

    def _run_on_side_stream(self, fn: Callable[[], None], device: torch.device,
                            ready: Any, done: Any) -> None:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        stream = self._streams[device]
        with torch.cuda.device(device), torch.cuda.stream(stream):
            stream.wait_event(ready)
            fn()
            done.record(stream)

    def close(self) -> None:
        self._queue.put(None)


_LANE: Lane | None = None
_LOCK = threading.Lock()


def lane() -> Lane:
    """This process's lane for the current default group, created on first use.

    Creating it is a collective (a new process group): every rank must reach its first use in
    the same order, which holds because algorithms are called in the same order everywhere.
    """
    global _LANE
    with _LOCK:
        if _LANE is None or _LANE.world is not dist.group.WORLD:
            if _LANE is not None:
                _LANE.close()
            _LANE = Lane(default_timeout_seconds())
        return _LANE
