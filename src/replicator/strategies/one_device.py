"""OneDeviceStrategy: everything on one device, one replica; the reference for equivalence."""

from __future__ import annotations

import warnings

import torch

from replicator.cluster.devices import parse_device
from replicator.cluster.environment import resolve_cluster
from replicator.strategies.base import Strategy
from replicator.strategies.replicas import ReplicaGroup


class OneDeviceStrategy(Strategy):
    """Run on a single device (``None``: the first GPU if any, else the CPU), with no process
    group: ``reduce``/``gather`` return the local value. ``check_finite``: see ``Strategy``.
    """

    name = "one_device"

    def __init__(self, device: str | torch.device | None = None, *,
                 check_finite: bool = False) -> None:
        self._replica_group = ReplicaGroup.single(parse_device(device))
        spec = resolve_cluster()
        if spec.world_size > 1:
            warnings.warn(
                f"OneDeviceStrategy in a job of {spec.world_size} processes (rank {spec.rank}): "
                "every process trains its own independent model on its own data and acts as "
                "the chief (prints, writes checkpoints). HINT: use rp.MirroredStrategy() to "
                "train one model on every process, or launch a single process.",
                UserWarning, stacklevel=2)
        super().__init__(check_finite=check_finite)
