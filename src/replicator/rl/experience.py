"""What an actor sends: n-step transitions (D4PG) or fixed-length trajectories (IMPALA).

The builder takes one vectorised environment step at a time and holds finished items until
the actor ships them, with the oldest weights version among them (the learner measures the
policy lag from it).
"""

from __future__ import annotations

import torch

from replicator.rl.n_step import NStepAccumulator

__all__ = ["ExperienceBuilder"]

KINDS = ("transitions", "trajectories")


class ExperienceBuilder:
    """``kind="transitions"``: ``n_step`` transitions; ``"trajectories"``: ``[N, length]``
    unrolls whose ``obs`` has ``length + 1`` entries (the last one bootstraps); ``done`` marks
    a termination (no bootstrap), ``truncated`` a time limit (the next observation is already
    the new episode's first: a learner may bootstrap from it or cut the trace there)."""

    def __init__(self, kind: str, n_step: int = 1, discount: float = 0.99,
                 unroll_length: int = 0) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if kind == "trajectories" and unroll_length < 1:
            raise ValueError("trajectories need unroll_length >= 1")
        self.kind = kind
        self.length = unroll_length
        self._adder = NStepAccumulator(n_step, discount)
        self._done: list[dict[str, torch.Tensor]] = []
        self._steps: list[dict[str, torch.Tensor]] = []
        self._obs: list[torch.Tensor] = []
        self._oldest: int | None = None
        self.count = 0

    def step(self, obs: torch.Tensor, action: torch.Tensor, reward: torch.Tensor,
             final_obs: torch.Tensor, terminated: torch.Tensor, truncated: torch.Tensor,
             extras: dict[str, torch.Tensor], version: int, next_obs: torch.Tensor) -> None:
        """One step of ``N`` environments; ``final_obs`` is the observation each step ended in
        (before an automatic reset), ``next_obs`` the one the next step starts from."""
        self._oldest = version if self._oldest is None else min(self._oldest, version)
        if self.kind == "transitions":
            out = self._adder.step(obs, action, reward, final_obs, terminated, truncated,
                                   extras)
            if out is not None:
                self._done.append(out)
                self.count += int(out["obs"].shape[0])
            return
        if not self._obs:
            self._obs.append(obs)
        step = {"action": action, "reward": reward, "done": terminated.to(torch.float32),
                "truncated": truncated.to(torch.float32), **extras}
        self._steps.append(step)
        self._obs.append(next_obs)
        if len(self._steps) == self.length:
            unroll = {"obs": torch.stack(self._obs, 1)}
            for name in step:
                unroll[name] = torch.stack([s[name] for s in self._steps], 1)
            self._done.append(unroll)
            self.count += int(obs.shape[0]) * 1_000_000  # an unroll ships at once
            self._steps, self._obs = [], [next_obs]

    def take(self) -> tuple[dict[str, torch.Tensor] | None, int]:
        """The finished items (fields concatenated) and their oldest version; clears them."""
        oldest = -1 if self._oldest is None else self._oldest
        if not self._done:
            return None, oldest
        items = {k: torch.cat([d[k] for d in self._done]) for k in self._done[0]}
        self._done, self.count, self._oldest = [], 0, None
        return items, oldest
