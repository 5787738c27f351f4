"""Communication lanes: per process group, a background thread with a private copy of the group
(so two threads never pair different operations), and the handles of communication in flight."""

from __future__ import annotations

import atexit
import concurrent.futures
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from replicator.cluster.timeouts import resolve_timeout
from replicator.comm import timing
from replicator.comm.groups import algorithm_error, check_member, group_ranks, new_private_group
from replicator.errors import ReplicaTimeoutError

#: Seconds a handle waits beyond the collective timeout (the collectives inside fail first).
WAIT_MARGIN_SECONDS = 10.0


class Handle(Protocol):
    """Anything with ``wait()``: returns once the tensor holds the result, raises on failure."""

    def wait(self) -> object: ...


class Done:
    """A handle for work that already finished."""

    def wait(self) -> bool:
        return True


DONE = Done()


@dataclass(eq=False)
class ThreadHandle:
    """Work on a lane; ``wait()`` is bounded by ``timeout_seconds`` and re-raises its error."""

    future: concurrent.futures.Future
    what: str
    rank: int
    timeout_seconds: float
    done_event: torch.cuda.Event | None = None

    def wait(self) -> bool:
        finished, _ = concurrent.futures.wait([self.future], timeout=self.timeout_seconds)
        if not finished:
            raise ReplicaTimeoutError(
                f"{self.what} on rank {self.rank} did not finish within "
                f"{self.timeout_seconds:g} s. HINT: another replica may be stuck or on another "
                "code path; every rank must make the same collective calls in the same order.")
        self.future.result()  # re-raises the communication thread's error here
        if self.done_event is not None:
            torch.cuda.current_stream().wait_event(self.done_event)
        return True


class Lane:
    """One background thread and a private copy (``self.group``) of one process group."""

    def __init__(self, ranks: list[int], timeout_seconds: float, backend: str) -> None:
        self.rank = dist.get_rank()
        self.ranks = list(ranks)
        self.timeout_seconds = timeout_seconds
        self.group = new_private_group(self.ranks, "lane", timeout_seconds, backend)
        self._streams: dict[torch.device, Any] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"replicator-comm-{'-'.join(map(str, ranks))}")
        self._thread.start()

    def submit(self, fn: Callable[[], None], what: str, tensor: torch.Tensor,
               wait_seconds: float | None = None) -> ThreadHandle:
        """Run ``fn()`` on the lane after everything submitted before; return its handle."""
        if self._closed:
            raise RuntimeError(f"the communication lane of ranks {self.ranks} is closed (its "
                               "process group was destroyed). HINT: use a live group")
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
            started = timing.start()  # counted as overlapped communication
            try:
                if ready is not None:
                    self._run_on_side_stream(fn, device, ready, done)
                else:
                    fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                timing.stop(started)
                future.set_exception(algorithm_error(exc, self.rank, what))
            else:
                timing.stop(started)
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
        """End the thread once the work already submitted is done."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)


_LANES: weakref.WeakKeyDictionary[dist.ProcessGroup, Lane] = weakref.WeakKeyDictionary()
_WORLD: list[Any] = [None]  # the default group the lanes belong to (compared by identity)
_LOCK = threading.Lock()


def lane(group: dist.ProcessGroup | None = None) -> Lane:
    """This process's lane for ``group`` (``None``: the default); the first use is a collective."""
    check_member(group, "lane")
    key = dist.group.WORLD if group is None else group
    if key is None:
        raise RuntimeError("no process group is running. HINT: start one first "
                           "(rp.MirroredStrategy() or torch.distributed.init_process_group)")
    with _LOCK:
        if _WORLD[0] is not dist.group.WORLD:
            _close_all_locked()
            _WORLD[0] = dist.group.WORLD
            from replicator.cluster.process_group import on_shutdown

            on_shutdown(close_lanes)
        found = _LANES.get(key)
        if found is None:
            found = _LANES[key] = Lane(group_ranks(group), resolve_timeout(group=group),
                                       str(dist.get_backend(group)))
            weakref.finalize(key, found.close)
        return found


#: Objects that keep state per process group (the algorithms), told to drop it once the lanes
#: have closed; module teardown would free those groups after gloo's static state (an abort).
_KEEPERS: weakref.WeakSet[Any] = weakref.WeakSet()


def forget_at_shutdown(keeper: Any) -> None:
    """Call ``keeper.forget_groups()`` at shutdown or exit, once the lanes have closed."""
    _KEEPERS.add(keeper)


def close_lanes() -> None:
    """End every lane (after its submitted work), then make the keepers drop their groups."""
    with _LOCK:
        _close_all_locked()
        _WORLD[0] = None
    for keeper in list(_KEEPERS):
        keeper.forget_groups()


atexit.register(close_lanes)


def _close_all_locked() -> None:
    for ln in list(_LANES.values()):
        ln.close()
    _LANES.clear()
