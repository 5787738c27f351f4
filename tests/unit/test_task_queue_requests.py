"""The coordinator's task queue answers each worker's call (its Request): only functions its
own script scheduled, fetch()/done() from the tasks' states, and a mismatch named at once."""

from __future__ import annotations

import pytest

from replicator.errors import ParameterServerError
from replicator.ps.task_queue import (
    DONE_CALL,
    FETCH_CALL,
    MARKER_CALL,
    Answer,
    CallMismatchError,
    Marker,
    NoWorkerError,
    RemoteFunctionError,
    Request,
    TaskCancelledError,
    TaskQueue,
    error_fields,
    rebuild_error,
)

NOTHING = ("null", [])


def _queue(workers: list[int], serial: bool = True) -> TaskQueue:
    queue = TaskQueue(workers, serial=serial)
    for w in workers:
        queue.connect(w)
    return queue


def test_a_worker_gets_only_functions_its_script_scheduled():
    queue = _queue([1])
    a, b = (queue.add("f", "f", NOTHING, task_id=i) for i in range(2))
    queue.ask(1, Request(MARKER_CALL, 1, -1, horizon=1))
    assert queue.next_for(1, 0.01) is a
    queue.complete(1, a.task_id, ("1", []))
    assert queue.next_for(1, 0.01) is None  # b is beyond the worker's schedule
    queue.ask(1, Request(MARKER_CALL, 1, -1, horizon=2))
    assert queue.next_for(1, 0.01) is b


def test_fetch_is_answered_from_the_task_and_done_never_waits():
    queue = _queue([1])
    a = queue.add("f", "f", NOTHING, task_id=0)
    queue.post("join", 1, NOTHING)  # a marker the worker's fetch does not wait for
    queue.ask(1, Request(DONE_CALL, 0, -1, horizon=1))
    assert queue.next_for(1, 5.0) is a  # a function first, if one is waiting
    queue.complete(1, a.task_id, ("7", []))
    queue.ask(1, Request(FETCH_CALL, 0, 0, horizon=1))
    answer = queue.next_for(1, 5.0)
    assert isinstance(answer, Answer) and answer.task is a
    queue.ask(1, Request(DONE_CALL, 0, -1, horizon=1))
    done = queue.next_for(1, 5.0)
    assert isinstance(done, Answer) and done.finished and done.task is None
    queue.ask(1, Request(MARKER_CALL, 1, -1, horizon=1))
    assert isinstance(queue.next_for(1, 0.01), Marker)


def test_the_chief_waiting_for_what_no_worker_scheduled_is_a_mismatch_at_once():
    queue = _queue([1, 2])
    queue.add("f", "f", NOTHING, task_id=0)
    queue.ask(1, Request(MARKER_CALL, 1, -1, horizon=0))
    assert queue.next_for(1, 0.01) is None  # waits in join(), having scheduled nothing
    queue.leave(2, 0)  # ended its script, having scheduled nothing
    with pytest.raises(CallMismatchError) as info:
        queue.wait(None, 60.0)
    text = str(info.value)
    assert "worker rank 1 waits in coordinator.join() (call 1) having scheduled 0" in text
    assert "worker rank 2 reached the end of its script having scheduled 0" in text


def test_lost_workers_are_no_mismatch():
    queue = _queue([1])
    queue.add("f", "f", NOTHING, task_id=0)
    queue.lost(1)
    with pytest.raises(NoWorkerError, match="every worker"):
        queue.wait(None, 60.0)


@pytest.mark.parametrize("error", [RemoteFunctionError("x"), TaskCancelledError("y"),
                                   CallMismatchError("z"), ValueError("w")])
def test_an_error_travels_as_its_own_class(error):
    back = rebuild_error(error_fields(error))
    expected = ParameterServerError if isinstance(error, ValueError) else type(error)
    assert type(back) is expected and str(error) in str(back)
