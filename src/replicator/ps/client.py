"""A worker's connections to every parameter server; requests go to all servers at once.

Each request is sent to every server concerned in parallel (one thread per server), so a pull
or push of a sharded model costs about the time of its largest server's part. Losing a server
raises :class:`~replicator.ps.protocol.ParameterServerLostError` naming the server and the
variables it held, within the connection's timeout.

With a server on this host (same :func:`~replicator.comm.shm_segment.host_id`),
:meth:`ServerClient.share_memory` attaches a shared-memory lane to its connection: a push's
gradients (a coordinator's prepared update too) and the ids of a row pull are copied once into
it, the values and rows coming back are copied once out of it, and only headers travel on the
socket. Otherwise (or when the segment cannot be
made) payloads stay on the socket, and the reason is printed once.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from replicator import fault_points
from replicator.comm.shm_segment import SharedSegment, host_id, unlink_segment
from replicator.ps import protocol as P
from replicator.ps.messages import (
    Connection,
    Into,
    Message,
    Outgoing,
    PeerLostError,
    tensor_text,
    text_tensor,
)
from replicator.ps.shm_lane import SharedLane
from replicator.ps.value_parts import PartAssembler

T = TypeVar("T")
#: Called with (shard id, version, values) for each value a pull brings.
Sink = Callable[[int, int, torch.Tensor], None]
#: One shard's part of a push: (shard id, version pulled, gradient[, sparse rows or None]).
Push = tuple[Any, ...]


def _fresh(kind: int, var_id: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Rows pulled land in new tensors (the sink scatters them into the table)."""
    return None


class RowsAsPulled:
    """Stands for a sparse gradient's rows when they are exactly the rows its shard's last row
    pull named: the server kept those, so the rows are not sent again (``GRAD`` with ``c=2``)."""

    def __repr__(self) -> str:
        return "AS_PULLED"


AS_PULLED = RowsAsPulled()


def _gradient_messages(items: list[Push]) -> list[Outgoing]:
    """``GRAD`` messages of a push (``(shard, version, gradient)``, or with a sparse table's
    rows as a fourth, sent as ``ROW_IDS`` before its ``GRAD``, or :data:`AS_PULLED`)."""
    out: list[Outgoing] = []
    for item in items:
        sid, v, g = item[0], item[1], item[2]
        r = item[3] if len(item) > 3 else None
        if r is AS_PULLED:
            out.append((P.GRAD, sid, v, g, 0, 0, 2))
            continue
        if r is not None:
            out.append((P.ROW_IDS, sid, 0, r, 0, 0, 0))
        out.append((P.GRAD, sid, v, g, 0, 0, int(r is not None)))
    return out


