"""A large shard's values sent through the shared-memory lane in row parts of about
``PART_BYTES``, so the worker copies one part while the server writes the next (one
consistent snapshot, written under the server's lock); over TCP an answer goes whole."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from replicator.ps import protocol as P
from replicator.ps.messages import Connection, Into, Outgoing, SharedLane

#: About how much of a large shard's values each part carries.
PART_BYTES = 1 << 20


def splits(value: torch.Tensor) -> bool:
    """Whether ``value`` is large enough to travel in parts (two or more, by rows)."""
    return value.dim() > 0 and len(value) > 1 \
        and value.numel() * value.element_size() >= 2 * PART_BYTES


def value_messages(shards: Iterable[tuple[int, int, torch.Tensor]], clock: int, repeat: bool,
                   in_parts: bool) -> list[Outgoing]:
    """``VALUE`` messages of ``(shard id, version, values)`` and the end marker; with
    ``in_parts`` a large shard's values become row ranges of about ``PART_BYTES``."""
    out: list[Outgoing] = []
    count = 0
    for sid, version, value in shards:
        count += 1
        if not in_parts or not splits(value):
            out.append((P.VALUE, sid, version, value, 0, 0, 0))
            continue
        nbytes, rows = value.numel() * value.element_size(), len(value)
        per = max(1, PART_BYTES // max(1, nbytes // rows))
        for start in range(0, rows, per):
            out.append((P.VALUE, sid, version, value[start:start + per], 0, rows, start + 1))
    out.append((P.VALUES_END, -1, clock, None, count, int(repeat), 0))
    return out


def send_in_parts(conn: Connection, messages: list[Outgoing]) -> None:
    """Write ``messages`` into the lane a part at a time, announcing each batch of about
    ``PART_BYTES`` as soon as it is written (the caller checked that they fit the lane)."""
    at = 0
    batch: list[Outgoing] = []
    size = 0
    for i, message in enumerate(messages):
        batch.append(message)
        tensor = message[3]
        if tensor is not None:
            size += tensor.numel() * tensor.element_size()
        if size >= PART_BYTES or i == len(messages) - 1:
            conn.send_staged(conn.stage(batch, shared=True, lane_start=at))
            at += SharedLane.nbytes([m[3] for m in batch])
            batch, size = [], 0


class PartAssembler:
    """The worker's side: parts of one shard land in the tensor ``into`` names for the whole
    shard (the parameter's own rows), else in a new one; the last part hands it on."""

    def __init__(self) -> None:
        self._targets: dict[int, torch.Tensor] = {}

    def take(self, sid: int, start: int, rows: int, part: torch.Tensor,
             into: Into | None) -> torch.Tensor | None:
        """Copy a part (rows from ``start``); the whole shard once its last part came, else None."""
        target = self._targets.get(sid)
        if target is None:
            shape = (rows, *part.shape[1:])
            target = into(P.VALUE, sid, part.dtype, shape) if into is not None else None
            if target is None or tuple(target.shape) != shape or target.dtype != part.dtype:
                target = torch.empty(shape, dtype=part.dtype)
            self._targets[sid] = target
        end = start + len(part)
        if not 0 <= start < end <= rows:
            raise P.ParameterServerError(f"a part of shard {sid}'s values holds rows "
                                         f"{start}-{end} of {rows}")
        with torch.no_grad():
            target[start:end].copy_(part)
        if end < rows:
            return None
        return self._targets.pop(sid)
