"""LARS and LAMB, the layer-wise optimizers for large batches: both scale each update by a
*trust ratio* built from the whole parameter's norm, which :func:`full_norm` takes across the
shards of a ``DTensor`` (FSDP2, tensor parallelism); a replicated parameter's is its own."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

#: Decides whether a parameter is left out of layer-wise adaptation (and weight decay).
ExcludeRule = Callable[[torch.Tensor], bool]


def exclude_1d(param: torch.Tensor) -> bool:
    """The default rule: biases and normalisation weights (parameters of at most 1 dimension)
    take the plain update, without trust ratio or weight decay (You et al.'s practice)."""
    return param.dim() <= 1


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


def full_norm(t: torch.Tensor) -> torch.Tensor:
    """The L2 norm of the whole tensor ``t`` as a 0-d float32 tensor, for a sharded ``DTensor``
    too (its shards' squared norms are summed across the mesh)."""
    if _is_dtensor(t):
        return torch.linalg.vector_norm(t.float()).full_tensor()  # type: ignore[attr-defined]
    return torch.linalg.vector_norm(t.detach().float())


def as_local_scalar(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (0-d) in a form that multiplies ``like``: a replicated ``DTensor`` when
    ``like`` is one (plain tensors and DTensors do not mix in one op)."""
    if _is_dtensor(like):
        from torch.distributed.tensor import DTensor, Replicate

        placements = [Replicate()] * like.device_mesh.ndim  # type: ignore[attr-defined]
        return DTensor.from_local(value.to(like.dtype), like.device_mesh,  # type: ignore
                                  placements, run_check=False)
    return value.to(like.dtype)


def trust_ratio(param_norm: torch.Tensor, update_norm: torch.Tensor,
                coefficient: float = 1.0, eps: float = 0.0) -> torch.Tensor:
    """``coefficient * |w| / (|u| + eps)``, or 1 where either norm is 0 (a fresh zero weight
    or a zero update must not freeze or explode the step)."""
    ratio = coefficient * param_norm / (update_norm + eps)
    ok = (param_norm > 0) & (update_norm > 0)
    return torch.where(ok, ratio, torch.ones_like(ratio))


def check_exclude(exclude: ExcludeRule | None) -> ExcludeRule:
    """``exclude`` as a callable (``None``: exclude nothing); a clear error otherwise."""
    if exclude is None:
        return lambda p: False
    if not callable(exclude):
        raise TypeError(f"exclude must be a callable taking a parameter and returning a bool "
                        f"(default: 1-D parameters), got {type(exclude).__name__}. HINT: "
                        "exclude=None adapts every parameter")
    return exclude


def check_hyper(name: str, value: float, low: float = 0.0, high: float | None = None) -> None:
    """A ``ValueError`` naming ``name`` when ``value`` is outside ``[low, high)``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low or \
            (high is not None and value >= high):
        bound = f"[{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"invalid {name}: {value!r} (must be {bound})")


class LayerwiseOptimizer(torch.optim.Optimizer):
    """What LARS and LAMB share: the exclusion rule (a group's ``"exclude"`` overrides the
    optimizer's), the parameters a step updates and the closure of ``step``."""

    _exclude: ExcludeRule

    def _excluded(self, group: dict, p: torch.Tensor) -> bool:
        return bool(group["exclude"]) if group["exclude"] is not None else self._exclude(p)

    def _stepped(self, group: dict[str, Any]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(parameter, gradient)`` of every parameter of ``group`` that has a gradient."""
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            yield p, p.grad

    @staticmethod
    def _run_closure(closure: Callable[[], object] | None) -> object:
        """The loss of ``closure`` evaluated with gradients on (``None`` without one)."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()


class LARS(LayerwiseOptimizer):
    """Layer-wise Adaptive Rate Scaling, for SGD at very large batches::

        local_lr = eta * |w| / (|g| + wd * |w| + eps)      # 1 if |w| or |g| is 0
        v = momentum * v + lr * local_lr * (g + wd * w)
        w = w - v                                           # (nesterov: w - momentum*v - ...)

    Parameters ``exclude`` picks (default: 1-D ones) take plain momentum SGD without weight
    decay; a group may set ``"exclude"``. Norms are of the whole parameter, also for a sharded
    ``DTensor`` (see the module doc)."""

    def __init__(self, params: Iterable[Any], lr: float = 0.1, momentum: float = 0.9,
                 weight_decay: float = 0.0, trust_coefficient: float = 0.001,
                 eps: float = 1e-8, nesterov: bool = False,
                 exclude: ExcludeRule | None = exclude_1d) -> None:
        for name, value in (("lr", lr), ("weight_decay", weight_decay),
                            ("trust_coefficient", trust_coefficient), ("eps", eps)):
            check_hyper(name, value)
        check_hyper("momentum", momentum, 0.0, 1.0)
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
            for p, grad in self._stepped(group):
                if not self._excluded(group, p):
                    w_norm, g_norm = full_norm(p), full_norm(grad)
                    ratio = trust_ratio(w_norm, g_norm + wd * w_norm, eta, eps)
                    if wd != 0:
                        grad = grad.add(p, alpha=wd)
                    grad = grad * as_local_scalar(ratio, grad)
                update = grad.mul(lr)
                if momentum != 0:
                    if (buf := self.state[p].get("momentum_buffer")) is None:
                        buf = self.state[p]["momentum_buffer"] = update.clone()
                    else:
                        buf.mul_(momentum).add_(update)
                    update = update.add(buf, alpha=momentum) if group["nesterov"] else buf
                p.sub_(update)
        return loss


class LAMB(LayerwiseOptimizer):
    """Layer-wise Adaptive Moments for Batch training: Adam's direction, each parameter's step
    scaled to its own size, which lets BERT-scale batches train with one learning rate::

        m = b1 * m + (1 - b1) * g;     v = b2 * v + (1 - b2) * g * g
        u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd * w
        w = w - lr * (|w| / |u|) * u                        # ratio 1 if |w| or |u| is 0

    ``max_trust`` clips the ratio (``None``: no clip). Parameters ``exclude`` picks (default: 1-D
    ones) take the Adam step without trust ratio or weight decay; a group may set ``"exclude"``.
    Norms are of the whole parameter, also for a sharded ``DTensor``."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, bias_correction: bool = True,
                 max_trust: float | None = None,
                 exclude: ExcludeRule | None = exclude_1d) -> None:
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay),
                            ("max_trust", 0.0 if max_trust is None else max_trust)):
            check_hyper(name, value)
        check_hyper("beta1", betas[0], 0.0, 1.0)
        check_hyper("beta2", betas[1], 0.0, 1.0)
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
            for p, grad in self._stepped(group):
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p),
                                 exp_avg_sq=torch.zeros_like(p))  # preserve_format: the default
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
                c1, c2 = (1 - b1 ** t, 1 - b2 ** t) if group["bias_correction"] else (1.0, 1.0)
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
