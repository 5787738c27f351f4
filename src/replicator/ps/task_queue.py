"""The coordinator's task queue: scheduled functions, who runs them, and the chief's markers.

The chief schedules functions (:class:`Task`); a worker that is free asks for work and gets,
in this order, the next *marker* meant for it (the chief passed a ``join``/``fetch``/``done``
call, or stops: see :mod:`replicator.ps.task_channel`) or the next queued task. A worker that is
lost while running a task gives it back to the front of the queue with its attempt count raised:
the task runs again elsewhere, and the servers apply its update once (its id travels with every
push; see :mod:`replicator.ps.task_ledger`). ``serial=True`` (``staleness=0``) hands out a task
only when none is running, so each function reads every update committed before it and its own
update is applied alone. Otherwise a worker running a task may take the next one *ahead*
(``next_for(..., ahead=True)``): it starts the moment the first one ends, without a round trip
to the chief between them; a worker lost with a task ahead gives both back, in order.

The first function to raise cancels every task still queued (as tf.distribute does); the error
is raised by the chief's next ``join``/``fetch``/``schedule``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from replicator.errors import ParameterServerError

#: A value on the wire: JSON text and the tensors it refers to (:mod:`replicator.ps.values`).
Payload = tuple[str, list[torch.Tensor]]

QUEUED, RUNNING, DONE, FAILED, CANCELLED = "queued", "running", "done", "failed", "cancelled"


class RemoteFunctionError(ParameterServerError):
    """A scheduled function raised on a worker; the message has the worker's rank, the task
    and the worker's traceback."""


class TaskCancelledError(ParameterServerError):
    """A scheduled function never ran because an earlier one failed."""


class NoWorkerError(ParameterServerError):
    """Scheduled functions wait and no worker is left to run them."""


@dataclass
class Task:
    """One scheduled function call."""

    task_id: int
    key: str
    name: str
    args: Payload
    state: str = QUEUED
    attempts: int = 0
    worker: int | None = None
    ran_on: list[int] = field(default_factory=list)
    result: Payload | None = None
    error: BaseException | None = None
    finished_at: float = 0.0


@dataclass
class Marker:
    """The chief passed a synchronisation point: ``kind`` (join, fetch, done, stop), its
    sequence number and the value a worker's mirror of the call returns."""

    kind: str
    seq: int
    value: Payload


