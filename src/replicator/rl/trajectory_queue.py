"""A first-in-first-out queue of fixed-length trajectories: IMPALA's on-policy input.

Actors cut each environment's stream into trajectories of ``length`` steps (observations carry
one more, the bootstrap state) and the learner dequeues batches of them; V-trace corrects for
the policy lag. An insert into a full queue waits for the learner (which holds the actors back:
on-policy experience made far ahead of the learner would only be older), at most
``timeout_seconds``, then drops the oldest trajectories (counted in ``dropped``); a learner
waiting for a batch waits at most ``timeout_seconds`` too. The learner itself never waits on an
insert.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from replicator.rl.rate_limiter import RateLimiterTimeoutError

__all__ = ["TrajectoryQueue"]


class TrajectoryQueue:
    """Up to ``capacity`` trajectories of ``length`` steps, oldest out first."""

    def __init__(self, length: int, capacity: int = 256, timeout_seconds: float = 60.0
                 ) -> None:
        for name, value in (("length", length), ("capacity", capacity)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be positive, got {timeout_seconds!r}")
        self.length = length
        self.capacity = capacity
        self.timeout_seconds = float(timeout_seconds)
        self.inserted = 0
        self.dropped = 0
        self.lockstep = False
        self._items: deque[dict[str, torch.Tensor]] = deque()
        self._cond = threading.Condition()
        self._closed = False

    def shard(self, index: int, num_shards: int) -> None:
        """Each learner replica holds its own queue (its actors' trajectories)."""

    def __len__(self) -> int:
        return len(self._items)

    def add(self, trajectories: dict[str, torch.Tensor], timeout_seconds: float | None = None
            ) -> None:
        """Enqueue a batch ``[B, length, ...]`` (``obs``: ``[B, length + 1, ...]``)."""
        sizes = {int(v.shape[0]) for v in trajectories.values()}
        if len(sizes) != 1:
            raise ValueError(f"trajectory fields have different batch sizes {sorted(sizes)}")
        steps = int(trajectories["action"].shape[1]) if "action" in trajectories else None
        if steps is not None and steps != self.length:
            raise ValueError(f"trajectories of {steps} steps offered to a TrajectoryQueue of "
                             f"length {self.length}. HINT: the actors' unroll length must match.")
        timeout = self.timeout_seconds if timeout_seconds is None else timeout_seconds
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._items) >= self.capacity and not self._closed \
                    and not self.lockstep and time.monotonic() < deadline:
                self._cond.wait(min(0.5, max(0.0, deadline - time.monotonic())))
            for i in range(sizes.pop()):
                self._items.append({k: v[i] for k, v in trajectories.items()})
                self.inserted += 1
                if len(self._items) > self.capacity:
                    self._items.popleft()
                    self.dropped += 1
            self._cond.notify_all()

    def ready(self, batch_size: int) -> bool:
        """Whether ``batch_size`` trajectories are queued (a get would not wait)."""
        with self._cond:
            return len(self._items) >= batch_size

    def get(self, batch_size: int, timeout_seconds: float | None = None
            ) -> dict[str, torch.Tensor]:
        """The oldest ``batch_size`` trajectories, stacked ``[batch_size, ...]``."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        timeout = self.timeout_seconds if timeout_seconds is None else timeout_seconds
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._items) < batch_size:
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    raise RateLimiterTimeoutError(
                        f"the learner waited {timeout:.0f} s for {batch_size} trajectories and "
                        f"has {len(self._items)}. HINT: the actors may be too few, slow or gone; "
                        "raise timeout_seconds or use a smaller batch.")
                self._cond.wait(min(left, 0.5))
            taken = [self._items.popleft() for _ in range(batch_size)]
            self._cond.notify_all()
        return {k: torch.stack([t[k] for t in taken]) for k in taken[0]}

    sample = get

    def as_dataset(self, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        """An endless iterator of batches: a replica's ``input_fn`` returns it."""
        while True:
            yield self.get(batch_size)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def state_dict(self) -> dict[str, Any]:
        with self._cond:
            return {"items": [dict(t) for t in self._items], "inserted": self.inserted,
                    "dropped": self.dropped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._cond:
            self._items = deque(dict(t) for t in state["items"])
            self.inserted, self.dropped = int(state["inserted"]), int(state["dropped"])
            self._cond.notify_all()
