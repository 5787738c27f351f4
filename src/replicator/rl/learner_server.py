"""The learner side of the actor connections: experience in, published weights out.

Each learner replica listens on loopback and publishes its address in the launcher's store.
One thread per actor connection receives experience and inserts it into this replica's replay
shard, so the training loop never waits on an actor: it only reads the replay (whose rate
limiter may hold it, for at most its timeout). Replica 0 also answers actors' requests for
weights from the last snapshot :meth:`ExperienceServer.publish` took (a copy, so training goes
on while it is sent). An actor that dies closes only its own connection.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import torch

from replicator.cluster.ports import LOOPBACK, listen
from replicator.errors import ClusterConfigError
from replicator.ps.messages import Connection, PeerLostError, text_tensor
from replicator.rl import transport as T
from replicator.rl.policy_lag import PolicyLags

__all__ = ["ExperienceServer"]


class ExperienceServer:
    """Accept actors' connections for learner replica ``rank``; insert into ``replay``."""

    def __init__(self, replay: Any, rank: int, num_actors: int, *, lockstep: bool,
                 publish_every: int, timeout_seconds: float,
                 max_policy_lag: int | None = None) -> None:
        self.replay = replay
        self.rank = rank
        self.num_actors = num_actors
        self.lockstep = lockstep
        self.publish_every = publish_every
        self.timeout_seconds = timeout_seconds
        #: Experience made with weights more than this many steps old is dropped.
        self.max_policy_lag = max_policy_lag
        self.stale_dropped = 0
        self.step = 0
        self._lock = threading.Condition()
        self._snapshot: tuple[int, list[torch.Tensor]] | None = None
        self._spec: tuple[int, dict[str, Any]] | None = None
        self._rounds: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._conns: list[Connection] = []
        self._closed = False
        self.env_steps = 0
        self.items = 0
        self.lags = PolicyLags()
        self.episodes: list[tuple[float, int, float]] = []  # (return, env steps, seconds)
        self.joins: list[dict[str, int]] = []
        self.actor_errors: list[str] = []
        self._started = time.monotonic()
        self._sock = listen(LOOPBACK, 0)
        self.address = f"{LOOPBACK}:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._accept, name="replicator-rl-accept",
                                        daemon=True)

    def start(self, store: Any) -> None:
        """Publish this replica's address and begin accepting actors."""
        self._thread.start()
        store.set(T.LEARNER_KEY.format(rank=self.rank), self.address)

    def publish(self, version: int, tensors: list[torch.Tensor]) -> None:
        """Make ``tensors`` (copied) the weights actors get next, as ``version``."""
        snapshot = [t.detach().to("cpu", copy=True).contiguous() for t in tensors]
        with self._lock:
            self._snapshot = (version, snapshot)
            self._lock.notify_all()

    def snapshot(self) -> tuple[int, list[torch.Tensor]] | None:
        """The weights last published and their version (``None`` before any)."""
        with self._lock:
            return self._snapshot

    @property
    def version(self) -> int:
        return -1 if self._snapshot is None else self._snapshot[0]

    def take_round(self, round_: int, actors: list[int]) -> list[dict[str, torch.Tensor]]:
        """Lockstep: the items of ``round_`` from each of ``actors``, in actor order."""
        deadline = time.monotonic() + self.timeout_seconds
        with self._lock:
            while not all((round_, a) in self._rounds for a in actors):
                if self.actor_errors:
                    raise ClusterConfigError(self.actor_errors[0])
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [a for a in actors if (round_, a) not in self._rounds]
                    raise TimeoutError(
                        f"learner {self.rank} waited {self.timeout_seconds:.0f} s for round "
                        f"{round_} of actor(s) {missing} in lockstep mode. HINT: an actor may "
                        "have failed; see its output above.")
                self._lock.wait(min(left, 0.5))
            return [self._rounds.pop((round_, a)) for a in actors]

    def stats(self) -> dict[str, Any]:
        return {"env_steps": self.env_steps, "items": self.items, **self.lags.figures(),
                "stale_dropped": self.stale_dropped, "episodes": len(self.episodes),
                "joins": list(self.joins)}

    def close(self) -> None:
        """Say goodbye to every actor and stop accepting."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
            self._lock.notify_all()
        for conn in conns:
            try:
                conn.send(T.BYE)
            except PeerLostError:
                pass
            conn.close()
        try:  # wakes the accepting thread (a close alone leaves it in accept())
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=5.0)

    # threads
    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            conn = Connection(sock, "an actor", self.timeout_seconds)
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="replicator-rl-actor").start()

    def _serve(self, conn: Connection) -> None:
        try:
            joined = self._hello(conn)
            if joined is not None:
                self._loop(conn, *joined)
        except PeerLostError:
            pass  # the actor is gone: only its unsent experience is lost
        except Exception as exc:  # noqa: BLE001 - told to the actor, then this connection ends
            try:
                conn.send(T.ERROR, tensor=text_tensor(f"learner {self.rank}: {exc}"))
            except PeerLostError:
                pass
        finally:
            conn.close()

    def _hello(self, conn: Connection) -> tuple[int, int] | None:
        """Check an actor's spec against the first one's; (actor, its entry in ``joins``)."""
        msg = conn.receive("waiting for an actor's hello")
        if msg.kind != T.HELLO:
            raise ClusterConfigError(f"expected an actor's hello, got message kind {msg.kind}")
        actor, restart = msg.a, msg.b
        conn.peer = f"actor {actor}"
        spec = json.loads(T.receive_text(conn, "reading an actor's spec"))
        with self._lock:
            if self._spec is None:
                self._spec = (actor, spec)
            first, known = self._spec
            if known["obs_shape"] != spec["obs_shape"] or known["env"] != spec["env"]:
                text = (f"actor {actor} runs {spec['env']} with observations of shape "
                        f"{tuple(spec['obs_shape'])}, actor {first} runs {known['env']} with "
                        f"{tuple(known['obs_shape'])}: one replay holds one shape. HINT: give "
                        "every actor the same environment (env_fn must not depend on the "
                        "actor's index in a way that changes its spaces).")
                self.actor_errors.append(text)
                self._lock.notify_all()
                conn.send(T.ERROR, tensor=text_tensor(text))
                return None
            self.joins.append({"actor": actor, "restart": restart, "published": self.version,
                               "first_version": -2})
            join = len(self.joins) - 1
        conn.send(T.HELLO, version=self.version, a=self.rank, b=self.step)
        return actor, join

    def _loop(self, conn: Connection, actor: int, join: int) -> None:
        while True:
            msg = conn.receive("waiting for an actor's experience or request")
            if msg.kind == T.ITEMS:
                self._items(conn, actor, join, msg.version, msg.a, msg.b, msg.c)
            elif msg.kind == T.EPISODES and msg.payload is not None:
                now = time.monotonic() - self._started
                with self._lock:
                    self.episodes.extend((float(r), self.env_steps, now)
                                         for r in msg.payload.tolist())
            elif msg.kind == T.ASK:
                self._answer(conn, msg.a, msg.b)
            elif msg.kind == T.BYE:
                return
            else:
                raise ClusterConfigError(f"actor {actor} sent message kind {msg.kind}")

    def _items(self, conn: Connection, actor: int, join: int, version: int, steps: int,
               round_: int, count: int) -> None:
        items = T.receive_items(conn, count, f"receiving experience from actor {actor}")
        size = int(next(iter(items.values())).shape[0]) if items else 0
        lag = max(0, self.step - version)
        with self._lock:
            entry = self.joins[join]
            if entry["first_version"] == -2:
                entry["first_version"] = version
            self.env_steps += steps
            self.items += size
            self.lags.add(lag)
            if self.lockstep:
                self._rounds[(round_, actor)] = items
                self._lock.notify_all()
                return
            if self.max_policy_lag is not None and lag > self.max_policy_lag:
                self.stale_dropped += size
                return
        self.replay.add(items)

    def _answer(self, conn: Connection, held: int, round_: int) -> None:
        with self._lock:
            snapshot = self._snapshot
        if snapshot is not None and self.lockstep and \
                snapshot[0] != (round_ // self.publish_every) * self.publish_every:
            snapshot = None  # not this round's weights yet
        elif snapshot is not None and not self.lockstep and snapshot[0] == held:
            snapshot = None  # the actor holds these already: nothing to send again
        if snapshot is None:
            T.send_weights(conn, -1, None)
        else:
            T.send_weights(conn, snapshot[0], snapshot[1])
