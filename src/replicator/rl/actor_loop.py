"""An actor loop the script writes itself: newest weights in, experience out, one step at a time.

:func:`~replicator.rl.actor.run_actor` is the library's loop. A script that steps its own
environment instead (its own exploration, a simulator that is no Gymnasium vector env) uses an
:class:`ActorSession` through ``ActorLearner.latest_weights()`` and ``ActorLearner.send()``:
the same connections, messages and experience builder as the library's loop, so the learner
cannot tell them apart. Asking for weights is answered by a learner thread from its last
snapshot, so the learner's training loop never waits on it; each batch sent carries the oldest
weights version among its steps (the learner's policy-lag accounting).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from replicator.errors import ClusterConfigError
from replicator.ps.messages import PeerLostError
from replicator.rl.actor import ActorConfig, _Links, _wait_weights, named_weights
from replicator.rl.environments import env_name, make_vector_env
from replicator.rl.experience import ExperienceBuilder

__all__ = ["ActorSession"]


def _batched(value: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.as_tensor(np.asarray(value), dtype=dtype)


class ActorSession:
    """One actor's link to the learners for a script-written loop (connects on first use)."""

    def __init__(self, cfg: ActorConfig, env_fn: Any,
                 policy_fn: Callable[[], torch.nn.Module]) -> None:
        self.cfg = cfg
        self.env_fn, self.policy_fn = env_fn, policy_fn
        self.version = -1  # the weights version last handed out by latest_weights()
        self.done = False  # the learners ended
        self.env_steps = 0
        self._links: _Links | None = None
        self._template: dict[str, torch.Tensor] | None = None
        self._builder = ExperienceBuilder(cfg.kind, cfg.n_step, cfg.discount, cfg.unroll_length)
        self._returns: np.ndarray | None = None
        self._finished: list[float] = []
        self._sent_steps = 0
        self._target = 0
        self._last_poll = 0.0

    def _connect(self) -> _Links:
        if self._links is None:
            envs = make_vector_env(self.env_fn, 1)  # only to tell the learners its spaces
            try:
                shape = list(envs.single_observation_space.shape or ())
            finally:
                envs.close()
            spec = {"kind": self.cfg.kind, "env": env_name(self.env_fn), "obs_shape": shape,
                    "actor": self.cfg.index}
            self._links = _Links(self.cfg, spec)
        return self._links

    def _named(self, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._template is None:
            self._template = self.policy_fn().state_dict()
        return named_weights(self._template, tensors)

    def latest_weights(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """``(version, state_dict)`` newer than the version last returned, else ``None``
        (also once the learners ended: see ``done``). The first call waits for the first
        publication (at most ``timeout_seconds``); later calls ask at most every
        ``poll_seconds`` and never wait for the learner's training loop."""
        if self.done:
            return None
        links = self._connect()
        try:
            if self.version < 0:
                got = _wait_weights(self.cfg, links, -1, 0)
            elif time.monotonic() - self._last_poll < self.cfg.poll_seconds:
                return None
            else:
                got = links.ask(self.version, 0)
        except PeerLostError:
            got = None
            links.done = True
        self._last_poll = time.monotonic()
        self.done = links.done
        if got is None:
            return None
        self.version = got[0]
        return got[0], self._named(got[1])

    def send(self, obs: Any, action: Any, reward: Any, next_obs: Any, terminated: Any,
             truncated: Any, *, version: int | None = None, final_obs: Any = None,
             extras: dict[str, torch.Tensor] | None = None) -> bool:
        """Add one environment step (one env: unbatched values; ``N`` envs: leading dim
        ``N``); ships a batch every ``send_every`` items. False once the learners ended."""
        if self.done:
            return False
        if version is None:
            version = self.version
        if version < 0:
            raise ClusterConfigError(
                f"actor {self.cfg.index}: experience needs the weights version that made it, "
                "and none was received yet. HINT: call latest_weights() first and act with "
                "the weights it returns (or pass version=).")
        rew = _batched(reward, torch.float32)
        single = rew.dim() == 0

        def prep(value: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
            tensor = value if isinstance(value, torch.Tensor) else _batched(value, dtype)
            return tensor.unsqueeze(0) if single else tensor

        obs_t, next_t = prep(obs, torch.float32), prep(next_obs, torch.float32)
        final_t = next_t if final_obs is None else prep(final_obs, torch.float32)
        term, trunc = prep(terminated, torch.bool), prep(truncated, torch.bool)
        rew = prep(rew)
        more = {k: prep(v) for k, v in (extras or {}).items()}
        self._builder.step(obs_t, prep(action), rew, final_t, term, trunc, more, version,
                           next_t)
        self._count_episodes(rew, term | trunc)
        if self._builder.count >= self.cfg.send_every:
            self.flush()
        return not self.done

    def _count_episodes(self, reward: torch.Tensor, ended: torch.Tensor) -> None:
        if self._returns is None or len(self._returns) != len(reward):
            self._returns = np.zeros(len(reward))
        self._returns += reward.numpy()
        self.env_steps += len(reward)
        for i in np.nonzero(ended.numpy())[0]:
            self._finished.append(float(self._returns[i]))
            self._returns[i] = 0

    def flush(self) -> None:
        """Ship the finished items now (round robin over the learners' shards)."""
        items, oldest = self._builder.take()
        if items is None or self.done:
            return
        steps = self.env_steps - self._sent_steps
        self._sent_steps = self.env_steps
        returns, self._finished = self._finished, []
        try:
            self._connect().send(self._target, items, oldest, steps, 0, returns,
                                 self.env_steps)
        except PeerLostError:
            self.done = True
        self._target += 1

    def close(self) -> None:
        """Send what is left and say goodbye to the learners."""
        if self._links is None:
            return
        if not self.done:
            self.flush()
        self._links.close()
        self._links = None
        self.done = True