class TaskQueue:
    """Tasks and markers for the workers ``expected`` (ranks), under one condition."""

    def __init__(self, expected: list[int], serial: bool) -> None:
        self.cond = threading.Condition()
        self.serial = serial
        self.expected = list(expected)
        self.queue: deque[Task] = deque()
        self.tasks: dict[int, Task] = {}
        self.markers: dict[int, deque[Marker]] = {w: deque() for w in expected}
        self.live: set[int] = set()
        self.gone: set[int] = set()
        #: Per worker, the tasks handed to it and not finished: the one it runs first, then
        #: at most one taken ahead.
        self.running: dict[int, list[Task]] = {}
        self.error: BaseException | None = None
        self.next_id = 0
        self.finished = 0
        self.reruns = 0
        self.commit_order: list[int] = []

    # -- the chief's side --------------------------------------------------------------------
    def add(self, key: str, name: str, args: Payload) -> Task:
        with self.cond:
            task = Task(self.next_id, key, name, args)
            self.next_id += 1
            self.tasks[task.task_id] = task
            self.queue.append(task)
            self.cond.notify_all()
            return task

    def post(self, kind: str, seq: int, value: Payload) -> None:
        """A marker for every worker not lost (they mirror the chief's call with it)."""
        with self.cond:
            for w, markers in self.markers.items():
                if w not in self.gone:
                    markers.append(Marker(kind, seq, value))
            self.cond.notify_all()

    def take_error(self) -> BaseException | None:
        with self.cond:
            error, self.error = self.error, None
            return error

    def pending(self) -> int:
        with self.cond:
            return len(self.queue) + self._running()

    def _running(self) -> int:
        return sum(len(tasks) for tasks in self.running.values())

    def wait(self, task: Task | None, timeout: float) -> None:
        """Until ``task`` (``None``: every task) is finished, a function failed, or no worker
        is left; :class:`NoWorkerError` then, or after ``timeout`` s without progress."""
        with self.cond:
            progress = time.monotonic()
            finished = -1
            while True:
                if task is not None and task.state in (DONE, FAILED, CANCELLED):
                    return
                if task is None and (not self.queue and not self._running()
                                     or self.error is not None):
                    return
                if self.finished != finished:
                    finished, progress = self.finished, time.monotonic()
                if not self.live and len(self.gone) >= len(self.expected):
                    raise NoWorkerError(
                        f"{len(self.queue) + self._running()} scheduled function(s) wait and "
                        f"every worker ({len(self.expected)}) is lost. HINT: see the workers' "
                        "output for why they ended; launch with --max-restarts to replace them.")
                if time.monotonic() - progress > timeout:
                    raise NoWorkerError(
                        f"no scheduled function finished for {timeout:.0f} s ({len(self.live)} "
                        f"worker(s) connected, {self._running()} running, {len(self.queue)} "
                        "queued). HINT: a worker connects when its script creates the "
                        "ClusterCoordinator; check that every worker runs the same script.")
                self.cond.wait(1.0)

    # -- the workers' side -------------------------------------------------------------------
    def connect(self, worker: int) -> None:
        with self.cond:
            if worker not in self.markers:
                raise ParameterServerError(f"worker rank {worker} is not one of the "
                                           f"coordinator's workers {self.expected}")
            self.live.add(worker)
            self.gone.discard(worker)
            self.cond.notify_all()

    def next_for(self, worker: int, timeout: float, ahead: bool = False
                 ) -> Marker | Task | None:
        """The next marker for ``worker``, else a task it may run, else ``None`` after
        ``timeout`` s (the worker asks again: a heartbeat). ``ahead``: the worker is running a
        task and asks for the next one now; answered at once, and never with a task when
        functions run one at a time (``serial``)."""
        deadline = time.monotonic() + (0.0 if ahead else timeout)
        with self.cond:
            while True:
                markers = self.markers[worker]
                if markers:
                    return markers.popleft()
                mine = self.running.setdefault(worker, [])
                if self.queue and len(mine) < 1 + int(ahead) and \
                        not (self.serial and (ahead or self._running())):
                    task = self.queue.popleft()
                    task.state, task.worker = RUNNING, worker
                    task.attempts += 1
                    task.ran_on.append(worker)
                    mine.append(task)
                    return task
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)

    def complete(self, worker: int, task_id: int, result: Payload) -> None:
        with self.cond:
            task = self._finish(worker, task_id)
            if task is not None:
                task.state, task.result = DONE, result
                self.commit_order.append(task_id)

    def fail(self, worker: int, task_id: int, error: BaseException) -> None:
        with self.cond:
            task = self._finish(worker, task_id)
            if task is None:
                return
            task.state, task.error = FAILED, error
            if self.error is None:
                self.error = error
            # tf.distribute's rule: the first failure cancels the rest; a task this worker took
            # ahead has not started (the worker drops it after a failure) and goes with them
            ahead = self.running.pop(worker, [])
            while ahead or self.queue:
                other = ahead.pop(0) if ahead else self.queue.popleft()
                other.state = CANCELLED
                other.error = TaskCancelledError(
                    f"scheduled function {other.name} (task {other.task_id}) was cancelled "
                    f"because task {task_id} failed first: {error}")
                other.finished_at = time.monotonic()
                self.finished += 1

    def lost(self, worker: int) -> Task | None:
        """``worker`` is gone: its tasks go back to the front of the queue, in their order;
        the one it was running (returned) runs again, one it had taken ahead had not started
        (a worker starts it after sending the first one's result) and counts no attempt."""
        with self.cond:
            self.live.discard(worker)
            self.gone.add(worker)
            self.markers[worker].clear()
            tasks = [t for t in self.running.pop(worker, []) if t.state == RUNNING]
            for task in reversed(tasks):
                task.state, task.worker = QUEUED, None
                self.queue.appendleft(task)
            for task in tasks[1:]:
                task.attempts -= 1
                task.ran_on.pop()
            self.reruns += bool(tasks)
            self.cond.notify_all()
            return tasks[0] if tasks else None

    def _finish(self, worker: int, task_id: int) -> Task | None:
        mine = self.running.get(worker, [])
        task = next((t for t in mine if t.task_id == task_id), None)
        if task is None:
            return None
        mine.remove(task)
        task.finished_at = time.monotonic()
        self.finished += 1
        self.cond.notify_all()
        return task

    def stats(self) -> dict[str, Any]:
        with self.cond:
            return {"scheduled": len(self.tasks), "reruns": self.reruns,
                    "done": sum(t.state == DONE for t in self.tasks.values()),
                    "live_workers": sorted(self.live), "lost_workers": sorted(self.gone)}
