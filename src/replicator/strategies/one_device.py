"""OneDeviceStrategy: everything on one device, one replica; the reference for equivalence."""

from __future__ import annotations

import warnings

import torch

from replicator.cluster.devices import parse_device
from replicator.cluster.environment import resolve_cluster
from replicator.comm.reduce_op import ReduceOp
from replicator.strategies.base import Strategy


class OneDeviceStrategy(Strategy):
    """Run on a single device (``None``: the first GPU if any, else the CPU).

    No process group is needed; ``reduce`` and ``gather`` return the local value.
    """

    name = "one_device"

    def __init__(self, device: str | torch.device | None = None) -> None:
        self._device = parse_device(device)
        spec = resolve_cluster()
        if spec.world_size > 1:
            warnings.warn(
                f"OneDeviceStrategy in a job of {spec.world_size} processes (rank {spec.rank}): "
                "every process trains its own independent model on its own data and acts as "
                "the chief (prints, writes checkpoints). HINT: use rp.MirroredStrategy() to "
                "train one model on every process, or launch a single process.",
                UserWarning, stacklevel=2)
        super().__init__()

    @property
    def num_replicas_in_sync(self) -> int:
        return 1

    @property
    def device(self) -> torch.device:
        return self._device

    def _reduce(self, op: ReduceOp, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.to(self._device, copy=True)
        if op is ReduceOp.MEAN and not out.is_floating_point():
            out = out.to(torch.get_default_dtype())
        return out

    def _gather(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        tensor = tensor.to(self._device, copy=True)
        return tensor.reshape(1) if tensor.dim() == 0 else tensor
