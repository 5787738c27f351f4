"""Who am I: rank, world and rendezvous address from a ``use_cluster`` spec or the environment
(replicator's launchers and torchrun, ``TF_CONFIG``, SLURM; else one replica)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from replicator.cluster.resolvers import ClusterSpec, detect

__all__ = ["ClusterSpec", "use_cluster", "resolve_cluster"]


_EXPLICIT: ClusterSpec | None = None


def use_cluster(spec: ClusterSpec | None) -> None:
    """Make ``spec`` what :func:`resolve_cluster` answers in this process (``None``: undo);
    called by ``MultiWorkerMirroredStrategy(cluster_resolver=...)`` before the group exists."""
    global _EXPLICIT
    if spec is not None and not isinstance(spec, ClusterSpec):
        raise TypeError(f"use_cluster takes a ClusterSpec, got {type(spec).__name__}")
    _EXPLICIT = spec


def resolve_cluster(env: Mapping[str, str] | None = None) -> ClusterSpec:
    """Read this process's place in the job (see module doc); ``env`` given: only from it."""
    if env is None and _EXPLICIT is not None:
        return _EXPLICIT
    return detect(os.environ if env is None else env)

