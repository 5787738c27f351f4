"""TorchRL's multi-process collector stepping what ``actors.py`` steps, for ``vs_torchrl``.

The peer of A actors is ``MultiAsyncCollector`` (TorchRL's asynchronous multi-process
collector, formerly ``MultiaSyncDataCollector``) with A worker processes: like our actors, each
worker steps its environments and hands over a batch of ``frames_per_batch`` frames as soon as it
has one, without waiting for the others. Each worker steps the same environments as an actor (a
Gymnasium ``SyncVectorEnv`` of ``num_envs`` copies in one process) through TorchRL's
``GymWrapper``, the class behind ``GymEnv`` (``GymEnv(id, num_envs=N)`` would run an
``AsyncVectorEnv``, N more processes per worker: another setup). The vector env leaves resets to
TorchRL (``AutoresetMode.DISABLED``, the mode TorchRL prefers: measured 2x faster in its
collector than the same-step reset our actors use). It acts with the same network and the same
greedy action. The main process only counts the frames it receives, as our learner counts the
env steps it receives.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

INSTALL_HINT = "pip install -e '.[rl,bench]' (the bench extra installs TorchRL)"


def available() -> bool:
    """True when TorchRL can be imported."""
    try:
        import torchrl  # noqa: F401
    except ImportError:
        return False
    return True


def version() -> str:
    """TorchRL's version (it must be installed)."""
    import torchrl

    return str(torchrl.__version__)


class _Greedy(torch.nn.Module):
    """The benchmark's policy network followed by its greedy action (an action index)."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs).argmax(-1)


def _quiet() -> None:
    logging.getLogger("torchrl").setLevel(logging.WARNING)


def _make_env(env_id: str, num_envs: int) -> Any:
    import gymnasium as gym
    from torchrl.envs import GymWrapper

    _quiet()
    envs = gym.vector.SyncVectorEnv([lambda: gym.make(env_id)] * num_envs,
                                    autoreset_mode=gym.vector.AutoresetMode.DISABLED)
    return GymWrapper(envs, categorical_action_encoding=True)


def _collector_class() -> Any:
    try:
        from torchrl.collectors import MultiAsyncCollector
    except ImportError:  # TorchRL before 0.11 spelt it this way
        from torchrl.collectors import MultiaSyncDataCollector as MultiAsyncCollector
    return MultiAsyncCollector


def env_steps_per_s(env_id: str, workers: int, num_envs: int, frames_per_batch: int,
                    policy_fn: Callable[[], torch.nn.Module], seconds: float,
                    warmup: float = 1.0) -> float:
    """Frames per second the main process receives from ``workers`` collector processes,
    counted over ``seconds`` from ``warmup`` seconds after the first batch arrived (start-up
    excluded as in our learner's count)."""
    from tensordict.nn import TensorDictModule

    _quiet()
    policy = TensorDictModule(_Greedy(policy_fn()), in_keys=["observation"],
                              out_keys=["action"])
    collector = _collector_class()(
        [partial(_make_env, env_id, num_envs)] * workers, policy,
        frames_per_batch=frames_per_batch, total_frames=-1, device="cpu",
        auto_register_policy_transforms=False)
    try:
        frames, first, t0 = 0, None, 0.0
        for batch in collector:
            now = time.perf_counter()
            if first is None:
                first = now
            elif t0 == 0.0 and now - first >= warmup:
                t0, frames = now, 0
            elif t0:
                frames += batch.numel()
                if now - t0 >= seconds:
                    return frames / (now - t0)
    finally:
        collector.shutdown()
        # Its weight-sync scheme shuts down in __del__, which hangs at interpreter exit
        # (TorchRL 0.14.1: a queue's feeder thread cannot start then): collect it now.
        del collector
        gc.collect()
    raise RuntimeError("the TorchRL collector ended before the measurement did")
