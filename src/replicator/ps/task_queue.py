"""The coordinator's task queue: scheduled functions, who runs them, and the chief's markers.

A free worker gets the answer to its ``fetch``/``done``, the next marker, or the next task its
own script has scheduled (a :class:`Request` says which); a lost worker's tasks go back to the
front. ``serial`` (``staleness=0``) hands out one task at a time; otherwise a worker may take
one *ahead*. The first failure cancels the queued tasks, as in tf.distribute. Arguments and
results travel without pickle: a JSON skeleton and the tensors it refers to (:func:`encode`)."""

from __future__ import annotations

import json
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from replicator.errors import ParameterServerError

#: A value on the wire: JSON text and the tensors it refers to (:func:`encode`).
Payload = tuple[str, list[torch.Tensor]]

#: Resolves a per-worker resource's number to the worker's own object.
Resolver = Callable[[int], Any]


class ResourceRef:
    """A per-worker resource by number (each worker resolves it to its own object)."""

    def __init__(self, number: int) -> None:
        self.number = number

    def __repr__(self) -> str:
        return f"ResourceRef({self.number})"


def encode(value: Any, what: str) -> Payload:
    """``value`` as JSON text and its tensors; ``what`` names it in errors."""
    tensors: list[torch.Tensor] = []

    def walk(v: Any, path: str) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, torch.Tensor):
            tensors.append(v.detach().cpu().contiguous())
            return {"t": len(tensors) - 1}
        if isinstance(v, ResourceRef):  # per-worker values too
            return {"r": v.number}
        if isinstance(v, (list, tuple)):
            return {"l" if isinstance(v, list) else "u": [walk(x, f"{path}[{i}]")
                                                          for i, x in enumerate(v)]}
        if isinstance(v, dict):
            bad = [k for k in v if not isinstance(k, str)]
            if bad:
                raise ParameterServerError(f"{what}{path} is a dict with key {bad[0]!r}; only "
                                           "string keys travel. HINT: use string keys.")
            return {"d": {k: walk(x, f"{path}[{k!r}]") for k, x in v.items()}}
        raise ParameterServerError(
            f"{what}{path} has type {type(v).__name__}, which cannot travel between the "
            "coordinator and a worker (nothing is pickled). HINT: pass tensors, numbers, "
            "strings, None, per-worker iterators, or lists, tuples and dicts of them; build "
            "other objects inside the function.")

    return json.dumps(walk(value, "")), tensors


