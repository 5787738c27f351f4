"""Stop before a NaN or infinite loss reaches the weights (and the next backup).

A NaN loss makes every gradient NaN, so a check of the gradients just before
``optimizer.step()`` catches it without the training loop having to hand the loss over. With
data parallelism the gradients were averaged across replicas, so every rank sees the same
non-finite value at the same step and all stop together, with no rank left waiting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from replicator.errors import NonFiniteLossError


def gradients_finite(optimizer: torch.optim.Optimizer) -> bool:
    """True when every dense gradient the optimizer would apply is finite.

    Fast path: one sum per gradient (a NaN or inf anywhere makes the sum non-finite), about
    0.1 ms per million values on one core; only when a sum is not finite does an exact
    element-wise check rule out a mere overflow of the sum.
    """
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]
             if p.grad is not None and p.grad.layout == torch.strided and p.grad.numel()]
    if not grads:
        return True
    device = grads[0].device
    sums = torch.stack([_sum(g).to(device, torch.float64) for g in grads])
    if bool(torch.isfinite(sums).all()):
        return True
    return all(bool(torch.isfinite(g).all()) for g in grads)


def _sum(g: torch.Tensor) -> torch.Tensor:
    if g.is_complex():
        g = torch.view_as_real(g)
    return g.sum(dtype=torch.float64 if g.dtype == torch.float64 else torch.float32)


class NonFiniteGuard:
    """Raise :class:`NonFiniteLossError` before an optimizer step on non-finite gradients.

    ``describe()`` supplies the context of the error (the step and the last backup).
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 describe: Callable[[], str] = lambda: "") -> None:
        self.optimizer = optimizer
        self.describe = describe
        self._handle = optimizer.register_step_pre_hook(self._check)

    def _check(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if gradients_finite(optimizer):
            return
        context = self.describe()
        raise NonFiniteLossError(
            f"the gradients hold NaN or infinite values{context}: the loss was probably NaN or "
            "inf. The optimizer step was not taken, so the weights and the last backup are "
            "intact. HINT: lower the learning rate, clip gradients, or look at this step's "
            "input; pass terminate_on_nan=False to BackupAndRestore to step anyway.")

    def remove(self) -> None:
        self._handle.remove()
