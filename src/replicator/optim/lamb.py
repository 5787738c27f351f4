"""LAMB: Adam with decoupled weight decay and a layer-wise trust ratio (You et al. 2019)."""

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


class LAMB(LayerwiseOptimizer):
    """Layer-wise Adaptive Moments for Batch training: Adam's direction, each parameter's step
    scaled to its own size, which lets BERT-scale batches train with one learning rate::

        m = b1 * m + (1 - b1) * g;     v = b2 * v + (1 - b2) * g * g
        u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd * w
        w = w - lr * (|w| / |u|) * u                        # ratio 1 if |w| or |u| is 0

    ``max_trust`` clips the ratio (``None``: no clip). Parameters ``exclude`` picks (default: 1-D
    ones) take the Adam step without trust ratio or weight decay; a group may set ``"exclude"``.
    Norms are of the whole parameter, also for a sharded ``DTensor``.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, bias_correction: bool = True,
                 max_trust: float | None = None,
                 exclude: ExcludeRule | None = exclude_1d) -> None:
        check_hyper("lr", lr)
        check_hyper("beta1", betas[0], 0.0, 1.0)
        check_hyper("beta2", betas[1], 0.0, 1.0)
        check_hyper("eps", eps)
        check_hyper("weight_decay", weight_decay)
        if max_trust is not None:
            check_hyper("max_trust", max_trust)
        self._exclude = check_exclude(exclude)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_trust=max_trust, exclude=None)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """One update of every parameter that has a gradient (others are left alone)."""
        loss = self._run_closure(closure)
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LAMB does not support sparse gradients")
                grad = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(
                        p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
                if group["bias_correction"]:
                    c1, c2 = 1 - b1 ** t, 1 - b2 ** t
                else:
                    c1, c2 = 1.0, 1.0
                update = (m / c1) / ((v / c2).sqrt().add_(eps))
                if self._excluded(group, p):
                    p.sub_(update, alpha=lr)
                    continue
                if wd != 0:
                    update.add_(p, alpha=wd)
                ratio = trust_ratio(full_norm(p), full_norm(update))
                if group["max_trust"] is not None:
                    ratio = ratio.clamp(max=group["max_trust"])
                p.sub_(update * as_local_scalar(ratio * lr, update))
        return loss
