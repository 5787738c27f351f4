"""Environments stepped inside the learner: ``ActorLearner(..., in_process=True)``.

Before each sample the learner steps its own ``num_envs`` environments with the weights it last
published, as many vector steps as the replay needs for the next batch (the rate limiter's
samples per insert, or a trajectory queue's batch), through the same stepper and experience
builder an actor process uses. No actor process, no transport, experience never older than
``publish_every`` steps: the one-process run the actors' speed-up is measured against
(``time_to_reference`` in ``benchmarks/rl_reference.py``), and a way to debug a script's learning
in one process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from replicator.rl.actor import ActorConfig, Stepper, base_seed, named_weights
from replicator.rl.experience import ExperienceBuilder
from replicator.rl.policy_lag import PolicyLags
from replicator.rl.replay import ReplayBuffer
from replicator.rl.trajectory_queue import TrajectoryQueue

__all__ = ["InProcessActor"]


class InProcessActor:
    """One learner replica's environments, stepped on demand into its replay shard; for the
    learner it stands where the experience server stands (publish, snapshot, stats, episodes,
    close)."""

    def __init__(self, cfg: ActorConfig, env_fn: Any, policy_fn: Callable[[], torch.nn.Module],
                 act_fn: Callable[..., Any] | None, replay: ReplayBuffer | TrajectoryQueue
                 ) -> None:
        self.cfg = cfg
        self.replay = replay
        self.stepper = Stepper(cfg, env_fn, policy_fn, act_fn)
        self.builder = ExperienceBuilder(cfg.kind, cfg.n_step, cfg.discount, cfg.unroll_length)
        self.stepper.reset(base_seed(cfg))
        self.version = -1
        self.step = 0  # the learner's step, which the experience's policy lag is measured to
        self._weights: list[torch.Tensor] = []
        self.items = 0
        self.lags = PolicyLags()
        self.episodes: list[tuple[float, int, float]] = []  # (return, env steps, seconds)
        self._started = time.monotonic()

    @property
    def env_steps(self) -> int:
        return self.stepper.vector_steps * self.cfg.num_envs

    def publish(self, version: int, tensors: list[torch.Tensor]) -> None:
        """Act with ``tensors`` (the published state dict's values, copied) from now on."""
        self._weights = [t.detach().to("cpu", copy=True) for t in tensors]
        self.stepper.policy.load_state_dict(
            named_weights(self.stepper.policy.state_dict(), self._weights))
        self.version = version

    def snapshot(self) -> tuple[int, list[torch.Tensor]] | None:
        """The weights last loaded and their version, as the experience server keeps them."""
        return None if self.version < 0 else (self.version, list(self._weights))

    def fill(self, batch_size: int) -> None:
        """Step the environments until the replay can give ``batch_size`` items."""
        if self.version < 0:
            raise RuntimeError(
                f"learner {self.cfg.index}: in_process=True acts with the published weights, "
                "and none were published yet. HINT: pass batches(policy=model), or call "
                "publish_weights(model) before the first batch.")
        if isinstance(self.replay, TrajectoryQueue) and batch_size > self.replay.capacity:
            raise ValueError(f"a batch of {batch_size} trajectories from a TrajectoryQueue of "
                             f"capacity {self.replay.capacity}. HINT: raise its capacity.")
        deadline = time.monotonic() + self.cfg.timeout_seconds
        while not self.replay.ready(batch_size):
            self.stepper.step(self.builder, self.version)
            items, _ = self.builder.take()
            if items is not None:
                self.items += int(next(iter(items.values())).shape[0])
                self.lags.add(self.step - self.version)
                self.replay.add(items)
            now = time.monotonic()
            self.episodes.extend((r, self.env_steps, now - self._started)
                                 for r in self.stepper.take_returns())
            if now > deadline:
                raise TimeoutError(
                    f"learner {self.cfg.index}: {self.env_steps} environment steps in "
                    f"{self.cfg.timeout_seconds:.0f} s did not make a batch of {batch_size} "
                    f"sampleable from {type(self.replay).__name__}. HINT: check the replay's "
                    "min_size_to_sample and capacity against the batch size.")

    def stats(self) -> dict[str, Any]:
        """The experience server's figures, for the steps made here."""
        return {"env_steps": self.env_steps, "items": self.items, **self.lags.figures(),
                "stale_dropped": 0, "episodes": len(self.episodes), "joins": []}

    def close(self) -> None:
        self.stepper.envs.close()
