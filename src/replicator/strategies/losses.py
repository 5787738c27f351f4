"""``compute_average_loss``: the loss scaling that makes uneven local batches exact.

Gradients are *averaged* over the ``N`` replicas during ``backward()``. For that average to be
the gradient of the mean loss over the whole global batch of ``B`` samples, each replica must
return ``N / B * sum(local per-example losses)``: then
``mean_r grad(N/B * sum_r) = grad(1/B * sum_all)``, whatever each replica's local size. With
equal local batches this equals the local mean. ``strategy.reduce("mean", loss)`` of the
returned values is the global mean loss.

A plain mean loss instead (DDP's semantics: each replica's mean, then gradients averaged across
replicas) weighs each replica's samples by ``1 / its own size``: on an uneven batch it differs
from one device. ``strategy.run`` warns once, on the first uneven batch of a distributed
dataset whose step did not call this function (:mod:`replicator.strategies.uneven_batches`).
"""

from __future__ import annotations

import torch

from replicator.comm.reduce_op import ReduceOp
from replicator.strategies.replica_context import current_strategy
from replicator.strategies.uneven_batches import note_average_loss


def compute_average_loss(per_example_loss: torch.Tensor, global_batch_size: int | None = None,
                         sample_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Scale per-example losses so averaged gradients equal the global-batch mean's gradient.

    ``global_batch_size=None`` sums the local batch sizes across replicas (one small
    collective, so every replica must call it). ``sample_weight`` multiplies each example's
    loss first, and then the batch size counts the weights: with the input pipeline's mask
    (1 real, 0 padding) the result is exactly the mean over the real examples.
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
    total: float
    if global_batch_size is None:
        if sample_weight is not None:  # padded examples (weight 0) are not in the batch
            local = float(sample_weight.detach().to(torch.float64).sum())
        else:
            local = float(loss.shape[0]) if loss.dim() else 1.0
        if strategy is None or replicas == 1:
            total = local
        else:
            total = float(strategy.reduce(ReduceOp.SUM, torch.tensor(local)).item())
    elif global_batch_size <= 0:
        raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
    else:
        total = float(global_batch_size)
    if total == 0:
        return loss.sum() * 0.0
    return loss.sum() * (replicas / total)
