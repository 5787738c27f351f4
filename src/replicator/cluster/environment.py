"""Who am I: resolve rank, world and rendezvous address from the launcher's environment.

Sources, in this order: a :class:`ClusterSpec` installed explicitly (``use_cluster``, e.g. by
``MultiWorkerMirroredStrategy(cluster_resolver=...)``), replicator's launchers and ``torchrun``
(``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``), a ``TF_CONFIG`` JSON cluster
description, SLURM (``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_NODELIST``), and nothing at all
(a plain ``python script.py``: one replica). The parsers live in :mod:`.resolvers`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from replicator.cluster.env_names import TIMEOUT_ENV
from replicator.errors import ClusterConfigError


@dataclass(frozen=True)
class ClusterSpec:
    """The position of this process in the job; give one explicitly to pin it yourself.

    ``ClusterSpec(rank=2, world_size=4, local_world_size=2, master_addr="10.0.0.1",
    master_port=29500)``: rank 0 (the chief) hosts the rendezvous store on ``master_addr``.
    ``node_rank`` defaults (-1) to ``rank // local_world_size``, ``local_rank`` to the rest.
    """

    rank: int
    world_size: int
    local_rank: int = -1
    local_world_size: int = 1
    node_rank: int = -1
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    restart_count: int = 0
    store_is_hosted: bool = False
    source: str = "explicit"
    role: str = "worker"
    #: ``host:port`` of every rank where the source names them (TF_CONFIG), for error messages.
    addresses: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("rank", "world_size", "local_world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ClusterConfigError(f"ClusterSpec.{name} must be an integer, got {value!r}")
        if self.world_size < 1:
            raise ClusterConfigError(f"ClusterSpec: world_size={self.world_size}; the world "
                                     "needs at least one replica")
        if not 0 <= self.rank < self.world_size:
            raise ClusterConfigError(f"ClusterSpec: rank={self.rank} is outside "
                                     f"0..{self.world_size - 1} (world_size={self.world_size})")
        if self.local_world_size < 1:
            raise ClusterConfigError(f"ClusterSpec: local_world_size={self.local_world_size} "
                                     "must be at least 1")
        if self.local_rank == -1:
            object.__setattr__(self, "local_rank", self.rank % self.local_world_size)
        if self.node_rank == -1:
            object.__setattr__(self, "node_rank", self.rank // self.local_world_size)
        if not 0 <= self.local_rank < self.local_world_size:
            raise ClusterConfigError(f"ClusterSpec: local_rank={self.local_rank} is outside "
                                     f"0..{self.local_world_size - 1}")
        if self.world_size > 1 and self.master_port is None:
            raise ClusterConfigError(
                f"ClusterSpec: master_port is not set but world_size={self.world_size}. HINT: "
                "give the chief's rendezvous port, the same on every process.")

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    def resolve(self, env: Mapping[str, str] | None = None) -> ClusterSpec:
        """A spec is its own resolver (so it can be passed as ``cluster_resolver``)."""
        return self


_EXPLICIT: ClusterSpec | None = None


def use_cluster(spec: ClusterSpec | None) -> None:
    """Make ``spec`` what :func:`resolve_cluster` answers in this process (``None``: undo).

    Called by ``MultiWorkerMirroredStrategy(cluster_resolver=...)`` before the process group
    exists, so every part of replicator agrees on this process's rank.
    """
    global _EXPLICIT
    if spec is not None and not isinstance(spec, ClusterSpec):
        raise TypeError(f"use_cluster takes a ClusterSpec, got {type(spec).__name__}")
    _EXPLICIT = spec


def resolve_cluster(env: Mapping[str, str] | None = None) -> ClusterSpec:
    """Read this process's place in the job (see module doc); ``env`` given: only from it."""
    if env is None and _EXPLICIT is not None:
        return _EXPLICIT
    from replicator.cluster.resolvers import detect

    return detect(os.environ if env is None else env)


def timeout_from_env(default: float, env: Mapping[str, str] | None = None) -> float:
    """The collective timeout in seconds set by the launcher, else ``default``."""
    env = os.environ if env is None else env
    raw = env.get(TIMEOUT_ENV)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ClusterConfigError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ClusterConfigError(f"{TIMEOUT_ENV} must be positive, got {value}")
    return value
