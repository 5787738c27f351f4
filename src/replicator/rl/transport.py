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
- ``ITEMS(version=weights version, a=env steps, b=round, c=2)`` then a ``PART`` with the
  fields' layout (JSON: name, dtype code, shape, byte offset of each) and one ``PART`` of all
  their bytes (each field 8-byte aligned): experience, never answered. One payload, not one
  message per field: the learner receives two messages per batch whatever the fields;
- ``ASK(a=version held, b=round)`` -> ``WEIGHTS(version, c=tensors)`` then one ``PART`` per
  state-dict entry, or ``WEIGHTS(version=-1)`` when there is nothing newer (lockstep: nothing
  for that round yet);
- ``EPISODES(a=env steps, float returns)``: episodes that ended, for the learner's report;
- ``BYE`` (a learner that ends closes its actors' connections after it).
"""

from __future__ import annotations

import json
import math
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from replicator.cluster.env_names import RESTART_COUNT_ENV, RL_STORE_ENV
from replicator.errors import ClusterConfigError
from replicator.ps.messages import (
    DTYPE_CODES,
    DTYPES,
    ITEMSIZE,
    Connection,
    Message,
    MessageFormatError,
    tensor_text,
    text_tensor,
)

__all__ = ["HELLO", "ITEMS", "PART", "ASK", "WEIGHTS", "BYE", "ERROR", "EPISODES",
           "LEARNER_KEY",
           "send_hello", "receive_text", "send_items", "receive_items", "receive_parts",
           "send_weights",
           "rl_store"]

HELLO, ITEMS, PART, ASK, WEIGHTS, BYE, ERROR, EPISODES = range(101, 109)

#: Byte alignment of each field in a batch's payload (so every field is a view of its dtype).
_ALIGN = 8

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
    """One batch of experience (its layout, then every field's bytes in one payload), and the
    returns of the episodes that ended since the last batch."""
    layout, chunks, offset = [], [], 0
    for name, value in items.items():
        if value.dtype not in DTYPE_CODES:
            raise ClusterConfigError(f"experience field {name!r} has dtype {value.dtype}, which "
                                     "the transport does not carry. HINT: use a numeric or "
                                     "bool tensor.")
        raw = value.detach().contiguous().reshape(-1).view(torch.uint8)
        layout.append([name, DTYPE_CODES[value.dtype], list(value.shape), offset])
        chunks.append(raw)
        pad = -raw.numel() % _ALIGN
        if pad:
            chunks.append(torch.zeros(pad, dtype=torch.uint8))
        offset += raw.numel() + pad
    blob = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    batch = [(ITEMS, -1, version, None, steps, round_, 2),
             (PART, 0, 0, text_tensor(json.dumps(layout)), 0, 0, 0),
             (PART, 1, 0, blob, 0, 0, 0)]
    if returns:
        batch.append((EPISODES, -1, 0, torch.tensor(returns, dtype=torch.float64), total_steps,
                      0, 0))
    conn.send_many(batch)


def receive_items(conn: Connection, count: int, what: str) -> dict[str, torch.Tensor]:
    """The fields of a batch :func:`send_items` sent (``count``: the header's part count), as
    views of its one payload; a layout that does not fit the payload is refused."""
    parts = receive_parts(conn, count, what)
    if count != 2:
        raise MessageFormatError(f"{conn.peer} sent experience in {count} parts (2 expected: "
                                 "layout and bytes). HINT: actors and learners must run the "
                                 "same replicator version.")
    layout, blob = json.loads(tensor_text(parts[0])), parts[1]
    items = {}
    for name, code, shape, offset in layout:
        if not 0 <= code < len(DTYPES):
            raise MessageFormatError(f"{conn.peer} sent field {name!r} with dtype code {code} "
                                     f"and shape {shape}")
        dtype = DTYPES[code]
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        if offset % _ALIGN or not 0 <= offset <= offset + nbytes <= blob.numel():
            raise MessageFormatError(f"{conn.peer} sent field {name!r} at bytes {offset}.."
                                     f"{offset + nbytes} of a payload of {blob.numel()}")
        items[name] = blob[offset:offset + nbytes].view(dtype).reshape(shape)
    return items


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
