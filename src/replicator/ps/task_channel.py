"""The connection between the coordinator (the chief) and each worker that runs its functions:
a worker's coordinator call (``join``, ``fetch``, ``done``, the end of its script) asks the chief
for work and runs tasks until the chief's matching marker or answer comes (see
:mod:`replicator.ps.task_queue`; the messages are listed in docs/parameter_server.md)."""

from __future__ import annotations

import json
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from replicator.errors import ParameterServerError
from replicator.ps.messages import (
    Connection,
    Message,
    Outgoing,
    PeerLostError,
    accept_connections,
    tensor_text,
    text_tensor,
)
from replicator.ps.task_queue import (
    DONE,
    FETCH_CALL,
    Answer,
    Marker,
    Payload,
    RemoteFunctionError,
    Request,
    TaskQueue,
    encode,
    error_fields,
    function_failed,
)

HELLO, ASK, TASK, RESULT, FAILED, MARKER, IDLE, TENSOR, BYE, ANSWER = range(1, 11)

#: Seconds between heartbeats while a worker waits for work.
HEARTBEAT_SECONDS = 2.0

#: ``b`` of an ``ASK`` for the next task while one runs, and of a ``RESULT`` that asks nothing.
AHEAD = 1


def _send_payload(conn: Connection, kind: int, var_id: int, payload: Payload, a: int = 0,
                  b: int = 0) -> None:
    text, tensors = payload
    out: list[Outgoing] = [(kind, var_id, 0, text_tensor(text), a, b, len(tensors))]
    conn.send_many(out + [(TENSOR, i, 0, t, 0, 0, 0) for i, t in enumerate(tensors)])


def _answer_payload(answer: Answer) -> tuple[bool, Payload]:
    """What a worker's ``fetch``/``done`` gets: (an error?, the value or the error's fields)."""
    task = answer.task
    if answer.call == FETCH_CALL:
        assert task is not None
        if task.state == DONE and task.result is not None:
            return False, task.result
        error = task.error or ParameterServerError(f"task {task.task_id} ended {task.state}")
        return True, encode(error_fields(error), "an error")
    value: dict[str, Any] = {"finished": answer.finished,
                             "task": -1 if task is None else task.task_id}
    if task is not None and task.error is not None:
        value.update(error_fields(task.error))
    return False, encode(value, "the value of done()")


def _read_tensors(conn: Connection, count: int) -> list[torch.Tensor]:
    out = []
    for _ in range(count):
        msg = conn.receive("receiving a value's tensors")
        if msg.kind != TENSOR or msg.payload is None:
            raise ParameterServerError(f"{conn.peer} sent message kind {msg.kind} where a "
                                       "tensor of a value was expected")
        out.append(msg.payload.clone())  # the receive buffer is not ours to keep
    return out


