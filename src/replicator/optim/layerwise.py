"""What LARS and LAMB share: which parameters adapt, and a parameter's norm across shards.

Both scale each update by a *trust ratio* built from the whole parameter's norm. A sharded
parameter (a ``DTensor`` of FSDP2 or tensor parallelism) holds a piece per rank, so
:func:`full_norm` asks the ``DTensor`` (a sum of squares all-reduced over the mesh);
replicated strategies hold whole parameters, whose local norm is the global one.
"""

from __future__ import annotations

from collections.abc import Callable

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
        norm = torch.linalg.vector_norm(t.float())
        return norm.full_tensor()  # type: ignore[attr-defined]
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


def check_hyper(name: str, value: float, low: float = 0.0, high: float | None = None,
                inclusive_high: bool = False) -> None:
    """A ``ValueError`` naming ``name`` when ``value`` is outside ``[low, high)``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low or \
            (high is not None and (value > high or (value == high and not inclusive_high))):
        bound = f"[{low}, {high}{']' if inclusive_high else ')'}" if high is not None \
            else f">= {low}"
        raise ValueError(f"invalid {name}: {value!r} (must be {bound})")


class LayerwiseOptimizer(torch.optim.Optimizer):
    """What LARS and LAMB share: the exclusion rule (a group's ``"exclude"`` overrides the
    optimizer's) and the closure of ``step``."""

    _exclude: ExcludeRule

    def _excluded(self, group: dict, p: torch.Tensor) -> bool:
        return bool(group["exclude"]) if group["exclude"] is not None else self._exclude(p)

    @staticmethod
    def _run_closure(closure: Callable[[], object] | None) -> object:
        """The loss of ``closure`` evaluated with gradients on (``None`` without one)."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()
