"""ClusterCoordinator: the chief schedules functions onto free workers (tf.distribute's API).
Every process runs the same script: on a worker the calls mirror the chief's and run functions
until the chief passes them; a mismatch raises :class:`CallMismatchError`. Exactly once: a lost
worker's function runs again elsewhere, and the servers apply each (task, push) once
(docs/parameter_server.md, "The coordinator")."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from replicator.cluster.ports import LOOPBACK, listen
from replicator.cluster.process_group import on_shutdown
from replicator.cluster.timeouts import resolve_timeout
from replicator.data import InputContext
from replicator.errors import ParameterServerError
from replicator.ps.parameter_server import ParameterServerStrategy
from replicator.ps.task_channel import StopServing, TaskChannel, TaskDispatcher
from replicator.ps.task_queue import (
    CANCELLED,
    DONE,
    DONE_CALL,
    ENDED,
    FAILED,
    FETCH_CALL,
    MARKER_CALL,
    SAME_CALLS_HINT,
    VALUE_DONE_CALL,
    CallMismatchError,
    Marker,
    NoWorkerError,
    Payload,
    RemoteFunctionError,
    Request,
    ResourceRef,
    Task,
    TaskQueue,
    decode,
    encode,
    error_fields,
    function_failed,
    rebuild_error,
)

_ADDRESS_KEY = "replicator/coordinator/address"


def _key(fn: Callable[..., Any]) -> tuple[str, str]:
    """A function's name, the same in every process running the script, and a short form."""
    target = getattr(fn, "__func__", fn)
    name = getattr(target, "__qualname__", type(target).__qualname__)
    code = getattr(target, "__code__", None)
    line = f":{code.co_firstlineno}" if code is not None else ""
    return f"{getattr(target, '__module__', '?')}.{name}{line}", name


class RemoteValue:
    """The result of one scheduled function, available once it ran on some worker."""

    def __init__(self, coordinator: ClusterCoordinator, number: int, name: str) -> None:
        self._coordinator, self._number, self._name = coordinator, number, name

    def fetch(self) -> Any:
        """Wait for the function and return its value (tensors come back as CPU tensors);
        raises what it raised, as ``RemoteFunctionError`` naming the worker and its traceback.
        The chief may call it alone; on a worker it runs functions meanwhile and returns the
        same value, or raises the same class, as on the chief."""
        c = self._coordinator
        if not c.is_chief:
            return c._worker_fetch(self._number)
        task = c._tasks[self._number]
        if c._queue is not None:
            c._queue.wait(task, c._timeout)
        if task.state != DONE:
            raise task.error or ParameterServerError(f"task {task.task_id} ended {task.state}")
        assert task.result is not None
        return decode(*task.result)

    def done(self) -> bool:
        """Whether the function has finished (the chief may call it alone)."""
        c = self._coordinator
        if not c.is_chief:
            return c._worker_done(Request(VALUE_DONE_CALL, 0, self._number, c._scheduled))
        return c._tasks[self._number].state in ENDED

    def __repr__(self) -> str:
        return f"<RemoteValue of {self._name} (schedule #{self._number})>"


class PerWorkerValues(ResourceRef):
    """One value per worker, living on the workers; a function given it as an argument gets
    the value of the worker it runs on."""

    def __init__(self, number: int, local: Any = None) -> None:
        super().__init__(number)
        self._local = local

    def __repr__(self) -> str:
        return f"<PerWorkerValues #{self.number}>"


class PerWorkerDataset:
    """The dataset ``input_fn`` builds on each worker; ``iter()`` gives a per-worker iterator
    (``next(it)`` inside a scheduled function takes the running worker's next element)."""

    def __init__(self, coordinator: ClusterCoordinator, number: int) -> None:
        self._coordinator, self._number = coordinator, number

    def __iter__(self) -> PerWorkerIterator:
        c = self._coordinator
        source = c._datasets[self._number]
        local = iter(source) if source is not None else None
        c._resources.append(local)
        return PerWorkerIterator(len(c._resources) - 1, local if c._inline else None)


class PerWorkerIterator(PerWorkerValues):
    """A per-worker dataset's iterator: ``next()`` of it works inside a scheduled function,
    where it is the running worker's own iterator."""

    def __iter__(self) -> PerWorkerIterator:
        return self

    def __next__(self) -> Any:
        if self._local is not None:  # the chief runs the functions itself
            return next(self._local)
        raise ParameterServerError(
            "next() of a per-worker iterator outside a scheduled function: its elements live "
            "on the workers. HINT: pass the iterator to coordinator.schedule(fn, args=(it,)) "
            "and call next(it) inside fn.")


