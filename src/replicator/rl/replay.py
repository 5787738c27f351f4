"""The replay buffer between actors and an off-policy learner (D4PG's shape, Reverb's limiter).

Each learner replica holds one shard (``capacity / num_shards`` items): its actors' transitions
land there and its ``step_fn`` samples its per-replica batch from it, so a synchronous strategy
reads the replay as it reads any per-replica ``input_fn``. Sampling is uniform or prioritised
(``p_i^alpha``, importance weights ``(N p_i)^-beta`` normalised by their maximum); new items get
the largest priority seen. Storage is a ring of preallocated tensors, one per field. Everything
that decides the next sample (contents, priorities, the sampler's generator, the limiter's
counters, unfinished n-step windows) is in :meth:`ReplayBuffer.state_dict`, so a resumed learner
samples what an uninterrupted one would.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import torch

from replicator.rl.n_step import NStepAccumulator
from replicator.rl.rate_limiter import SampleToInsertRatio

__all__ = ["ReplayBuffer"]


class ReplayBuffer:
    """A ring of transitions with uniform or prioritised sampling and a rate limiter.

    ``n_step``/``discount``: how actors (or :meth:`add_steps`) build transitions.
    ``samples_per_insert``, ``min_size_to_sample``, ``error_buffer``: the
    :class:`~replicator.rl.rate_limiter.SampleToInsertRatio`. ``timeout_seconds``: the longest
    a sample or an insert waits. ``seed``: the sampler's generator.
    """

    def __init__(self, capacity: int, *, prioritized: bool = False, alpha: float = 0.6,
                 beta: float = 0.4, n_step: int = 1, discount: float = 0.99,
                 samples_per_insert: float | None = None, min_size_to_sample: int = 1,
                 error_buffer: float | None = None, timeout_seconds: float = 60.0,
                 seed: int = 0) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        self.capacity = capacity
        self.prioritized = bool(prioritized)
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.n_step = n_step
        self.discount = discount
        self.seed = int(seed)
        self.limiter = SampleToInsertRatio(samples_per_insert, min_size_to_sample,
                                           error_buffer, timeout_seconds)
        self._adder = NStepAccumulator(n_step, discount)  # validates n_step and discount
        self._lock: threading.Condition = self.limiter.lock
        self._generator = torch.Generator().manual_seed(self.seed)
        self._storage: dict[str, torch.Tensor] = {}
        self._priorities = torch.zeros(0, dtype=torch.float64)
        self._max_priority = 1.0
        self._size = 0
        self._next = 0
        self.lockstep = False

    def shard(self, index: int, num_shards: int) -> None:
        """Make this buffer shard ``index`` of ``num_shards``: its capacity becomes its share
        and its generator a seed of its own (called by the learner before any insert)."""
        if self._size:
            raise RuntimeError("shard() must come before the first insert")
        self.capacity = max(1, -(-self.capacity // num_shards))
        self._generator = torch.Generator().manual_seed(self.seed * 1009 + index)

    def __len__(self) -> int:
        return self._size

    # inserting
    def add(self, transitions: dict[str, torch.Tensor], timeout_seconds: float | None = None
            ) -> None:
        """Insert a batch of finished transitions (every field with the same leading size);
        waits while the rate limiter holds inserts back."""
        count = _batch_size(transitions)
        if count == 0:
            return
        with self._lock:
            self.limiter.wait(self.limiter.can_insert, "an insert into the replay",
                              timeout_seconds, ignore=self.lockstep)
            self._write(transitions, count)
            self.limiter.inserted += count
            self._lock.notify_all()

    def add_steps(self, obs: torch.Tensor, action: torch.Tensor, reward: torch.Tensor,
                  next_obs: torch.Tensor, terminated: torch.Tensor, truncated: torch.Tensor,
                  extras: dict[str, torch.Tensor] | None = None) -> None:
        """Insert one vectorised environment step; ``n_step`` transitions are built here."""
        finished = self._adder.step(obs, action, reward, next_obs, terminated, truncated,
                                    extras)
        if finished is not None:
            self.add(finished)

    def _write(self, transitions: dict[str, torch.Tensor], count: int) -> None:
        if not self._storage:
            for name, value in transitions.items():
                self._storage[name] = torch.zeros((self.capacity, *value.shape[1:]),
                                                  dtype=value.dtype)
            self._priorities = torch.zeros(self.capacity, dtype=torch.float64)
        if set(transitions) != set(self._storage):
            raise ValueError(f"transition fields {sorted(transitions)} differ from the "
                             f"replay's {sorted(self._storage)}")
        if count > self.capacity:  # only the newest fit
            transitions = {k: v[-self.capacity:] for k, v in transitions.items()}
            count = self.capacity
        for name, value in transitions.items():
            if tuple(value.shape[1:]) != tuple(self._storage[name].shape[1:]):
                raise ValueError(f"field {name!r} has shape {tuple(value.shape[1:])} per item; "
                                 f"the replay holds {tuple(self._storage[name].shape[1:])}. "
                                 "HINT: every actor must run environments with the same spaces.")
        # the ring's two slices (the second only when the batch wraps): copies, not index_put
        head = min(count, self.capacity - self._next)
        for name, value in transitions.items():
            store = self._storage[name]
            store[self._next:self._next + head] = value[:head]
            if count > head:
                store[:count - head] = value[head:]
        self._priorities[self._next:self._next + head] = self._max_priority
        if count > head:
            self._priorities[:count - head] = self._max_priority
        self._next = (self._next + count) % self.capacity
        self._size = min(self.capacity, self._size + count)

    # sampling
    def ready(self, batch_size: int) -> bool:
        """Whether a sample of ``batch_size`` would be let through now (without waiting)."""
        with self._lock:
            return self._size > 0 and self.limiter.can_sample(batch_size)

    def sample(self, batch_size: int, timeout_seconds: float | None = None
               ) -> dict[str, torch.Tensor]:
        """``batch_size`` transitions (fields stacked) plus ``indices`` and, when prioritised,
        ``weights``; waits while the rate limiter holds samples back."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.limiter.check_sample_size(batch_size)
        with self._lock:
            self.limiter.wait(lambda: self.limiter.can_sample(batch_size) and self._size > 0,
                              f"a sample of {batch_size} from the replay", timeout_seconds,
                              ignore=self.lockstep and self._size > 0)
            if self._size == 0:
                raise RuntimeError("sample() from an empty replay in lockstep mode")
            batch = self._draw(batch_size)
            self.limiter.sampled += batch_size
            self._lock.notify_all()
        return batch

    def _draw(self, batch_size: int) -> dict[str, torch.Tensor]:
        size = self._size
        if self.prioritized:
            probs = self._priorities[:size] ** self.alpha
            probs = probs / probs.sum()
            index = torch.multinomial(probs, batch_size, replacement=True,
                                      generator=self._generator)
            weights = (size * probs[index]) ** (-self.beta)
            weights = (weights / weights.max()).to(torch.float32)
        else:
            index = torch.randint(0, size, (batch_size,), generator=self._generator)
        out = {name: store[index].clone() for name, store in self._storage.items()}
        out["indices"] = index
        if self.prioritized:
            out["weights"] = weights
        return out

    def update_priorities(self, indices: torch.Tensor, priorities: torch.Tensor) -> None:
        """Set the priorities of sampled items (e.g. their absolute TD errors)."""
        p = priorities.detach().to(torch.float64).reshape(-1).abs() + 1e-6
        with self._lock:
            self._priorities[indices.reshape(-1)] = p
            self._max_priority = max(self._max_priority, float(p.max()))

    def as_dataset(self, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        """An endless iterator of samples: a replica's ``input_fn`` returns it."""
        while True:
            yield self.sample(batch_size)

    def close(self) -> None:
        """Wake every waiting sample or insert (they raise)."""
        self.limiter.close()

    # exact resume
    def state_dict(self) -> dict[str, Any]:
        """Contents, priorities, sampler generator, limiter counters, n-step windows."""
        with self._lock:
            return {"capacity": self.capacity, "size": self._size, "next": self._next,
                    "storage": {k: v[:self._size].clone() if self._size < self.capacity
                                else v.clone() for k, v in self._storage.items()},
                    "priorities": self._priorities[:self._size].clone(),
                    "max_priority": self._max_priority,
                    "generator": self._generator.get_state(),
                    "limiter": self.limiter.state_dict(), "adder": self._adder.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self.capacity = int(state["capacity"])
            self._size, self._next = int(state["size"]), int(state["next"])
            self._storage = {}
            for name, value in state["storage"].items():
                store = torch.zeros((self.capacity, *value.shape[1:]), dtype=value.dtype)
                store[:value.shape[0]] = value
                self._storage[name] = store
            self._priorities = torch.zeros(self.capacity, dtype=torch.float64)
            self._priorities[:self._size] = state["priorities"]
            self._max_priority = float(state["max_priority"])
            self._generator.set_state(state["generator"])
            self.limiter.load_state_dict(state["limiter"])
            self._adder.load_state_dict(state["adder"])


def _batch_size(batch: dict[str, torch.Tensor]) -> int:
    sizes = {int(v.shape[0]) for v in batch.values()}
    if len(sizes) != 1:
        raise ValueError(f"the fields of a batch of transitions have different leading sizes "
                         f"{sorted(sizes)}")
    return sizes.pop()
