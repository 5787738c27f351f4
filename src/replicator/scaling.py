"""Learning-rate rules for large global batches (docs/large_batch.md): scale the learning rate
with the batch (:func:`scaled_lr`) and reach it gradually over the first steps (:func:`warmup`),
so the early, badly conditioned steps do not diverge."""

from __future__ import annotations

import math
import warnings

import torch
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["RULES", "Warmup", "scaled_lr", "warmup"]

#: The scaling rules :func:`scaled_lr` knows.
RULES = ("linear", "sqrt", "none")


def scaled_lr(base_lr: float, base_batch: int, global_batch: int, rule: str = "linear") -> float:
    """The learning rate for ``global_batch`` from one tuned at ``base_batch``: ``"linear"``
    (Goyal et al. 2017, SGD), ``"sqrt"`` (keeps the gradient noise scale; Adam/LAMB) or
    ``"none"``."""
    if isinstance(base_lr, bool) or not isinstance(base_lr, (int, float)) or \
            not math.isfinite(base_lr) or base_lr < 0:
        raise ValueError(f"scaled_lr: base_lr must be a finite number >= 0, got {base_lr!r}")
    for name, value in (("base_batch", base_batch), ("global_batch", global_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"scaled_lr: {name} must be a positive int, got {value!r}. HINT: "
                             "give batch sizes in samples (the global batch over all replicas)")
    if rule not in RULES:
        raise ValueError(f"scaled_lr: unknown rule {rule!r}; available: {', '.join(RULES)}")
    ratio = global_batch / base_batch
    return float(base_lr) * {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[rule]


class Warmup(LRScheduler):
    """Multiplies each group's learning rate by a factor rising from ``start_factor`` (one, or one
    per group) to 1 over ``steps`` calls (``"linear"``) or held until then (``"constant"``);
    chainable, so it composes with ``ChainedScheduler`` and ``SequentialLR``."""

    def __init__(self, optimizer: torch.optim.Optimizer, steps: int,
                 start_factor: float | list[float], mode: str = "linear",
                 last_epoch: int = -1) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"warmup: steps must be an int >= 0, got {steps!r}")
        if mode not in ("linear", "constant"):
            raise ValueError(f"warmup: mode must be 'linear' or 'constant', got {mode!r}")
        groups = len(optimizer.param_groups)
        factors = list(start_factor) if isinstance(start_factor, (list, tuple)) \
            else [start_factor] * groups
        if len(factors) != groups:
            raise ValueError(f"warmup: {len(factors)} start factors for {groups} parameter "
                             "groups. HINT: give one number, or one per group")
        for f in factors:
            if not 0 < float(f) <= 1:
                raise ValueError(f"warmup: start factor {f!r} is not in (0, 1]. HINT: the warmup "
                                 "starts at start_factor * lr and must start above zero; "
                                 "start_lr must be at most the optimizer's lr")
        self.steps, self.mode = steps, mode
        self.start_factors = [float(f) for f in factors]
        super().__init__(optimizer, last_epoch)

    def factor(self, step: int, group: int = 0) -> float:
        """The multiplier of group ``group``'s rate after ``step`` calls of ``step()``."""
        start = self.start_factors[group]
        if step >= self.steps:
            return 1.0
        return start if self.mode == "constant" else start + (1.0 - start) * step / self.steps

    def get_lr(self) -> list[float]:  # type: ignore[override]
        """Chainable form: scale the current rate by this step's change of the factor."""
        t, groups = self.last_epoch, self.optimizer.param_groups
        if t > self.steps:
            return [group["lr"] for group in groups]
        return [group["lr"] * self.factor(t, i) / (self.factor(t - 1, i) if t > 0 else 1.0)
                for i, group in enumerate(groups)]

    def _get_closed_form_lr(self) -> list[float | torch.Tensor]:
        return [base * self.factor(self.last_epoch, i) for i, base in enumerate(self.base_lrs)]


def warmup(optimizer: torch.optim.Optimizer, steps: int, *, start_lr: float | None = None,
           start_factor: float | None = None, mode: str = "linear",
           last_epoch: int = -1) -> Warmup:
    """A scheduler bringing ``optimizer``'s learning rates up to their set values over ``steps``
    steps (``step()`` per optimizer step), from ``start_lr`` (e.g. :func:`scaled_lr`'s
    ``base_lr``, as Goyal et al.), ``start_factor`` times each rate, or ``1 / steps`` of it."""
    if start_lr is not None and start_factor is not None:
        raise ValueError("warmup: give start_lr or start_factor, not both")
    if steps == 0:
        factors: float | list[float] = 1.0
    elif start_lr is not None:
        if not start_lr > 0:
            raise ValueError(f"warmup: start_lr must be > 0, got {start_lr!r}")
        factors = []
        for group in optimizer.param_groups:
            target = float(group.get("initial_lr", group["lr"]))  # a float or a 0-d tensor
            if start_lr > target:
                warnings.warn(f"warmup: start_lr {start_lr} is above a group's lr {target}; "
                              "that group starts at its lr (no warmup)", stacklevel=2)
            factors.append(min(1.0, start_lr / target) if target > 0 else 1.0)
    elif start_factor is not None:
        factors = start_factor
    else:
        factors = 1.0 / steps if isinstance(steps, int) and steps > 0 else 1.0
    return Warmup(optimizer, steps, factors, mode=mode, last_epoch=last_epoch)
