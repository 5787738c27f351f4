"""Where a process stands among the replica groups: read once from the environment, set by
``replicator run --replica-groups N`` or by the user per torchrun group (docs/fault_tolerance.md,
"Running groups yourself", lists the variables).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from replicator.cluster.env_names import (
    LIGHTHOUSE_ENV,
    LIVE_BIND_ENV,
    MIN_REPLICAS_ENV,
    REPLICA_GROUP_ENV,
    REPLICA_GROUPS_ENV,
)
from replicator.cluster.timeouts import env_number
from replicator.errors import ClusterConfigError

COLLECTIVE_TIMEOUT_ENV = "REPLICATOR_LIVE_TIMEOUT_SECONDS"
QUORUM_TIMEOUT_ENV = "REPLICATOR_QUORUM_TIMEOUT_SECONDS"
QUORUM_EVERY_ENV = "REPLICATOR_QUORUM_EVERY_STEPS"
TRANSPORT_ENV = "REPLICATOR_LIVE_TRANSPORT"
TRANSPORTS = ("auto", "gloo")

#: True while a strategy builds another as its part (a two-level strategy's inner group).
_BUILDING_PART: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "replicator_live_building_part", default=False)


@contextlib.contextmanager
def building_part() -> Iterator[None]:
    """Inside the block :meth:`LiveSettings.from_env` answers ``None`` (a part of another)."""
    token = _BUILDING_PART.set(True)
    try:
        yield
    finally:
        _BUILDING_PART.reset(token)


@dataclass(frozen=True)
class LiveSettings:
    """This process's replica group, the lighthouse and the waits (see the module doc)."""

    group: int
    groups: int
    lighthouse: str
    min_replicas: int
    rank: int
    group_size: int
    collective_timeout: float = 10.0
    quorum_timeout: float = 60.0
    bind: str = "127.0.0.1"
    quorum_every: int = 10
    transport: str = "auto"

    @property
    def who(self) -> str:
        """``replica group g, rank r`` for messages."""
        return f"replica group {self.group}, rank {self.rank}"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LiveSettings | None:
        """The settings when ``REPLICATOR_REPLICA_GROUPS`` is set (not in :func:`building_part`)."""
        env = os.environ if env is None else env
        if not env.get(REPLICA_GROUPS_ENV) or _BUILDING_PART.get():
            return None
        try:
            groups = int(env[REPLICA_GROUPS_ENV])
            group = int(env.get(REPLICA_GROUP_ENV, ""))
        except ValueError:
            raise ClusterConfigError(
                f"{REPLICA_GROUPS_ENV}={env.get(REPLICA_GROUPS_ENV)!r} needs an integer "
                f"{REPLICA_GROUP_ENV} (this process's group, 0..N-1), got "
                f"{env.get(REPLICA_GROUP_ENV)!r}. HINT: launch with `replicator run "
                "--replica-groups N`, or set both for each torchrun-launched group") from None
        if groups < 1 or group < 0:
            raise ClusterConfigError(f"{REPLICA_GROUPS_ENV}={groups} and {REPLICA_GROUP_ENV}="
                                     f"{group} must be a positive count and a group id >= 0")
        lighthouse = env.get(LIGHTHOUSE_ENV, "")
        if not lighthouse:
            raise ClusterConfigError(
                f"replica group {group} has no lighthouse: {LIGHTHOUSE_ENV} is not set. HINT: "
                f"`replicator run --replica-groups N` starts one; with torchrun start "
                f"`torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:29510` and set "
                f"{LIGHTHOUSE_ENV}=http://127.0.0.1:29510")
        if "://" not in lighthouse:
            lighthouse = f"http://{lighthouse}"
        min_replicas = int(env_number(env, MIN_REPLICAS_ENV, 1, "replica groups"))
        rank, group_size = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
        collective_timeout = env_number(env, COLLECTIVE_TIMEOUT_ENV, 10.0)
        quorum_timeout = env_number(env, QUORUM_TIMEOUT_ENV, 60.0)
        quorum_every = env_number(env, QUORUM_EVERY_ENV, 10, "steps")
        if quorum_every != int(quorum_every):
            raise ClusterConfigError(f"{QUORUM_EVERY_ENV}={env[QUORUM_EVERY_ENV]!r} must be a "
                                     "whole number of steps")
        transport = env.get(TRANSPORT_ENV, "") or "auto"
        if transport not in TRANSPORTS:
            raise ClusterConfigError(f"{TRANSPORT_ENV}={transport!r} must be one of "
                                     f"{', '.join(TRANSPORTS)}")
        return cls(group=group, groups=groups, lighthouse=lighthouse, min_replicas=min_replicas,
                   rank=rank, group_size=group_size, collective_timeout=collective_timeout,
                   quorum_timeout=quorum_timeout,
                   bind=env.get(LIVE_BIND_ENV, "127.0.0.1") or "127.0.0.1",
                   quorum_every=int(quorum_every), transport=transport)
