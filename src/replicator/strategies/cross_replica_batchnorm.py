"""BatchNorm over the global batch: statistics computed across every replica's part.

Plain BatchNorm normalises each replica's part alone, unlike one device with the global batch.
:func:`convert_batchnorm` turns every BatchNorm layer in place into its cross-replica form: the
per-channel sums and counts go into one differentiable all-reduce and it normalises with the
global statistics (float64 sums). Unlike ``SyncBatchNorm`` it runs on CPU too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

_CLASSES: dict[type, type] = {}


class _CrossReplicaMixin:
    """The forward of a BatchNorm layer normalising with statistics over every replica."""

    replica_group: dist.ProcessGroup | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        bn: Any = self
        bn._check_input_dim(x)
        group = self.replica_group
        if not (bn.training and dist.is_initialized() and dist.get_world_size(group) > 1):
            return super().forward(x)  # type: ignore[misc]
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        local = torch.cat([x.sum(dims), (x * x).sum(dims),
                           x.new_full((1,), x.numel() // max(channels, 1))])
        total = dist_nn.all_reduce(local.to(torch.float64), group=group)
        count = total[-1]
        mean = total[:channels] / count
        var = (total[channels:2 * channels] / count - mean * mean).clamp_min(0)
        if bn.track_running_stats and bn.running_mean is not None:
            with torch.no_grad():
                bn.num_batches_tracked.add_(1)
                momentum = bn.momentum if bn.momentum is not None else \
                    1.0 / float(bn.num_batches_tracked)
                unbiased = var * count / (count - 1).clamp_min(1)
                bn.running_mean.mul_(1 - momentum).add_(mean.to(x.dtype), alpha=momentum)
                bn.running_var.mul_(1 - momentum).add_(unbiased.to(x.dtype), alpha=momentum)
        shape = [1, channels] + [1] * (x.dim() - 2)
        y = (x - mean.to(x.dtype).view(shape)) * \
            torch.rsqrt(var.to(x.dtype).view(shape) + bn.eps)
        if bn.affine:
            y = y * bn.weight.view(shape) + bn.bias.view(shape)
        return y


def cross_replica_class(cls: type) -> type:
    """The cross-replica subclass of a BatchNorm class (made once per class)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"CrossReplica{cls.__name__}", (_CrossReplicaMixin, cls), {})
    return _CLASSES[cls]


def convert_batchnorm(module: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """Make every BatchNorm layer in ``module`` (itself included) normalise across the
    replicas of ``group``, in place; returns how many layers were converted."""
    converted = 0
    for layer in module.modules():
        if isinstance(layer, _BatchNorm) and not isinstance(layer, _CrossReplicaMixin) \
                and not isinstance(layer, nn.SyncBatchNorm):
            layer.__class__ = cross_replica_class(type(layer))
            setattr(layer, "replica_group", group)  # noqa: B010 - the class changed in place
            converted += 1
    return converted
