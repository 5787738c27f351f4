"""The actor role beside learner workers (``--num-actors``): checks and each actor's environment.

Actors are processes of their own after the ``--nproc`` learners. They hold no rank in the
learners' process group (a gloo group cannot lose or regain a member, and actors come and go):
their environment names their actor index and where the launcher's store is, from which they
find the learners. An actor killed, or failing, is restarted alone while restarts remain; one
killed with none left is lost and the learners go on.
"""

from __future__ import annotations

from typing import Any

from replicator.cluster.env_names import (
    ACTOR_INDEX_ENV,
    NUM_ACTORS_ENV,
    NUM_LEARNERS_ENV,
    REJOIN_ENV,
    RL_STORE_ENV,
)
from replicator.errors import ClusterConfigError

__all__ = ["check_num_actors", "actor_env"]

#: The learners' rendezvous variables an actor must not see (it would join their group).
_LEARNER_ONLY = ("WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def check_num_actors(num_actors: Any, num_ps: int = 0) -> int:
    """Validate ``--num-actors`` / ``num_actors=``: an integer >= 0, not beside servers."""
    if isinstance(num_actors, bool) or not isinstance(num_actors, int) or num_actors < 0:
        raise ClusterConfigError(f"num_actors must be an integer >= 0, got {num_actors!r}. "
                                 "HINT: --num-actors 2 starts two actor processes.")
    if num_actors and num_ps:
        raise ClusterConfigError("--num-actors and --num-ps cannot be combined: actors feed "
                                 "a synchronous learner, not parameter servers. HINT: drop "
                                 "one of them.")
    return num_actors


def actor_env(learner_env: dict[str, str], index: int, world: int, num_actors: int,
              store: str, restarts: int) -> dict[str, str]:
    """Actor ``index``'s environment, from a learner's: the launcher's process id
    ``world + index`` (for its error file and output), no learner rendezvous variables."""
    env = {k: v for k, v in learner_env.items() if k not in _LEARNER_ONLY}
    total = world + num_actors
    env.update({"RANK": str(world + index), "LOCAL_WORLD_SIZE": str(total),
                ACTOR_INDEX_ENV: str(index), NUM_ACTORS_ENV: str(num_actors),
                NUM_LEARNERS_ENV: str(world), RL_STORE_ENV: store,
                REJOIN_ENV: str(restarts)})
    env["OMP_NUM_THREADS"] = "1"
    return env