def decode(text: str, tensors: list[torch.Tensor], resolve: Resolver | None = None) -> Any:
    """The value :func:`encode` took apart; ``resolve`` turns resource numbers into objects."""

    def walk(v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        if "t" in v:
            return tensors[v["t"]]
        if "r" in v:
            return ResourceRef(v["r"]) if resolve is None else resolve(v["r"])
        if "l" in v:
            return [walk(x) for x in v["l"]]
        if "u" in v:
            return tuple(walk(x) for x in v["u"])
        return {k: walk(x) for k, x in v["d"].items()}

    return walk(json.loads(text))


QUEUED, RUNNING, DONE, FAILED, CANCELLED = "queued", "running", "done", "failed", "cancelled"
#: The states of a task that has finished.
ENDED = (DONE, FAILED, CANCELLED)


class RemoteFunctionError(ParameterServerError):
    """A scheduled function raised on a worker; the message has the worker's rank, the task
    and the worker's traceback."""


class TaskCancelledError(ParameterServerError):
    """A scheduled function never ran because an earlier one failed."""


class NoWorkerError(ParameterServerError):
    """Scheduled functions wait and no worker is left to run them."""


class CallMismatchError(ParameterServerError):
    """The chief and a worker reached different coordinator calls (``schedule``, ``join``,
    ``create_per_worker_dataset`` must be the same on every process)."""


#: How to fix a :class:`CallMismatchError`.
SAME_CALLS_HINT = ("HINT: every process runs the same script; make schedule(), join() and "
                   "create_per_worker_dataset() the same on every process (no condition on the "
                   "rank around them); fetch() and done() may be called on the chief only.")

#: The errors a coordinator call may raise, by name: a worker raises the class the chief did.
ERRORS: dict[str, type[ParameterServerError]] = {
    cls.__name__: cls for cls in (ParameterServerError, RemoteFunctionError, TaskCancelledError,
                                  NoWorkerError, CallMismatchError)}

def error_fields(error: BaseException) -> dict[str, str]:
    """An error as it travels to a worker (:func:`rebuild_error` makes it again there)."""
    name = type(error).__name__
    if name in ERRORS:
        return {"type": name, "error": str(error)}
    return {"type": "ParameterServerError", "error": f"{name}: {error}"}


def rebuild_error(fields: dict[str, Any]) -> ParameterServerError:
    """The error the chief raised, of the same class, from :func:`error_fields`."""
    return ERRORS.get(str(fields.get("type")), ParameterServerError)(fields["error"])


def function_failed(name: str, task: str, rank: int, exc: BaseException) -> str:
    """The text of a :class:`RemoteFunctionError`: the function, ``task``, the worker's rank and
    its traceback (call it where ``exc`` is being handled)."""
    return (f"scheduled function {name} ({task}) raised on worker rank {rank}: "
            f"{type(exc).__name__}: {exc}\nworker traceback:\n{traceback.format_exc()}")


#: What a worker's call waits for (:class:`Request`): the chief's marker (``join`` or, with
#: ``seq`` -1, the end), a function's value, whether all (``DONE``) or one function finished.
MARKER_CALL, FETCH_CALL, DONE_CALL, VALUE_DONE_CALL = range(4)
#: Functions a worker's script may have scheduled when it sent no :class:`Request`.
UNLIMITED = 1 << 62


@dataclass
class Task:
    """One scheduled function call."""

    task_id: int
    key: str
    name: str
    args: Payload
    state: str = QUEUED
    attempts: int = 0
    ran_on: list[int] = field(default_factory=list)
    result: Payload | None = None
    error: BaseException | None = None


@dataclass
class Request:
    """A worker's coordinator call: ``call`` (``*_CALL``), the ``join`` number ``seq`` it
    waits for, the function ``task`` it asks about (``DONE_CALL``: the last failure it
    raised) and ``horizon``, the functions its script has scheduled so far."""

    call: int = MARKER_CALL
    seq: int = 0
    task: int = -1
    horizon: int = UNLIMITED

    def where(self) -> str:
        """The call, as an error names it."""
        if self.call == MARKER_CALL:
            return "the end of its script" if self.seq < 0 else \
                f"coordinator.join() (call {self.seq})"
        return f"fetch() of schedule #{self.task}" if self.call == FETCH_CALL else "done()"

    def describe(self) -> str:
        return f"{self.where()} having scheduled {self.horizon} function(s)"


@dataclass
class Answer:
    """A worker's ``fetch``/``done`` answered: the function ``task`` (its value or error), or
    ``finished`` and the first failure after the worker's last (``task``, -1: none)."""

    call: int
    task: Task | None
    finished: bool = True


@dataclass
class Marker:
    """The chief passed a synchronisation point: ``kind`` (join, stop), its sequence number and
    the value a worker's mirror of the call returns. What ends a worker's wait is one too, or
    with ``kind`` empty the answer to its ``fetch``/``done`` (``failed``: an error's fields)."""

    kind: str
    seq: int
    value: Payload
    failed: bool = False


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
        #: Per worker, its last :class:`Request`; ``waiting``: those blocked in it; ``ended``:
        #: the workers whose script ended (said BYE), with the functions it had scheduled.
        self.requests: dict[int, Request] = {}
        self.waiting: set[int] = set()
        self.ended: dict[int, int] = {}
        self.finished = self.reruns = 0
        self.commit_order: list[int] = []

    # -- the chief's side --------------------------------------------------------------------
    def add(self, key: str, name: str, args: Payload, task_id: int | None = None) -> Task:
        """Queue a function; ``task_id``: its schedule number (default: the next one)."""
        with self.cond:
            task = Task(len(self.tasks) if task_id is None else task_id, key, name, args)
            self.tasks[task.task_id] = task
            self.queue.append(task)
            self.cond.notify_all()
            return task

    def refuse(self, task_id: int, name: str, error: BaseException) -> None:
        """Schedule number ``task_id`` raised on the chief: a worker's ``fetch`` raises it too."""
        with self.cond:
            self.tasks[task_id] = Task(task_id, "", name, ("null", []), state=FAILED, error=error)
            self.cond.notify_all()

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
                if task is not None and task.state in ENDED:
                    return
                if task is None and (not self.queue and not self._running()
                                     or self.error is not None):
                    return
                if self.finished != finished:
                    finished, progress = self.finished, time.monotonic()
                stuck = self._stuck()
                if stuck:
                    raise CallMismatchError(
                        f"the chief waits for scheduled function {self.queue[0].name} (schedule "
                        f"#{self.queue[0].task_id}) but no worker can run it: {stuck}. "
                        + SAME_CALLS_HINT)
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

    def _stuck(self) -> str:
        """Why no worker will take the next queued function (the scripts differ), or ``""``:
        nothing runs, and every worker ended or waits in a call whose own schedule stopped
        short of it (a worker lost, or not connected yet, is not a mismatch)."""
        if not self.queue or self._running():
            return ""
        head, says = self.queue[0].task_id, []
        for w in self.expected:
            if w in self.ended and self.ended[w] <= head:
                says.append(f"worker rank {w} reached the end of its script having scheduled "
                            f"{self.ended[w]} function(s)")
            elif w in self.live and w in self.waiting and self.requests[w].horizon <= head \
                    and not self.markers[w] and self._answer(self.requests[w]) is None:
                says.append(f"worker rank {w} waits in {self.requests[w].describe()}")
            elif w not in self.gone:
                return ""
        return "; ".join(says)

    def _answer(self, request: Request) -> Answer | None:
        """The answer to a ``fetch``/``done`` request, if it has one now."""
        if request.call in (FETCH_CALL, VALUE_DONE_CALL):
            task = self.tasks.get(request.task)
            ended = task is not None and task.state in ENDED
            if request.call == VALUE_DONE_CALL:
                return Answer(VALUE_DONE_CALL, None, ended)
            return Answer(FETCH_CALL, task) if ended else None
        if request.call == DONE_CALL:
            mine = [t for i, t in self.tasks.items() if i < request.horizon]
            failed = next((t for t in sorted(mine, key=lambda t: t.task_id)
                           if t.task_id > request.task and t.state == FAILED), None)
            return Answer(DONE_CALL, failed, all(t.state in ENDED for t in mine))
        return None

    # -- the workers' side -------------------------------------------------------------------
    def connect(self, worker: int) -> None:
        with self.cond:
            if worker not in self.markers:
                raise ParameterServerError(f"worker rank {worker} is not one of the "
                                           f"coordinator's workers {self.expected}")
            self.live.add(worker)
            self.gone.discard(worker)
            self.ended.pop(worker, None)
            self.cond.notify_all()

    def ask(self, worker: int, request: Request) -> None:
        """``worker``'s script is in the call ``request`` (its later asks are for it too)."""
        with self.cond:
            self.requests[worker] = request
            self.waiting.discard(worker)

    def next_for(self, worker: int, timeout: float, ahead: bool = False
                 ) -> Marker | Task | Answer | None:
        """What ``worker``'s call (its :class:`Request`) gets next: an answer, a marker or a task,
        else ``None`` after ``timeout`` s (a heartbeat); ``ahead``: answered at once, never with
        a task when ``serial``."""
        deadline = time.monotonic() + (0.0 if ahead else timeout)
        with self.cond:
            request = self.requests.get(worker, Request())
            while True:
                item = self._next_item(worker, request, ahead)
                if item is not None:
                    self.waiting.discard(worker)
                    return item
                if request.call in (DONE_CALL, VALUE_DONE_CALL):  # never waits
                    return self._answer(request)
                self.waiting.add(worker)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)

    def _next_item(self, worker: int, request: Request, ahead: bool
                   ) -> Marker | Task | Answer | None:
        if request.call == FETCH_CALL:
            answer = self._answer(request)
            if answer is not None:
                return answer
        markers = self.markers[worker]
        if markers and request.call in (MARKER_CALL, FETCH_CALL):
            return markers.popleft()
        mine = self.running.setdefault(worker, [])
        if self.queue and self.queue[0].task_id < request.horizon and \
                len(mine) < 1 + int(ahead) and not (self.serial and (ahead or self._running())):
            task = self.queue.popleft()
            task.state = RUNNING
            task.attempts += 1
            task.ran_on.append(worker)
            mine.append(task)
            return task
        return None

    def leave(self, worker: int, horizon: int) -> None:
        """``worker``'s script ended (it said BYE) having scheduled ``horizon`` functions."""
        with self.cond:
            self.ended[worker] = horizon
            self.lost(worker)

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
            self.error = self.error or error
            # tf.distribute's rule: the first failure cancels the rest; a task this worker took
            # ahead has not started (the worker drops it after a failure) and goes with them
            ahead = self.running.pop(worker, [])
            while ahead or self.queue:
                other = ahead.pop(0) if ahead else self.queue.popleft()
                other.state = CANCELLED
                other.error = TaskCancelledError(
                    f"scheduled function {other.name} (task {other.task_id}) was cancelled "
                    f"because task {task_id} failed first: {error}")
                self.finished += 1

    def lost(self, worker: int) -> Task | None:
        """``worker`` is gone: its tasks go back to the front of the queue in order; the one it ran
        (returned) runs again, one taken ahead had not started and counts no attempt."""
        with self.cond:
            self.live.discard(worker)
            self.gone.add(worker)
            self.waiting.discard(worker)
            self.markers[worker].clear()
            tasks = [t for t in self.running.pop(worker, []) if t.state == RUNNING]
            for task in reversed(tasks):
                task.state = QUEUED
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
        self.finished += 1
        self.cond.notify_all()
        return task

    def wait_all_gone(self, timeout: float) -> list[int]:
        """Until every expected worker has connected and left, at most ``timeout`` s (a worker
        still starting gets the chief's markers); the workers that never came."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while len(self.gone) < len(self.expected):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(min(left, 1.0))
            return [w for w in self.expected if w not in self.gone and w not in self.live]

    def stats(self) -> dict[str, Any]:
        with self.cond:
            return {"scheduled": len(self.tasks), "reruns": self.reruns,
                    "done": sum(t.state == DONE for t in self.tasks.values()),
                    "live_workers": sorted(self.live), "lost_workers": sorted(self.gone),
                    "commit_order": list(self.commit_order)}
