"""Vectorised Gymnasium environments for an actor, and the checks that refuse bad ones early.

Gymnasium is an optional dependency (``pip install replicator[rl]``): it is imported here,
when an environment is first made, never when ``replicator.rl`` is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from replicator.errors import ClusterConfigError

__all__ = ["check_env", "make_vector_env", "env_name"]


def _gym() -> Any:
    try:
        import gymnasium
    except ImportError as exc:  # pragma: no cover - the rl extra installs it
        raise ImportError("replicator.rl's actors run Gymnasium environments. HINT: pip "
                          "install 'replicator[rl]' (or gymnasium>=1.0)") from exc
    return gymnasium


def env_name(env_fn: Any) -> str:
    """A name for errors and for the actors' spec check."""
    return env_fn if isinstance(env_fn, str) else getattr(env_fn, "__name__", repr(env_fn))


def check_env(env_fn: Any) -> None:
    """Refuse an environment id Gymnasium does not know, or something that is no function."""
    if isinstance(env_fn, str):
        gym = _gym()
        try:
            gym.spec(env_fn)
        except gym.error.Error as exc:
            raise ClusterConfigError(
                f"unknown environment id {env_fn!r}: {exc}. HINT: see "
                "gymnasium.pprint_registry() for the ids, or pass a function that builds "
                "the environment.") from exc
    elif not callable(env_fn):
        raise TypeError(f"env_fn must be an environment id or a function returning a "
                        f"gymnasium.Env, got {type(env_fn).__name__}")


def make_vector_env(env_fn: Any, num_envs: int) -> Any:
    """``num_envs`` copies in one process, reset in the same step as they end (the final
    observation is in ``info["final_obs"]``)."""
    gym = _gym()
    check_env(env_fn)
    make: Callable[[], Any] = (lambda: gym.make(env_fn)) if isinstance(env_fn, str) else env_fn
    return gym.vector.SyncVectorEnv([make] * num_envs,
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
