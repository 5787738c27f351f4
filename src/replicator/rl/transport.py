"""How actors and learners talk: the parameter server's typed tensor messages, reused.

torch.distributed does not fit here: a gloo group cannot lose or regain a member, and actors
come and go. The parameter server had the same need and solved it with
:class:`replicator.ps.messages.Connection`: one TCP connection per pair of processes,
length-prefixed tensor frames (a fixed header with dtype and shape, then raw bytes), nothing
pickled, every receive bounded by a timeout, a dead peer seen as
:class:`~replicator.ps.messages.PeerLostError` on its own connection only. The actor-learner
protocol is a handful of message kinds over that same connection:

- ``HELLO(a=actor, b=restart, text=json spec)`` -> ``HELLO(a=learner, version=weights version,
  b=start round)`` | ``ERROR(text)``: the spec names the kind of items (``transitions`` or
  ``trajectories``), the environment and its observation shape (all actors must agree);
- ``ITEMS(version=weights version, a=env steps, b=round, c=parts)`` then a ``PART`` with the
  field names (JSON) and one ``PART`` per field: experience, never answered;
- ``ASK(a=version held, b=round)`` -> ``WEIGHTS(version, c=tensors)`` then one ``PART`` per
  state-dict entry, or ``WEIGHTS(version=-1)`` when there is nothing newer (lockstep: nothing
  for that round yet);
- ``EPISODES(a=env steps, float returns)``: episodes that ended, for the learner's report;
- ``BYE`` (a learner that ends closes its actors' connections after it).
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from replicator.cluster.env_names import RESTART_COUNT_ENV, RL_STORE_ENV
from replicator.errors import ClusterConfigError
from replicator.ps.messages import Connection, Message, tensor_text, text_tensor

__all__ = ["HELLO", "ITEMS", "PART", "ASK", "WEIGHTS", "BYE", "ERROR", "EPISODES",
           "LEARNER_KEY",
           "send_hello", "receive_text", "send_items", "receive_parts", "send_weights",
           "rl_store"]

HELLO, ITEMS, PART, ASK, WEIGHTS, BYE, ERROR, EPISODES = range(101, 109)

#: Store key (under the attempt's prefix) where learner replica R publishes ``host:port``.
LEARNER_KEY = "rl/learner/{rank}"


def send_hello(conn: Connection, actor: int, restart: int, spec: dict[str, Any]) -> None:
    conn.send_many([(HELLO, -1, 0, None, actor, restart, 1),
                    (PART, 0, 0, text_tensor(json.dumps(spec)), 0, 0, 0)])


def receive_text(conn: Connection, what: str) -> str:
    part = conn.receive(what)
    return tensor_text(part.payload)


def send_items(conn: Connection, items: dict[str, torch.Tensor], version: int, steps: int,
               round_: int = 0, returns: list[float] | None = None, total_steps: int = 0
               ) -> None:
    """One batch of experience (the field names, then one part per field), and the returns
    of the episodes that ended since the last batch."""
    names = text_tensor(json.dumps(list(items)))
    parts = [(PART, i, 0, v.contiguous(), 0, 0, 0)
             for i, v in enumerate([names, *items.values()])]
    batch = [(ITEMS, -1, version, None, steps, round_, len(parts)), *parts]
    if returns:
        batch.append((EPISODES, -1, 0, torch.tensor(returns, dtype=torch.float64), total_steps,
                      0, 0))
    conn.send_many(batch)


def receive_parts(conn: Connection, count: int, what: str) -> list[torch.Tensor]:
    """The ``count`` ``PART`` payloads that follow a header."""
    out = []
    for _ in range(count):
        msg: Message = conn.receive(what)
        if msg.kind != PART or msg.payload is None:
            raise ClusterConfigError(f"{conn.peer} sent message kind {msg.kind} where a part "
                                     "was expected")
        out.append(msg.payload)
    return out


def send_weights(conn: Connection, version: int, tensors: list[torch.Tensor] | None) -> None:
    if tensors is None:
        conn.send(WEIGHTS, version=-1)
        return
    conn.send_many([(WEIGHTS, -1, version, None, 0, 0, len(tensors)),
                    *[(PART, i, 0, t, 0, 0, 0) for i, t in enumerate(tensors)]])


def rl_store(timeout_seconds: float) -> dist.Store:
    """A client of the launcher's store, under this attempt's prefix (actors and learners find
    each other there)."""
    raw = os.environ.get(RL_STORE_ENV) or (
        f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}")
    host, _, port = raw.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterConfigError(
            "this process was not started by replicator's launcher with actors (no store "
            f"address in {RL_STORE_ENV} or MASTER_ADDR/MASTER_PORT). HINT: start the job with "
            "replicator run --nproc L --num-actors A script.py, or rp.launch(main, "
            "num_replicas=L, num_actors=A).")
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            client = dist.TCPStore(host, int(port), None, False,
                                   timeout=timedelta(seconds=timeout_seconds))
            break
        except (RuntimeError, OSError) as exc:
            if time.monotonic() > deadline:
                raise ClusterConfigError(f"could not reach the job's store at {raw}: {exc}"
                                         ) from exc
            time.sleep(0.2)
    attempt = os.environ.get(RESTART_COUNT_ENV, "0")
    return dist.PrefixStore(f"replicator/attempt_{attempt}", client)