class ServerClient:
    """Connections from worker ``worker`` to the servers at ``addresses``."""

    def __init__(self, addresses: list[tuple[str, int]], server_ranks: list[int], worker: int,
                 attempt: int, timeout_seconds: float,
                 held: Callable[[int], list[str]], into: Into | None = None) -> None:
        self.server_ranks = server_ranks
        self.addresses = addresses
        self.timeout_seconds = timeout_seconds
        self.held = held
        self.into = into  # where pulled values land (the parameters' own memory)
        self.connections: list[Connection] = []
        self.restored: list[dict[str, Any] | None] = []
        self.pids: list[int] = []
        self.same_host: list[bool] = []
        self.shared_off: str = ""  # why payloads stay on the socket (printed once)
        self._shared_off_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(addresses)),
                                        thread_name_prefix="ps-client")
        for k, address in enumerate(addresses):
            try:
                conn = Connection.connect(address, self.describe(k), timeout_seconds)
                self.connections.append(conn)
                conn.send(P.HELLO, a=worker, b=attempt)
                reply = self._expect(k, conn.receive("waiting for the server's HELLO"), P.HELLO)
            except PeerLostError as exc:
                raise self.lost(k, exc) from exc
            self.restored.append(json.loads(tensor_text(reply.payload)) if reply.b else None)
            self.pids.append(reply.c)
            self.same_host.append(reply.var_id == host_id())

    def describe(self, k: int) -> str:
        host, port = self.addresses[k]
        return f"parameter server {k} (rank {self.server_ranks[k]}, {host}:{port})"

    def lost(self, k: int, exc: BaseException) -> P.ParameterServerLostError:
        names = self.held(k)
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        return P.ParameterServerLostError(
            f"parameter server {k} (rank {self.server_ranks[k]}) is lost with the "
            f"{len(names)} variable shard(s) it held: {shown or 'none yet'} ({exc}). HINT: "
            "training cannot go on without these variables; launch with --max-restarts N and "
            "save the servers' state with strategy.save_checkpoint(step) so that a restart "
            "resumes from the last checkpoint.")

    def _expect(self, k: int, msg: Message, kind: int) -> Message:
        if msg.kind == P.ERROR:
            raise P.ParameterServerError(f"{self.describe(k)} refused the request: "
                                         f"{tensor_text(msg.payload)}")
        if msg.kind != kind:
            raise P.ParameterServerError(f"{self.describe(k)} answered with message kind "
                                         f"{msg.kind}, expected {kind}")
        return msg

    def each(self, fn: Callable[[int, Connection], T], servers: list[int] | None = None
             ) -> list[T]:
        """``fn(k, connection)`` for each server ``k`` (all by default), in parallel."""
        ks = list(range(len(self.connections))) if servers is None else servers

        def call(k: int) -> T:
            try:
                return fn(k, self.connections[k])
            except PeerLostError as exc:
                raise self.lost(k, exc) from exc

        if len(ks) == 1:
            return [call(ks[0])]
        return list(self._pool.map(call, ks))

    def exchange(self, send: Callable[[int, Connection], None],
                 receive: Callable[[int, Connection], T], servers: list[int] | None = None
                 ) -> list[T]:
        """A request to each server ``k``, then each answer, all from this thread: the servers
        work on their parts at once, and no thread hand-off adds to the round trip (measured:
        with two servers on a loaded 2-core host, helper threads added about a millisecond)."""
        ks = list(range(len(self.connections))) if servers is None else servers
        k = -1
        try:
            for k in ks:
                send(k, self.connections[k])
            out = []
            for k in ks:
                out.append(receive(k, self.connections[k]))
            return out
        except PeerLostError as exc:
            raise self.lost(k, exc) from exc

    def _read_values(self, k: int, conn: Connection, sink: Sink, into: Into | None = None
                     ) -> int:
        """Values until the end marker; its clock (``-1 - clock`` when the push answered was
        a coordinator task's repeat, which the server did not apply again). A large shard's
        values may come in parts (rows ``c - 1`` on, of ``b``: see
        :mod:`replicator.ps.value_parts`); ``sink`` gets the whole shard after its last."""
        land = self.into if into is None else into
        parts: PartAssembler | None = None
        while True:
            msg = conn.receive("waiting for variable values", into=land)
            if msg.kind == P.VALUES_END:
                return -1 - msg.version if msg.b else msg.version
            msg = self._expect(k, msg, P.VALUE)
            assert msg.payload is not None
            if msg.c:
                parts = parts or PartAssembler()
                whole = parts.take(msg.var_id, msg.c - 1, msg.b, msg.payload, land)
                if whole is not None:
                    sink(msg.var_id, msg.version, whole)
                continue
            sink(msg.var_id, msg.version, msg.payload)

    # -- shared memory ---------------------------------------------------------------------
    def share_memory(self, sizes: dict[int, tuple[int, int]], worker: int) -> None:
        """Attach a lane to each server's connection that ``sizes[k]`` (push bytes, pull bytes)
        fit in, where the server runs on this host; a lane too small is replaced."""
        def one(k: int, conn: Connection) -> None:
            push, pull = sizes[k]
            lane = conn.lane
            if lane is not None and lane.out_bytes >= push and lane.in_bytes >= pull:
                return
            if not self.same_host[k]:
                self._fallback(f"{self.describe(k)} runs on another host")
                return
            size, mine, theirs = SharedLane.layout(push, pull)
            try:
                segment = SharedSegment.create_named(size, f"ps{k}-w{worker}")
            except (OSError, ValueError) as exc:
                self._fallback(f"could not create a {size / 1e6:.1f} MB shared-memory segment "
                               f"({type(exc).__name__}: {exc})")
                return
            try:
                conn.send(P.SHM_ATTACH, version=host_id(), a=push, b=pull,
                          tensor=text_tensor(segment.name))
                reply = self._expect(k, conn.receive("waiting for the shared-memory answer"),
                                     P.SHM_ATTACHED)
            finally:
                unlink_segment(segment.name)  # mapped by both now, or by nobody else
            if not reply.a:
                self._fallback(tensor_text(reply.payload))
                return
            conn.lane = SharedLane(segment, out=mine, inbox=theirs)

        self.each(one, [k for k in sizes if k < len(self.connections)])

    def _fallback(self, reason: str) -> None:
        with self._shared_off_lock:
            first, self.shared_off = not self.shared_off, self.shared_off or reason
        if first:
            print(f"[replicator] parameter server payloads go over TCP, not shared memory: "
                  f"{reason}", file=sys.stderr, flush=True)

    def traffic(self) -> dict[str, int]:
        """Bytes this worker sent to and received from the servers so far."""
        return {"sent": sum(c.bytes_sent for c in self.connections),
                "received": sum(c.bytes_received for c in self.connections)}

    @property
    def shared(self) -> list[bool]:
        """Whether each server's connection has a shared-memory lane."""
        return [conn.lane is not None for conn in self.connections]

    # -- requests --------------------------------------------------------------------------
    def register(self, shards: dict[int, list[tuple[int, torch.Tensor]]],
                 sparse: set[int] | None = None) -> None:
        """Send initial values: ``shards[k]`` lists ``(shard id, values)`` for server ``k``;
        ``sparse``: shard ids of sparse tables (pulled by rows, left out of full pulls)."""
        sparse = sparse or set()

        def one(k: int, conn: Connection) -> None:
            items = shards.get(k, [])
            conn.send_many([(P.REGISTER, sid, 0, t, int(sid in sparse), 0, 0)
                            for sid, t in items])
            for _ in items:
                self._expect(k, conn.receive("waiting for REGISTERED"), P.REGISTERED)

        self.each(one)

    def send_optimizer(self, text: str) -> None:
        payload = text_tensor(text)
        self.each(lambda k, conn: conn.send(P.OPTIMIZER, tensor=payload))

    def pull(self, expected: dict[int, int], sink: Sink, begin: bool = False,
             everything: bool = False) -> list[int]:
        """Pull every dense shard of every server (``expected[k]`` shards from server ``k``;
        ``everything``: sparse tables whole too); ``begin``: a step starts with these values
        (the servers apply the staleness bound)."""
        def send(k: int, conn: Connection) -> None:
            conn.send(P.PULL, a=expected.get(k, 0), b=int(begin), c=int(everything))

        return self.exchange(send, lambda k, conn: self._read_values(k, conn, sink))

    def pull_rows(self, rows: dict[int, list[tuple[int, torch.Tensor]]], sink: Sink) -> None:
        """The named rows of sparse table shards: ``rows[k]`` lists ``(shard id, shard-local
        rows)`` for server ``k``; ``sink`` gets ``(shard id, version, values)``."""
        def send(k: int, conn: Connection) -> None:
            # through the lane: the server is done with the ids once the values answer
            named = rows[k]
            # the last shard's ids ride on PULL_ROWS itself: one message fewer per pull
            last, last_ids = named[-1] if named else (-1, None)
            conn.send_many([(P.ROW_IDS, sid, 0, ids, 0, 0, 0) for sid, ids in named[:-1]]
                           + [(P.PULL_ROWS, last, 0, last_ids, len(named), 0, 0)],
                           shared=True)

        self.exchange(send, lambda k, conn: self._read_values(k, conn, sink, into=_fresh),
                      sorted(rows))

    def push(self, grads: dict[int, list[Push]], sink: Sink, pull: bool = True,
             claim: tuple[int, int, int] | None = None,
             task: tuple[int, int] | None = None, atomic: bool = True) -> list[int]:
        """Push ``grads[k]`` (``(shard id, version pulled, gradient, rows)``; ``rows`` the
        shard-local rows of a sparse table's gradient, else ``None``) to each server, then
        (``pull``) read back every dense shard's new values; ``claim`` (stream, epoch, batch):
        the input batch this update consumes (told to server 0); ``task`` (task id, push
        number): a coordinator's function, applied at most once by each server (with ``task``,
        every server gets the push, also one with no gradient for it). ``atomic`` (with ``task``
        and several servers): commit in two phases, so that the whole update applied comes from
        one attempt (``staleness=0`` needs it); otherwise each server applies its part of the
        first attempt that reaches it, in one round trip."""
        if task is not None and atomic and len(self.connections) > 1:
            return self._push_task(grads, sink, pull, task)

        def send(k: int, conn: Connection) -> None:
            stream, epoch, token = (claim[0], claim[1], claim[2] + 1) \
                if claim is not None and k == 0 else (-1, 0, 0)
            end = (P.PUSH, stream, epoch, None, len(grads.get(k, [])), int(pull), token) \
                if task is None \
                else (P.TASK_PUSH, task[0], task[1], None, len(grads.get(k, [])), int(pull), 0)
            # through the lane only when values answer it: the server is then done with the
            # gradients before this worker can write its next push there
            conn.send_many(_gradient_messages(grads.get(k, [])) + [end], shared=pull)
            if task is not None and k == 0 and len(self.connections) > 1:
                fault_points.fire("between_server_pushes", task=task[0], push=task[1])

        return self.exchange(send, lambda k, conn: self._read_values(k, conn, sink)
                             if pull else 0)

    def _push_task(self, grads: dict[int, list[Push]], sink: Sink, pull: bool,
                   task: tuple[int, int]) -> list[int]:
        """A coordinator's update to several servers, in two phases: every server holds it
        (prepare), then every server applies it (commit). A worker lost in between leaves the
        update held, and the re-run's commit applies that first attempt's update, never the
        re-run's (which may have read a part already applied elsewhere)."""
        def prepare(k: int, conn: Connection) -> None:
            items = grads.get(k, [])
            # through the lane: the server copies what it holds before it answers PREPARED
            conn.send_many(_gradient_messages(items)
                           + [(P.TASK_PREPARE, task[0], task[1], None, len(items), 0, 0)],
                           shared=True)

        self.exchange(prepare, lambda k, conn: self._expect(
            k, conn.receive("waiting for a prepared update"), P.PREPARED).a)

        def commit(k: int, conn: Connection) -> None:
            conn.send(P.TASK_COMMIT, var_id=task[0], version=task[1], b=int(pull))
            if k == 0:
                fault_points.fire("between_server_commits", task=task[0], push=task[1])

        def applied(k: int, conn: Connection) -> int:
            return self._read_values(k, conn, sink) if pull else 0

        # every server at once: once all of them hold the update, a commit that reached any
        # one decides it (a re-run's prepare finds it applied or held on each server, and
        # the re-run's commit applies the held first attempt wherever it is still held), so
        # the commits need no order and cost one round trip, not one per server. Coordinator
        # functions with staleness=0 run one at a time, so no read falls between two commits.
        return self.exchange(commit, applied)

    def task_stats(self) -> list[dict[str, int]]:
        """Per server: coordinator task pushes applied and repeats turned away."""
        def one(k: int, conn: Connection) -> dict[str, int]:
            conn.send(P.TASK_STATS)
            return json.loads(tensor_text(self._expect(k, conn.receive(
                "waiting for task statistics"), P.TASK_STATS).payload))

        return self.each(one)

    def claim(self, stream: int, epoch: int, total: int) -> int:
        """The next batch of ``epoch`` of input ``stream`` for this worker (-1: done)."""
        def one(k: int, conn: Connection) -> int:
            conn.send(P.CLAIM, var_id=stream, a=epoch, b=total)
            return self._expect(k, conn.receive("waiting for a batch claim"), P.CLAIMED).a

        return self.each(one, [0])[0]

    def data_stats(self, stream: int = 0) -> dict[int, dict[str, Any]]:
        def one(k: int, conn: Connection) -> str:
            conn.send(P.DATA_STATS, a=stream)
            return tensor_text(self._expect(k, conn.receive("waiting for data statistics"),
                                            P.DATA_STATS).payload)

        raw = json.loads(self.each(one, [0])[0])
        return {int(e): {**v, "by_worker": {int(w): n for w, n in v["by_worker"].items()}}
                for e, v in raw.items()}

    def stats(self) -> list[torch.Tensor]:
        def one(k: int, conn: Connection) -> torch.Tensor:
            conn.send(P.STATS)
            msg = self._expect(k, conn.receive("waiting for statistics"), P.STATS)
            assert msg.payload is not None
            return msg.payload

        return self.each(one)

    def versions(self) -> dict[int, int]:
        def one(k: int, conn: Connection) -> list[int]:
            conn.send(P.VERSIONS)
            msg = self._expect(k, conn.receive("waiting for versions"), P.VERSIONS)
            assert msg.payload is not None
            return msg.payload.tolist()

        out: dict[int, int] = {}
        for flat in self.each(one):
            out.update({flat[i]: flat[i + 1] for i in range(0, len(flat), 2)})
        return out

    def save(self, step: int, description: str) -> list[str]:
        def one(k: int, conn: Connection) -> str:
            conn.send(P.SAVE, a=step, tensor=text_tensor(description))
            return tensor_text(self._expect(k, conn.receive("waiting for the save"),
                                            P.SAVED).payload)

        return self.each(one)

    def close(self) -> None:
        """Say goodbye to every server (a clean exit, not a lost worker) and disconnect."""
        for conn in self.connections:
            try:
                conn.send(P.BYE)
            except (PeerLostError, OSError):
                pass
            conn.close()
        self._pool.shutdown(wait=False)

    def __enter__(self) -> ServerClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
