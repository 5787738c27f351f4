"""``compute_average_loss``: tf.distribute's loss value, with gradients that equal one device's
(the rule: docs/strategies/index.md). Gradients are averaged over ``N`` replicas, not summed as in
TensorFlow, so the value passes its gradient back ``N`` times larger.
"""

from __future__ import annotations

from typing import Any

import torch

from replicator.comm.reduce_op import ReduceOp
from replicator.strategies.observers import note_average_loss
from replicator.strategies.replica_context import current_strategy


class _ScaleGradient(torch.autograd.Function):
    """The identity in forward; the gradient times ``factor`` (the replicas) in backward."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def compute_average_loss(per_example_loss: torch.Tensor, global_batch_size: int | None = None,
                         sample_weight: torch.Tensor | None = None) -> torch.Tensor:
    """``sum(per-example losses) / global batch size`` (``tf.nn.compute_average_loss``'s value),
    whose gradient averaged across replicas equals one device's. ``global_batch_size=None`` sums
    the local sizes across replicas (a collective: every replica calls it). ``sample_weight``
    weighs each example and counts as the size: with the input pipeline's mask (1 real,
    0 padding) the result is the mean over the real examples.
    """
    if not isinstance(per_example_loss, torch.Tensor):
        raise TypeError("compute_average_loss takes a tensor of per-example losses")
    note_average_loss()
    loss = per_example_loss
    if sample_weight is not None:
        loss = loss * sample_weight.to(loss.dtype)
    if loss.dim() > 1:
        loss = loss.reshape(loss.shape[0], -1).mean(dim=1)
    strategy = current_strategy()
    replicas = 1 if strategy is None else strategy.num_replicas_in_sync
    if global_batch_size is None:  # the local sizes (or the weights' sums) over replicas
        if sample_weight is not None:  # padded examples (weight 0) are not in the batch
            total = float(sample_weight.detach().to(torch.float64).sum())
        else:
            total = float(loss.shape[0]) if loss.dim() else 1.0
        if strategy is not None and replicas > 1:
            total = float(strategy.reduce(ReduceOp.SUM, torch.tensor(total)).item())
    elif global_batch_size <= 0:
        raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
    else:
        total = float(global_batch_size)
    value = loss.sum() * 0.0 if total == 0 else loss.sum() / total
    if replicas > 1 and value.requires_grad:
        value = _ScaleGradient.apply(value, float(replicas))
    return value
