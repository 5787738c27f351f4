"""n-step transitions from a stream of vectorised environment steps (D4PG's adder).

A transition ``(obs_t, action_t, reward, discount, next_obs)`` sums ``n`` rewards with their
discounts, ``reward = sum_k gamma^k r_{t+k}``, and bootstraps from ``next_obs = obs_{t+n}``
with ``discount = gamma^n`` (0 after a termination; a truncation still bootstraps). The same
accumulator runs in an actor (which then sends finished transitions) and in
:meth:`ReplayBuffer.add_steps` (one process), so there is one implementation of the rule.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

__all__ = ["NStepAccumulator", "TRANSITION_FIELDS"]

#: The fields of a transition, in the order they travel (extras follow them).
TRANSITION_FIELDS = ("obs", "action", "reward", "discount", "next_obs")


class NStepAccumulator:
    """Per-environment windows of the last ``n`` steps; ``step`` returns finished transitions."""

    def __init__(self, n_step: int = 1, discount: float = 0.99) -> None:
        if isinstance(n_step, bool) or not isinstance(n_step, int) or n_step < 1:
            raise ValueError(f"n_step must be an integer >= 1, got {n_step!r}")
        if not 0.0 <= discount <= 1.0:
            raise ValueError(f"discount must be in [0, 1], got {discount!r}")
        self.n_step = n_step
        self.discount = float(discount)
        self._windows: list[deque[dict[str, torch.Tensor]]] = []

    def step(self, obs: torch.Tensor, action: torch.Tensor, reward: torch.Tensor,
             next_obs: torch.Tensor, terminated: torch.Tensor, truncated: torch.Tensor,
             extras: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor] | None:
        """Add one step of ``N`` environments (leading dimension ``N`` everywhere); return the
        transitions it finished as a batch (``None`` when none)."""
        num_envs = obs.shape[0]
        if self.n_step == 1:  # every step is a finished transition: no windows, no loop
            out1 = {"obs": obs, "action": action, "reward": reward.to(torch.float32),
                    **(extras or {})}
            out1["discount"] = torch.where(terminated.bool(), 0.0, self.discount).to(
                torch.float32)
            out1["next_obs"] = next_obs
            return out1
        while len(self._windows) < num_envs:
            self._windows.append(deque())
        out: list[dict[str, torch.Tensor]] = []
        for i in range(num_envs):
            window = self._windows[i]
            entry = {"obs": obs[i], "action": action[i], "reward": reward[i].to(torch.float32)}
            for name, value in (extras or {}).items():
                entry[name] = value[i]
            window.append(entry)
            done = bool(terminated[i]) or bool(truncated[i])
            while window and (done or len(window) == self.n_step):
                out.append(self._emit(window, next_obs[i], bool(terminated[i])))
        if not out:
            return None
        return {name: torch.stack([t[name] for t in out]) for name in out[0]}

    def _emit(self, window: deque[dict[str, torch.Tensor]], next_obs: torch.Tensor,
              terminated: bool) -> dict[str, torch.Tensor]:
        """The transition that starts at the window's oldest step (which leaves the window)."""
        total = torch.zeros((), dtype=torch.float32)
        scale = 1.0
        for entry in window:
            total = total + scale * entry["reward"]
            scale *= self.discount
        first = window.popleft()
        out = dict(first)
        out["reward"] = total
        out["discount"] = torch.tensor(0.0 if terminated else scale, dtype=torch.float32)
        out["next_obs"] = next_obs
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"windows": [[dict(e) for e in w] for w in self._windows]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._windows = [deque(dict(e) for e in w) for w in state["windows"]]
