"""LARS: SGD with momentum and a layer-wise trust ratio (You, Gitman, Ginsburg 2017)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from replicator.optim.layerwise import (
    ExcludeRule,
    LayerwiseOptimizer,
    as_local_scalar,
    check_exclude,
    check_hyper,
    exclude_1d,
    full_norm,
    trust_ratio,
)


class LARS(LayerwiseOptimizer):
    """Layer-wise Adaptive Rate Scaling, for SGD at very large batches::

        local_lr = eta * |w| / (|g| + wd * |w| + eps)      # 1 if |w| or |g| is 0
        v = momentum * v + lr * local_lr * (g + wd * w)
        w = w - v                                           # (nesterov: w - momentum*v - ...)

    Parameters ``exclude`` picks (default: 1-D ones) take plain momentum SGD without weight
    decay; a group may set ``"exclude"``. Norms are of the whole parameter, also for a sharded
    ``DTensor`` (see :mod:`replicator.optim.layerwise`).
    """

    def __init__(self, params: Iterable[Any], lr: float = 0.1, momentum: float = 0.9,
                 weight_decay: float = 0.0, trust_coefficient: float = 0.001,
                 eps: float = 1e-8, nesterov: bool = False,
                 exclude: ExcludeRule | None = exclude_1d) -> None:
        check_hyper("lr", lr)
        check_hyper("momentum", momentum, 0.0, 1.0)
        check_hyper("weight_decay", weight_decay)
        check_hyper("trust_coefficient", trust_coefficient)
        check_hyper("eps", eps)
        if nesterov and momentum <= 0:
            raise ValueError("LARS: nesterov=True needs momentum > 0")
        self._exclude = check_exclude(exclude)
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                        trust_coefficient=trust_coefficient, eps=eps, nesterov=nesterov,
                        exclude=None)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """One update of every parameter that has a gradient (others are left alone)."""
        loss = self._run_closure(closure)
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            wd, eta, eps = group["weight_decay"], group["trust_coefficient"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LARS does not support sparse gradients")
                grad = p.grad
                if not self._excluded(group, p):
                    w_norm, g_norm = full_norm(p), full_norm(grad)
                    ratio = trust_ratio(w_norm, g_norm + wd * w_norm, eta, eps)
                    if wd != 0:
                        grad = grad.add(p, alpha=wd)
                    grad = grad * as_local_scalar(ratio, grad)
                update = grad.mul(lr)
                if momentum != 0:
                    state = self.state[p]
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = update.clone()
                    else:
                        buf.mul_(momentum).add_(update)
                    update = update.add(buf, alpha=momentum) if group["nesterov"] else buf
                p.sub_(update)
        return loss