class TaskDispatcher:
    """The chief's side: accepts the workers on ``sock`` and serves ``queue`` to them."""

    def __init__(self, queue: TaskQueue, sock: socket.socket, timeout_seconds: float) -> None:
        self.queue, self.sock = queue, sock
        self.threads: list[threading.Thread] = []
        self.closing = False
        threading.Thread(
            target=accept_connections, daemon=True, name="coordinator-accept",
            args=(sock, timeout_seconds, self._handle, "coordinator-conn",
                  lambda: not self.closing, self.threads)).start()

    def _handle(self, conn: Connection) -> None:
        worker = -1
        try:
            hello = conn.receive("waiting for a worker's HELLO")
            if hello.kind != HELLO:
                return
            worker = hello.a
            conn.peer = f"worker rank {worker}"
            self.queue.connect(worker)
            conn.send(HELLO)
            while True:
                msg = conn.receive("waiting for a worker", timeout_seconds=None)
                if msg.kind == BYE:
                    self.queue.leave(worker, msg.c)
                    worker = -1  # left, not lost
                    break
                if msg.kind == ASK:
                    self.queue.ask(worker, Request(msg.version, msg.a, msg.var_id, msg.c))
                if msg.kind == RESULT:  # a result is also the next ask (one message less)
                    tensors = _read_tensors(conn, msg.c)
                    self.queue.complete(worker, msg.var_id, (tensor_text(msg.payload), tensors))
                    if msg.b == AHEAD:  # the worker asked ahead already
                        continue
                if msg.kind in (ASK, RESULT):
                    item = self.queue.next_for(worker, HEARTBEAT_SECONDS,
                                               ahead=msg.kind == ASK and msg.b == AHEAD)
                    if item is None:
                        conn.send(IDLE)
                    elif isinstance(item, Answer):
                        failed, payload = _answer_payload(item)
                        _send_payload(conn, ANSWER, -1 if item.task is None else
                                      item.task.task_id, payload, b=int(failed))
                    elif isinstance(item, Marker):
                        _send_payload(conn, MARKER, -1, item.value, a=item.seq,
                                      b=_MARKER_CODES[item.kind])
                    else:
                        text = json.dumps({"key": item.key, "name": item.name,
                                           "args": item.args[0]})
                        _send_payload(conn, TASK, item.task_id, (text, item.args[1]),
                                      a=item.attempts)
                elif msg.kind == FAILED:
                    self.queue.fail(worker, msg.var_id,
                                    RemoteFunctionError(tensor_text(msg.payload)))
                else:
                    raise ParameterServerError(f"unknown message kind {msg.kind} from {conn.peer}")
        except PeerLostError:
            if worker >= 0:
                task = self.queue.lost(worker)
                again = "" if task is None else \
                    f"; its function {task.name} (task {task.task_id}) runs again elsewhere"
                print(f"[replicator] coordinator: lost worker rank {worker}{again}",
                      file=sys.stderr, flush=True)
        except Exception as exc:  # noqa: BLE001 - reported; the worker counts as lost
            print(f"[replicator] coordinator: connection to worker rank {worker} failed: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            if worker >= 0:
                self.queue.lost(worker)
        finally:
            conn.close()

    def close(self, timeout: float) -> None:
        """Stop accepting and wait (at most ``timeout`` s) for the workers to say goodbye."""
        self.closing = True
        for t in list(self.threads):
            t.join(timeout)
        try:
            self.sock.close()
        except OSError:
            pass


_MARKER_CODES = {"join": 1, "stop": 4}
_MARKER_NAMES = {v: k for k, v in _MARKER_CODES.items()}

#: Runs one task on the worker: ``(task id, key, name, args json, tensors)`` -> the encoded
#: return value; raises what the function raised.
Runner = Callable[[int, str, str, str, list[torch.Tensor]], Payload]


class StopServing(Exception):
    """The chief ended the coordination (its script finished)."""


class TaskChannel:
    """A worker's side: connects to the chief and runs tasks until the chief's marker."""

    def __init__(self, address: tuple[str, int], rank: int, timeout_seconds: float,
                 runner: Runner, ahead: bool = False) -> None:
        self.rank, self.runner = rank, runner
        self.ahead = ahead  # ask for the next task while one runs (not with staleness=0)
        self.conn = Connection.connect(address, "the coordinator (chief)", timeout_seconds)
        self.conn.send(HELLO, a=rank)
        reply = self.conn.receive("waiting for the coordinator's HELLO")
        if reply.kind != HELLO:
            raise ParameterServerError(f"the coordinator answered HELLO with kind {reply.kind}")
        self.stopped = False
        self.stop_value: Payload = ("null", [])

    def serve_until(self, request: Request) -> Marker:
        """Run tasks until the chief's marker or the answer to ``request`` comes (returned);
        :class:`StopServing` if the chief stopped instead (its value: ``stop_value``)."""
        if self.stopped:
            raise StopServing("the coordinator has stopped")
        ask, drop = True, False
        ids = (request.task, request.call, request.seq, request.horizon)
        while True:
            if ask:
                self.conn.send(ASK, var_id=ids[0], version=ids[1], a=ids[2], c=ids[3])
            ask = True
            msg = self.conn.receive(f"waiting for work or the chief, in {request.describe()}")
            dropped, drop = drop and msg.kind == TASK, False
            if msg.kind == IDLE:
                continue
            if msg.kind == TASK:
                spec = json.loads(tensor_text(msg.payload))
                tensors = _read_tensors(self.conn, msg.c)
                if dropped:  # taken ahead of a task that failed: the chief cancelled it
                    continue
                if self.ahead:  # its answer is the next thing to read after this task
                    self.conn.send(ASK, var_id=ids[0], version=ids[1], a=ids[2], b=AHEAD, c=ids[3])
                ran = self._run(msg.var_id, msg.a, spec, tensors)
                ask, drop = not ran and not self.ahead, not ran and self.ahead
                continue
            if msg.kind not in (MARKER, ANSWER):
                raise ParameterServerError(f"the coordinator sent message kind {msg.kind}")
            return self._reply(msg)

    def _reply(self, msg: Message) -> Marker:
        value = (tensor_text(msg.payload), _read_tensors(self.conn, msg.c))
        if msg.kind == ANSWER:
            return Marker("", msg.var_id, value, failed=bool(msg.b))
        got = _MARKER_NAMES.get(msg.b, "?")
        if got == "stop":
            self.stopped, self.stop_value = True, value
            raise StopServing("the coordinator has stopped")
        return Marker(got, msg.a, value)

    def _run(self, task_id: int, attempt: int, spec: dict[str, Any],
             tensors: list[torch.Tensor]) -> bool:
        """Run a task and send its result (which asks for more: True) or its failure."""
        try:
            result = self.runner(task_id, spec["key"], spec["name"], spec["args"], tensors)
        except PeerLostError:
            raise
        except Exception as exc:  # noqa: BLE001 - sent to the chief with the traceback
            text = function_failed(spec["name"], f"task {task_id}, attempt {attempt}",
                                   self.rank, exc)
            self.conn.send(FAILED, var_id=task_id, tensor=text_tensor(text))
            return False
        _send_payload(self.conn, RESULT, task_id, result, b=AHEAD if self.ahead else 0)
        return True

    def close(self, scheduled: int) -> None:
        """Say goodbye: this worker's script ended having scheduled ``scheduled`` functions."""
        try:
            self.conn.send(BYE, c=scheduled)
        except PeerLostError:
            pass
        self.conn.close()
