"""ClusterCoordinator: the chief schedules functions onto free workers (tf.distribute's API).

Every process runs the same script. The chief (worker 0 of a ``ParameterServerStrategy``)
queues each ``schedule(fn, args)`` and returns a :class:`RemoteValue` at once; the other
workers run the functions, whichever is free taking the next one, reading variables from the
servers and pushing their updates there. On a worker the same calls mirror the chief's:
``schedule`` records the function under its name, and ``join``/``fetch``/``done`` (and the end
of the script) run functions until the chief passes the same call, then return what it
returned there (:mod:`replicator.ps.task_channel`). A job whose chief is its only worker runs
each function on the chief when it is scheduled.

Exactly once, where tf.distribute promises at least once: a worker lost while running a
function gives it back, and another worker runs it again; every push of a function carries its
task id and the servers apply each push once, so an update committed before the loss is not
applied again (the function still runs again, for its return value); with several servers a
push is prepared on every server before it is committed on any (``ps/client.py``), so a worker
lost between servers leaves no half-update for the re-run to complete. With ``staleness=0``
the functions run one at a time in schedule order, each reading every update committed before
it: the same parameters as one device fed the same batches in that order.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from replicator.cluster.ports import LOOPBACK, listen
from replicator.cluster.process_group import on_shutdown
from replicator.data import InputContext
from replicator.errors import ParameterServerError
from replicator.ps.parameter_server import ParameterServerStrategy
from replicator.ps.remote_value import PerWorkerDataset, PerWorkerValues, RemoteValue
from replicator.ps.task_channel import StopServing, TaskChannel, TaskDispatcher
from replicator.ps.task_queue import (
    CANCELLED,
    DONE,
    FAILED,
    NoWorkerError,
    Payload,
    RemoteFunctionError,
    Task,
    TaskQueue,
)
from replicator.ps.values import decode, encode

_ADDRESS_KEY = "replicator/coordinator/address"


def _key(fn: Callable[..., Any]) -> tuple[str, str]:
    """A function's name, the same in every process running the script, and a short form."""
    target = getattr(fn, "__func__", fn)
    name = getattr(target, "__qualname__", type(target).__qualname__)
    code = getattr(target, "__code__", None)
    line = f":{code.co_firstlineno}" if code is not None else ""
    return f"{getattr(target, '__module__', '?')}.{name}{line}", name


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
        self._strategy = strategy
        self._rank = strategy.replica_id
        self._timeout = float(timeout_seconds or strategy._timeout)
        self._workers = list(range(1, strategy.num_replicas_in_sync))
        self._inline = not self._workers
        self._functions: dict[str, Callable[..., Any]] = {}
        self._tasks: dict[int, Task] = {}
        self._datasets: list[Any] = []
        self._resources: list[Any] = []
        self._scheduled = 0
        self._seq = 0
        self._inline_error: BaseException | None = None
        self._finished = False
        self._queue: TaskQueue | None = None
        self._dispatcher: TaskDispatcher | None = None
        self._channel: TaskChannel | None = None
        store = strategy._coordination_store()
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
                                        self._run_task, ahead=strategy.staleness != 0)
        on_shutdown(self._finish)

    # -- identity ------------------------------------------------------------------------------
    @property
    def strategy(self) -> ParameterServerStrategy:
        return self._strategy

    @property
    def is_chief(self) -> bool:
        """True on the process that schedules (rank 0)."""
        return self._rank == 0

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
        if not self.is_chief:
            return value  # recorded: the chief hands it to a worker
        self._raise_pending()
        call = {"args": list(args), "kwargs": dict(kwargs or {})}
        payload = encode(call, f"schedule({name}) argument")
        if self._inline:
            task = Task(number, key, name, payload)
            self._tasks[number] = task
            self._run_inline(task)
            return value
        assert self._queue is not None
        self._tasks[number] = self._queue.add(key, name, payload)
        return value

    def join(self) -> None:
        """Wait until every scheduled function has finished; raises the first error of a
        function (the functions queued after it were cancelled)."""
        if not self.is_chief:
            self._mirror("join")
            return
        seq = self._next_seq()
        error: BaseException | None = None
        try:
            if self._queue is not None:
                self._queue.wait(None, self._timeout)
        except NoWorkerError as exc:
            error = exc
        error = error or self._take_error()
        self._post("join", seq, error, None)
        if error is not None:
            raise error

    def done(self) -> bool:
        """Whether every scheduled function has finished (raises a function's error)."""
        if not self.is_chief:
            return bool(self._mirror("done"))
        seq = self._next_seq()
        error = self._take_error()
        finished = self._queue is None or self._queue.pending() == 0
        self._post("done", seq, error, finished)
        if error is not None:
            raise error
        return finished

    def create_per_worker_dataset(self, input_fn: Any) -> PerWorkerDataset:
        """Each worker builds its own dataset: ``input_fn(input_context)`` (or
        ``input_fn()``; a dataset or ``DataLoader`` is taken as is). ``iter()`` of the result
        is a per-worker iterator for ``schedule``'s arguments."""
        number = len(self._datasets)
        if self._runs_functions:
            index = self._workers.index(self._rank) if self._workers else 0
            ctx = InputContext(num_input_pipelines=max(1, len(self._workers)),
                               input_pipeline_id=index,
                               num_replicas_in_sync=max(1, len(self._workers)))
            if callable(input_fn) and not hasattr(input_fn, "__iter__"):
                takes = len(inspect.signature(input_fn).parameters) > 0
                dataset = input_fn(ctx) if takes else input_fn()
            else:
                dataset = input_fn
            self._datasets.append(dataset)
        else:
            self._datasets.append(None)
        return PerWorkerDataset(lambda: self._iterator(number))

    def _iterator(self, dataset: int) -> PerWorkerIterator:
        number = len(self._resources)
        source = self._datasets[dataset]
        local = iter(source) if source is not None else None
        self._resources.append(local)
        return PerWorkerIterator(number, local if self._inline else None)

    @property
    def _runs_functions(self) -> bool:
        return not self.is_chief or self._inline

    def stats(self) -> dict[str, Any]:
        """On the chief: functions scheduled, finished, run again after a lost worker, the
        live and lost workers, and the commit order (task numbers, in finishing order)."""
        if self._queue is None:
            return {"scheduled": self._scheduled, "reruns": 0, "live_workers": [],
                    "lost_workers": [], "commit_order": list(range(self._scheduled))}
        out = self._queue.stats()
        out["commit_order"] = list(self._queue.commit_order)
        return out

    # -- the chief's side ------------------------------------------------------------------------
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _post(self, kind: str, seq: int, error: BaseException | None, value: Any) -> None:
        if self._queue is None:
            return
        payload = encode({"error": f"{type(error).__name__}: {error}"} if error is not None
                         else {"ok": value}, f"the value of {kind}()")
        self._queue.post(kind, seq, payload)

    def _take_error(self) -> BaseException | None:
        if self._inline:
            error, self._inline_error = self._inline_error, None
            return error
        assert self._queue is not None
        return self._queue.take_error()

    def _raise_pending(self) -> None:
        error = self._take_error()
        if error is not None:
            raise error

    def _fetch(self, value: RemoteValue) -> Any:
        if value._coordinator is not self:
            raise ValueError("this RemoteValue belongs to another ClusterCoordinator")
        if not self.is_chief:
            return self._mirror("fetch")
        seq = self._next_seq()
        task = self._tasks[value._number]
        try:
            if self._queue is not None:
                self._queue.wait(task, self._timeout)
        except NoWorkerError as exc:
            self._post("fetch", seq, exc, None)
            raise
        if task.state != DONE:
            error = task.error or ParameterServerError(f"task {task.task_id} ended {task.state}")
            self._post("fetch", seq, error, None)
            raise error
        assert task.result is not None
        result = decode(*task.result)
        if self._queue is not None:
            self._queue.post("fetch", seq, encode({"ok": result}, "a fetched value"))
        return result

    def _value_done(self, value: RemoteValue) -> bool:
        if not self.is_chief:
            return bool(self._mirror("done"))
        seq = self._next_seq()
        finished = self._tasks[value._number].state in (DONE, FAILED, CANCELLED)
        self._post("done", seq, None, finished)
        return finished

    def _run_inline(self, task: Task) -> None:
        if self._inline_error is not None:
            task.state = CANCELLED
            task.error = self._inline_error
            return
        try:
            task.result = self._call(task.task_id, task.key, task.name, *task.args)
            task.state = DONE
        except Exception as exc:  # noqa: BLE001 - raised by join() / fetch(), as remotely
            import traceback

            task.state = FAILED
            task.error = RemoteFunctionError(
                f"scheduled function {task.name} (task {task.task_id}) raised on worker rank "
                f"{self._rank}: {type(exc).__name__}: {exc}\nworker traceback:\n"
                f"{traceback.format_exc()}")
            self._inline_error = task.error

    def _finish(self) -> None:
        """At the end of the script: the chief waits for the functions still queued, then
        stops the workers; a worker runs functions until then."""
        if self._finished:
            return
        self._finished = True
        if self._channel is not None:
            try:
                self._channel.serve_until("end", -1)
            except StopServing:
                pass
            finally:
                self._channel.close()
        if self._queue is not None and self._dispatcher is not None:
            try:
                self._queue.wait(None, self._timeout)
            except NoWorkerError:
                pass
            self._queue.post("stop", 0, encode(None, "stop"))
            self._dispatcher.close(self._timeout)

    # -- a worker's side ---------------------------------------------------------------------------
    def _mirror(self, kind: str) -> Any:
        """Run functions until the chief passes the same call; return what it returned."""
        seq = self._next_seq()
        assert self._channel is not None
        try:
            text, tensors = self._channel.serve_until(kind, seq)
        except StopServing:
            raise ParameterServerError(
                f"worker rank {self._rank} reached coordinator.{kind}() (call {seq}) after the "
                "chief had finished. HINT: every process runs the same script; make the "
                "coordinator calls the same on every process.") from None
        answer = decode(text, tensors)
        if "error" in answer:
            raise RemoteFunctionError(answer["error"])
        return answer["ok"]

    def _run_task(self, task_id: int, attempt: int, key: str, name: str, args: str,
                  tensors: list[torch.Tensor]) -> Payload:
        return self._call(task_id, key, name, args, tensors)

    def _call(self, task_id: int, key: str, name: str, args: str,
              tensors: list[torch.Tensor]) -> Payload:
        fn = self._functions.get(key)
        if fn is None:
            raise ParameterServerError(
                f"worker rank {self._rank} has no scheduled function {key}. HINT: every "
                "process runs the same script and schedules the same functions.")
        call = decode(args, tensors, self._resolve)
        self._strategy._begin_task(task_id)
        try:
            value = fn(*call["args"], **call["kwargs"])
        finally:
            self._strategy._end_task()
        return encode(value, f"the value returned by {name}")

    def _resolve(self, number: int) -> Any:
        if not 0 <= number < len(self._resources) or self._resources[number] is None:
            raise ParameterServerError(
                f"worker rank {self._rank} has no per-worker value #{number}. HINT: create "
                "per-worker datasets and their iterators on every process, in the same order.")
        return self._resources[number]