class ClusterCoordinator:
    """Schedule functions onto the workers of a ``ParameterServerStrategy`` (see the module
    doc). ``timeout_seconds``: how long ``join``/``fetch`` wait without any function
    finishing before they fail (default: the strategy's timeout)."""

    def __init__(self, strategy: ParameterServerStrategy, *,
                 timeout_seconds: float | None = None) -> None:
        if not isinstance(strategy, ParameterServerStrategy):
            raise TypeError(f"ClusterCoordinator takes a ParameterServerStrategy, got "
                            f"{type(strategy).__name__}. HINT: strategy = "
                            "rp.ParameterServerStrategy(); rp.ClusterCoordinator(strategy)")
        if strategy.rejoined:
            # the chief has moved on (its calls are not replayed to a newcomer): this worker's
            # functions already run on the others, so it leaves cleanly
            print(f"[replicator] worker rank {strategy.replica_id} was restarted alone; under a "
                  "ClusterCoordinator a lost worker is not replaced (its functions run on the "
                  "other workers), so it ends here", file=sys.stderr, flush=True)
            raise SystemExit(0)
        self.strategy = strategy
        self._rank = strategy.replica_id
        #: True on the process that schedules (the strategy's chief, worker 0).
        self.is_chief = strategy.is_chief
        self._timeout = resolve_timeout(timeout_seconds, group=strategy._replica_group.group)
        self._workers = list(range(1, strategy.num_replicas_in_sync))
        self._inline = not self._workers
        self._functions: dict[str, Callable[..., Any]] = {}
        self._tasks: dict[int, Task] = {}
        self._datasets: list[Any] = []
        self._resources: list[Any] = []
        self._scheduled = 0
        self._seq = 0  # join() calls
        self._reported = -1  # on a worker: the last failed function its join/done raised
        self._inline_error: BaseException | None = None
        self._finished = False
        self._queue: TaskQueue | None = None
        self._dispatcher: TaskDispatcher | None = None
        self._channel: TaskChannel | None = None
        store = strategy._store
        if self.is_chief and not self._inline:
            self._queue = TaskQueue(self._workers, serial=strategy.staleness == 0)
            sock = listen(LOOPBACK, 0)
            host, port = sock.getsockname()[:2]
            self._dispatcher = TaskDispatcher(self._queue, sock, self._timeout)
            store.set(_ADDRESS_KEY, f"{host}:{port}")
        elif not self.is_chief:
            try:
                store.wait([_ADDRESS_KEY], timedelta(seconds=self._timeout))
            except RuntimeError as exc:
                raise ParameterServerError(
                    f"worker rank {self._rank}: the chief did not publish the coordinator's "
                    f"address within {self._timeout:.0f} s ({exc}). HINT: create the "
                    "ClusterCoordinator on every process, the chief (rank 0) included.") from exc
            host, port = store.get(_ADDRESS_KEY).decode().rsplit(":", 1)
            self._channel = TaskChannel((host, int(port)), self._rank, self._timeout,
                                        self._call, ahead=strategy.staleness != 0)
        on_shutdown(self._finish)

    # -- scheduling ----------------------------------------------------------------------------
    def schedule(self, fn: Callable[..., Any], args: tuple = (),
                 kwargs: dict[str, Any] | None = None) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` to run on a free worker; returns at once. Arguments
        travel without pickle: tensors, numbers, strings, per-worker iterators, and lists,
        tuples and dicts of them (``fn`` itself is the worker's own, found by its name)."""
        if not callable(fn):
            raise TypeError(f"schedule() takes a function, got {type(fn).__name__}")
        key, name = _key(fn)
        self._functions[key] = fn
        number = self._scheduled
        self._scheduled += 1
        value = RemoteValue(self, number, name)
        call = {"args": list(args), "kwargs": dict(kwargs or {})}
        try:
            error = self._take_error() if self.is_chief else None
            if error is not None:
                raise error
            # encoded on every process, so that what the chief refuses a worker refuses too
            payload = encode(call, f"schedule({name}) argument")
        except BaseException as exc:
            if self._queue is not None:  # a worker's fetch() of it raises this too
                self._queue.refuse(number, name, exc)
            raise
        if not self.is_chief:
            return value  # recorded: the chief hands it to a worker
        if self._inline:
            self._tasks[number] = Task(number, key, name, payload)
            self._run_inline(self._tasks[number])
        else:
            assert self._queue is not None
            self._tasks[number] = self._queue.add(key, name, payload, task_id=number)
        return value

    def join(self) -> None:
        """Wait until every scheduled function has finished; raises the first function's error."""
        self._seq += 1
        seq = self._seq
        if not self.is_chief:
            self._mirror_join(seq)
            return
        error: BaseException | None = None
        try:
            if self._queue is not None:
                self._queue.wait(None, self._timeout)
        except (NoWorkerError, CallMismatchError) as exc:
            error = exc
        error = error or self._take_error()
        if self._queue is not None:  # the marker the workers' join() returns with
            value: dict[str, Any] = {"ok": None, **self._counts()}
            if error is not None:
                value.update(error_fields(error))
                value["task"] = next((t.task_id for t in self._tasks.values()
                                      if t.error is error), -1)
            self._queue.post("join", seq, encode(value, "the value of join()"))
        if error is not None:
            raise error

    def done(self) -> bool:
        """Whether every scheduled function has finished (raises a function's error). The
        chief may call it alone; on a worker it runs a function if one is waiting, then
        answers for the functions its own script scheduled."""
        if not self.is_chief:
            return self._worker_done(Request(DONE_CALL, 0, self._reported, self._scheduled))
        error = self._take_error()
        finished = self._queue is None or self._queue.pending() == 0
        if error is not None:
            raise error
        return finished

    def create_per_worker_dataset(self, input_fn: Any) -> PerWorkerDataset:
        """Each worker builds its own dataset: ``input_fn(input_context)`` (or
        ``input_fn()``; a dataset or ``DataLoader`` is taken as is). ``iter()`` of the result
        is a per-worker iterator for ``schedule``'s arguments."""
        number = len(self._datasets)
        dataset = None
        if not self.is_chief or self._inline:  # this process runs the functions
            index = self._workers.index(self._rank) if self._workers else 0
            ctx = InputContext(num_input_pipelines=max(1, len(self._workers)),
                               input_pipeline_id=index,
                               num_replicas_in_sync=max(1, len(self._workers)))
            dataset = input_fn
            if callable(input_fn) and not hasattr(input_fn, "__iter__"):
                takes = len(inspect.signature(input_fn).parameters) > 0
                dataset = input_fn(ctx) if takes else input_fn()
        self._datasets.append(dataset)
        return PerWorkerDataset(self, number)

    def stats(self) -> dict[str, Any]:
        """On the chief: functions scheduled, finished, run again after a lost worker, the
        live and lost workers, and the commit order (task numbers, in finishing order)."""
        if self._queue is None:
            return {"scheduled": self._scheduled, "reruns": 0, "live_workers": [],
                    "lost_workers": [], "commit_order": list(range(self._scheduled))}
        return self._queue.stats()

    # -- the chief's side ------------------------------------------------------------------------
    def _counts(self) -> dict[str, int]:
        """The calls every process must make alike, counted (compared at join and at the end)."""
        return {"scheduled": self._scheduled, "datasets": len(self._datasets),
                "iterators": len(self._resources)}

    def _take_error(self) -> BaseException | None:
        if self._inline:
            error, self._inline_error = self._inline_error, None
            return error
        assert self._queue is not None
        return self._queue.take_error()

    def _run_inline(self, task: Task) -> None:
        if self._inline_error is not None:
            task.state = CANCELLED
            task.error = self._inline_error
            return
        try:
            task.result = self._call(task.task_id, task.key, task.name, *task.args)
            task.state = DONE
        except Exception as exc:  # noqa: BLE001 - raised by join() / fetch(), as remotely
            task.state = FAILED
            task.error = RemoteFunctionError(
                function_failed(task.name, f"task {task.task_id}", self._rank, exc))
            self._inline_error = task.error

    def _finish(self) -> None:
        """At the end of the script: the chief waits for the queued functions, then stops the
        workers; a worker runs functions until then (a mismatch is printed, not raised)."""
        if self._finished:
            return
        self._finished = True
        if self._channel is not None:
            end = Request(MARKER_CALL, -1, -1, self._scheduled)
            try:
                try:
                    self._check_marker(self._channel.serve_until(end), end)
                except StopServing:
                    self._check_counts(decode(*self._channel.stop_value), end.where())
            except CallMismatchError as exc:
                print(f"[replicator] {exc}", file=sys.stderr, flush=True)
            finally:
                self._channel.close(self._scheduled)
        if self._queue is not None and self._dispatcher is not None:
            try:
                self._queue.wait(None, self._timeout)
            except (NoWorkerError, CallMismatchError):
                pass
            self._queue.post("stop", 0, encode(self._counts(), "stop"))
            absent = self._queue.wait_all_gone(self._timeout)
            if absent:
                print(f"[replicator] coordinator: worker rank(s) {absent} never connected "
                      f"within {self._timeout:.0f} s; the chief ends without them",
                      file=sys.stderr, flush=True)
            self._dispatcher.close(self._timeout)

    # -- a worker's side ---------------------------------------------------------------------------
    def _serve(self, request: Request) -> Marker:
        """Run functions until the chief's marker or the answer to ``request`` comes."""
        assert self._channel is not None
        try:
            return self._channel.serve_until(request)
        except StopServing:
            raise CallMismatchError(
                f"worker rank {self._rank} reached {request.describe()} after the chief had "
                f"finished its script. {SAME_CALLS_HINT}") from None

    def _mirror_join(self, seq: int) -> None:
        """A worker's join(): returns (or raises) what the chief's join() did."""
        request = Request(MARKER_CALL, seq, -1, self._scheduled)
        answer = self._check_marker(self._serve(request), request)
        self._check_counts(answer, request.where())
        if "error" in answer:
            self._reported = max(self._reported, int(answer.get("task", -1)))
            raise rebuild_error(answer)

    def _check_marker(self, reply: Marker, request: Request) -> dict[str, Any]:
        """The chief's join marker's value, if it is the one this worker's ``request`` waits
        for (a join's of that number, or none for the end and a fetch)."""
        seq = request.seq if request.call == MARKER_CALL else -1
        if reply.kind != "join" or reply.seq != seq:
            raise CallMismatchError(
                f"worker rank {self._rank} reached {request.where()} but the chief reached "
                f"coordinator.join() (call {reply.seq}). {SAME_CALLS_HINT}")
        return dict(decode(*reply.value))

    def _check_counts(self, chief: dict[str, Any], where: str) -> None:
        mine = self._counts()
        theirs = {k: chief.get(k, v) for k, v in mine.items()}
        if mine != theirs:
            def say(c: dict[str, int]) -> str:
                return (f"{c['scheduled']} function(s) scheduled, {c['datasets']} per-worker "
                        f"dataset(s) and {c['iterators']} iterator(s) of them")

            raise CallMismatchError(
                f"worker rank {self._rank} reached {where} with {say(mine)}; the chief with "
                f"{say(theirs)}. {SAME_CALLS_HINT}")

    def _worker_fetch(self, number: int) -> Any:
        """A worker's fetch(): the chief's value of function ``number`` (or its error)."""
        request = Request(FETCH_CALL, 0, number, self._scheduled)
        reply = self._serve(request)
        if reply.kind:
            self._check_marker(reply, request)
        if reply.failed:
            raise rebuild_error(decode(*reply.value))
        return decode(*reply.value)

    def _worker_done(self, request: Request) -> bool:
        """A worker's done(): whether its functions finished; raises a failure it has not."""
        answer = dict(decode(*self._serve(request).value))
        if answer.get("task", -1) >= 0 and "error" in answer:
            self._reported = int(answer["task"])
            raise rebuild_error(answer)
        return bool(answer["finished"])

    def _call(self, task_id: int, key: str, name: str, args: str,
              tensors: list[torch.Tensor]) -> Payload:
        fn = self._functions.get(key)
        if fn is None:
            raise ParameterServerError(
                f"worker rank {self._rank} has no scheduled function {key}. HINT: every "
                "process runs the same script and schedules the same functions.")
        call = decode(args, tensors, self._resolve)
        self.strategy._begin_task(task_id)
        try:
            value = fn(*call["args"], **call["kwargs"])
        finally:
            self.strategy._begin_task(None)
        return encode(value, f"the value returned by {name}")

    def _resolve(self, number: int) -> Any:
        if not 0 <= number < len(self._resources) or self._resources[number] is None:
            raise ParameterServerError(
                f"worker rank {self._rank} has no per-worker value #{number}. HINT: create "
                "per-worker datasets and their iterators on every process, in the same order.")
        return self._resources[number]
