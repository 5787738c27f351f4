"""The optimizer step pre-hooks a backup registers: one refuses a step on NaN or infinite
gradients (averaged, so every rank stops at the same step); one waits for the deferred copy of
the last save (the hooked optimizers' CPU parameters and state, which only their step changes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from replicator.errors import NonFiniteLossError


def gradients_finite(optimizer: torch.optim.Optimizer) -> bool:
    """True when every dense gradient the optimizer would apply is finite: one sum each (fast),
    then an element-wise check only when a sum is not finite (it may merely overflow)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]
             if p.grad is not None and p.grad.layout == torch.strided and p.grad.numel()]
    if not grads:
        return True
    device = grads[0].device
    sums = torch.stack([_sum(g).to(device, torch.float64) for g in grads])
    return bool(torch.isfinite(sums).all()) or all(bool(torch.isfinite(g).all()) for g in grads)


def _sum(g: torch.Tensor) -> torch.Tensor:
    if g.is_complex():
        g = torch.view_as_real(g)
    return g.sum(dtype=torch.float64 if g.dtype == torch.float64 else torch.float32)


class NonFiniteGuard:
    """Raise :class:`NonFiniteLossError` before an optimizer step on non-finite gradients;
    ``describe()`` supplies the error's context (the step and the last backup)."""

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


class CopyGuard:
    """Step pre-hooks that wait for a save's deferred copy, and what may be deferred."""

    def __init__(self) -> None:
        self._hooks: dict[int, tuple[torch.optim.Optimizer, Any]] = {}

    def attach(self, objects: Iterable[Any], wait: Callable[[], None]) -> None:
        """Make the step of every optimizer among ``objects`` call ``wait()`` first."""
        for obj in objects:
            if isinstance(obj, torch.optim.Optimizer) and id(obj) not in self._hooks:
                handle = obj.register_step_pre_hook(lambda *_: wait())
                self._hooks[id(obj)] = (obj, handle)

    def deferrable(self) -> Callable[[torch.Tensor], bool] | None:
        """A test for the tensors only a hooked optimizer's step changes (``None``: none)."""
        where: set[int] = set()
        for opt, _ in self._hooks.values():
            for group in opt.param_groups:
                where.update(p.data_ptr() for p in group["params"] if p.device.type == "cpu")
            for state in opt.state.values():
                where.update(v.data_ptr() for v in state.values()
                             if isinstance(v, torch.Tensor) and v.device.type == "cpu")
        where.discard(0)
        return (lambda t: t.device.type == "cpu" and t.data_ptr() in where) if where else None

    def remove(self) -> None:
        for _, handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
