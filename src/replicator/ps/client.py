"""A worker's connections to every parameter server: each request goes to all servers concerned at
once; a lost server raises ``ParameterServerLostError`` naming what it held. With a server on this
host payloads go through a shared-memory lane (else the socket, and the reason is printed once)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
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
    SharedLane,
    tensor_text,
    text_tensor,
)

T = TypeVar("T")
#: Called with (shard id, version, values) for each value a pull brings.
Sink = Callable[[int, int, torch.Tensor], None]
#: One shard's part of a push: (shard id, version pulled, gradient[, sparse rows or None]).
Push = tuple[Any, ...]


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
        if r is not None and r is not AS_PULLED:
            out.append((P.ROW_IDS, sid, 0, r, 0, 0, 0))
        out.append((P.GRAD, sid, v, g, 0, 0, 2 if r is AS_PULLED else int(r is not None)))
    return out


def _take_part(targets: dict[int, torch.Tensor], sid: int, start: int, rows: int,
               part: torch.Tensor, into: Into | None) -> torch.Tensor | None:
    """Copy a part of a large shard's values (rows from ``start`` of ``rows``) into the tensor
    ``into`` names for the whole shard (the parameter's own rows), else a new one kept in
    ``targets``; the whole shard once its last part came, else None."""
    target = targets.get(sid)
    if target is None:
        shape = (rows, *part.shape[1:])
        target = into(P.VALUE, sid, part.dtype, shape) if into is not None else None
        if target is None or tuple(target.shape) != shape or target.dtype != part.dtype:
            target = torch.empty(shape, dtype=part.dtype)
        targets[sid] = target
    end = start + len(part)
    if not 0 <= start < end <= rows:
        raise P.ParameterServerError(f"a part of shard {sid}'s values holds rows "
                                     f"{start}-{end} of {rows}")
    with torch.no_grad():
        target[start:end].copy_(part)
    return None if end < rows else targets.pop(sid)


class ServerClient:
    """Connections from worker ``worker`` to the servers at ``addresses``."""

    def __init__(self, addresses: list[tuple[str, int]], server_ranks: list[int], worker: int,
                 attempt: int, timeout_seconds: float,
                 held: Callable[[int], list[str]], into: Into | None = None) -> None:
        self.server_ranks, self.addresses, self.held = server_ranks, addresses, held
        self.into = into  # where pulled values land (the parameters' own memory)
        self.connections: list[Connection] = []
        self.shared_off: str = ""  # why payloads stay on the socket (printed once)
        for k, address in enumerate(addresses):
            try:
                self.connections.append(
                    Connection.connect(address, self.describe(k), timeout_seconds))
            except PeerLostError as exc:
                raise self.lost(k, exc) from exc
        hellos = self.request(P.HELLO, P.HELLO, "the server's HELLO", a=worker, b=attempt)
        self.restored: list[dict[str, Any] | None] = [
            json.loads(tensor_text(m.payload)) if m.b else None for m in hellos]
        self.pids = [m.c for m in hellos]
        self.same_host = [m.var_id == host_id() for m in hellos]

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

    def exchange(self, send: Callable[[int, Connection], None],
                 receive: Callable[[int, Connection], T], servers: list[int] | None = None
                 ) -> list[T]:
        """A request to each server ``k``, then each answer, all from this thread: the servers
        work at once, and no thread hand-off adds to the round trip."""
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

    def _read_values(self, k: int, conn: Connection, sink: Sink, into: Into | None = None) -> int:
        """Values until the end marker (a large shard's in parts, see :func:`_take_part`); its
        clock, ``-1 - clock`` for a task's repeat."""
        land = self.into if into is None else into
        parts: dict[int, torch.Tensor] = {}
        while True:
            msg = conn.receive("waiting for variable values", into=land)
            if msg.kind == P.VALUES_END:
                return -1 - msg.version if msg.b else msg.version
            msg = self._expect(k, msg, P.VALUE)
            assert msg.payload is not None
            whole = _take_part(parts, msg.var_id, msg.c - 1, msg.b, msg.payload, land) \
                if msg.c else msg.payload
            if whole is not None:
                sink(msg.var_id, msg.version, whole)

    # -- shared memory ---------------------------------------------------------------------
    def share_memory(self, sizes: dict[int, tuple[int, int]], worker: int) -> None:
        """Attach a lane to each server's connection that ``sizes[k]`` (push bytes, pull bytes)
        fit in, where the server runs on this host; a lane too small is replaced."""
        made: dict[int, tuple[SharedSegment, tuple[int, int], tuple[int, int]]] = {}
        for k, (push, pull) in sizes.items():
            lane = self.connections[k].lane
            if lane is not None and lane.out_bytes >= push and lane.in_bytes >= pull:
                continue
            if not self.same_host[k]:
                self._fallback(f"{self.describe(k)} runs on another host")
                continue
            size, mine, theirs = SharedLane.layout(push, pull)
            try:
                made[k] = (SharedSegment.create_named(size, f"ps{k}-w{worker}"), mine, theirs)
            except (OSError, ValueError) as exc:
                self._fallback(f"could not create a {size / 1e6:.1f} MB shared-memory segment "
                               f"({type(exc).__name__}: {exc})")

        def send(k: int, conn: Connection) -> None:
            conn.send(P.SHM_ATTACH, version=host_id(), a=sizes[k][0], b=sizes[k][1],
                      tensor=text_tensor(made[k][0].name))

        def attach(k: int, conn: Connection) -> None:
            reply = self._expect(k, conn.receive("waiting for the shared-memory answer"),
                                 P.SHM_ATTACHED)
            if reply.a:
                conn.lane = SharedLane(made[k][0], out=made[k][1], inbox=made[k][2])
            else:
                self._fallback(tensor_text(reply.payload))

        try:
            self.exchange(send, attach, sorted(made))
        finally:
            for segment, _, _ in made.values():
                unlink_segment(segment.name)  # mapped by both now, or by nobody else

    def _fallback(self, reason: str) -> None:
        if not self.shared_off:
            print(f"[replicator] parameter server payloads go over TCP, not shared memory: "
                  f"{reason}", file=sys.stderr, flush=True)
            self.shared_off = reason

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

        def send(k: int, conn: Connection) -> None:
            conn.send_many([(P.REGISTER, sid, 0, t, int(sid in sparse), 0, 0)
                            for sid, t in shards.get(k, [])])

        def registered(k: int, conn: Connection) -> None:
            for _ in shards.get(k, []):
                self._expect(k, conn.receive("waiting for REGISTERED"), P.REGISTERED)

        self.exchange(send, registered)

    def send_optimizer(self, text: str) -> None:
        payload = text_tensor(text)
        self.exchange(lambda k, conn: conn.send(P.OPTIMIZER, tensor=payload), lambda k, conn: None)

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

        # rows land in new tensors (the sink copies them into the lookup)
        self.exchange(send, lambda k, conn: self._read_values(k, conn, sink,
                                                              into=lambda *_: None), sorted(rows))

    def push(self, grads: dict[int, list[Push]], sink: Sink, pull: bool = True,
             claim: tuple[int, int, int] | None = None,
             task: tuple[int, int] | None = None, atomic: bool = True) -> list[int]:
        """Push ``grads[k]`` (``(shard id, version pulled, gradient, rows or None)``) to each
        server, then (``pull``) read back the dense shards' values. ``claim``: the input batch
        it consumes; ``task`` (task id, push number): applied at most once by each server, in
        two phases with ``atomic`` and several servers (the whole update from one attempt)."""
        def values(k: int, conn: Connection) -> int:
            return self._read_values(k, conn, sink) if pull else 0

        if task is not None and atomic and len(self.connections) > 1:
            # in two phases (prepare everywhere, then commit), so that a re-run's commit
            # applies the first attempt's update, never its own
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

            # every server at once: once all hold the update, a commit that reached any one
            # decides it (a re-run's prepare finds it applied or held everywhere, and its
            # commit applies the held first attempt), so the commits need no order: one round
            # trip. Functions with staleness=0 run one at a time: no read falls between two.
            return self.exchange(commit, values)

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

        return self.exchange(send, values)

    def request(self, kind: int, answer: int, what: str, servers: list[int] | None = None,
                tensor: torch.Tensor | None = None, **fields: int) -> list[Message]:
        """Send ``kind`` to each server (all by default) and return each one's ``answer``."""
        return self.exchange(lambda k, conn: conn.send(kind, tensor=tensor, **fields),
                             lambda k, conn: self._expect(
                                 k, conn.receive(f"waiting for {what}"), answer), servers)

    def claim(self, stream: int, epoch: int, total: int) -> int:
        """The next batch of ``epoch`` of input ``stream`` for this worker (-1: done)."""
        return self.request(P.CLAIM, P.CLAIMED, "a batch claim", [0], var_id=stream, a=epoch,
                            b=total)[0].a

    def stats(self, servers: list[int] | None = None, stream: int = 0) -> list[dict[str, Any]]:
        """Per server: ``staleness`` (count, sum, max, histogram), shard ``versions``, coordinator
        ``tasks`` applied and repeated, and its claims of input ``stream`` (``data``)."""
        return [json.loads(tensor_text(m.payload))
                for m in self.request(P.STATS, P.STATS, "statistics", servers, a=stream)]

    def save(self, step: int, description: str) -> list[str]:
        return [tensor_text(m.payload) for m in self.request(
            P.SAVE, P.SAVED, "the save", a=step, tensor=text_tensor(description))]

    def close(self) -> None:
        """Say goodbye to every server (a clean exit, not a lost worker) and disconnect."""
        for conn in self.connections:
            try:
                conn.send(P.BYE)
            except (PeerLostError, OSError):
                pass
            conn.close()
