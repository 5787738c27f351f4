"""Row-wise updates of sparse embedding tables on a server, as one device with ``sparse=True``
would make them (torch's own sparse gradients; lazy Adam as ``SparseAdam``; plain SGD as one
vectorised add), and the server's record of applied coordinator tasks."""

from __future__ import annotations

from typing import Any

import torch

from replicator.ps import protocol as P

_LAZY_ADAM = ("Adam", "AdamW", "SparseAdam")
_ROW_WISE = ("SGD", "Adagrad", *_LAZY_ADAM)


def build_shard_optimizer(spec: dict[str, Any], param: torch.nn.Parameter, group: int,
                          sparse: bool) -> torch.optim.Optimizer:
    """The optimizer of one shard: ``spec``'s class, or for a sparse table its row-wise form."""
    if not sparse:
        return P.build_optimizer(spec, param, group)
    name = str(spec["class"])
    hyper = dict(spec["groups"][group])
    if name not in _ROW_WISE:
        raise P.ParameterServerError(
            f"torch.optim.{name} cannot update the rows of a sparse embedding table. HINT: use "
            "SGD, Adagrad, Adam (applied lazily, as SparseAdam) or SparseAdam for tables built "
            "with sparse=True, or build the embedding with sparse=False (it then travels whole).")
    if float(hyper.get("weight_decay", 0) or 0) != 0.0:
        raise P.ParameterServerError(
            f"{name}(weight_decay={hyper['weight_decay']}) cannot update a sparse embedding "
            "table row-wise (torch refuses weight decay with sparse gradients). HINT: give "
            "the table its own optimizer without weight decay.")
    if name in _LAZY_ADAM:
        if hyper.get("amsgrad"):
            raise P.ParameterServerError("Adam(amsgrad=True) has no lazy, row-wise form for a "
                                         "sparse embedding table. HINT: use amsgrad=False.")
        betas = hyper.get("betas", (0.9, 0.999))
        return torch.optim.SparseAdam([param], lr=hyper.get("lr", 1e-3),
                                      betas=(float(betas[0]), float(betas[1])),
                                      eps=hyper.get("eps", 1e-8),
                                      maximize=bool(hyper.get("maximize", False)))
    return P.build_optimizer(spec, param, group)


def check_gradient_rows(rows: torch.Tensor, values: torch.Tensor, param: torch.Tensor) -> None:
    """Refuse a sparse gradient whose rows are not sorted, distinct shard rows matching
    ``values`` (a worker sends them coalesced)."""
    if rows.dim() != 1 or rows.numel() != values.shape[0] or \
            tuple(values.shape[1:]) != tuple(param.shape[1:]):
        raise P.ParameterServerError(f"sparse gradient of {rows.numel()} rows with values of "
                                     f"shape {tuple(values.shape)} does not fit a shard of "
                                     f"shape {tuple(param.shape)}")
    if rows.numel() > 1 and not bool((rows[1:] > rows[:-1]).all()):
        raise P.ParameterServerError("sparse gradient rows are not sorted and distinct "
                                     "(a worker sends them coalesced)")
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= param.shape[0]):
        raise P.ParameterServerError(f"sparse gradient rows outside a shard of "
                                     f"{param.shape[0]} rows")


def sparse_gradient(rows: torch.Tensor, values: torch.Tensor, param: torch.Tensor
                    ) -> torch.Tensor:
    """Torch's sparse gradient of ``param`` holding ``values`` at ``rows`` (shard-local)."""
    check_gradient_rows(rows, values, param)
    return torch.sparse_coo_tensor(rows.reshape(1, -1), values.to(param.dtype),
                                   tuple(param.shape), is_coalesced=True,
                                   check_invariants=False)  # checked above


def plain_sgd_alpha(optimizer: torch.optim.Optimizer) -> float | None:
    """``-lr`` (``+lr`` with ``maximize``) for torch's plain ``SGD`` (no momentum, weight decay,
    hooks or fused kernel), whose sparse step is ``param.add_(grad, alpha=-lr)``; else None."""
    if type(optimizer) is not torch.optim.SGD or len(optimizer.param_groups) != 1 or \
            optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        return None
    group = optimizer.param_groups[0]
    if group.get("momentum") or group.get("weight_decay") or group.get("fused") or \
            group.get("differentiable"):
        return None
    lr = float(group["lr"])
    return lr if group.get("maximize") else -lr


def add_to_rows(param: torch.Tensor, rows: torch.Tensor, values: torch.Tensor,
                alpha: float) -> None:
    """``param[rows] += alpha * values`` for sorted, distinct ``rows`` in one vectorised add
    (torch's sparse add gives the same numbers row by row, slower)."""
    with torch.no_grad():
        data = param.detach()
        updated = data.index_select(0, rows)
        updated.add_(values.to(data.dtype), alpha=alpha)
        data.index_copy_(0, rows, updated)


class TaskLedger:
    """The (task, push) pairs applied on one server, and how many repeats it turned away."""

    def __init__(self) -> None:
        self.applied: set[tuple[int, int]] = set()
        self.repeats = 0

    def seen(self, task: int, push: int) -> bool:
        """True when this update was applied already (nothing is recorded)."""
        return (task, push) in self.applied

    def first(self, task: int, push: int) -> bool:
        """True the first time (the update is to be applied), False for a repeat."""
        key = (task, push)
        if key in self.applied:
            self.repeats += 1
            return False
        self.applied.add(key)
        return True

    def summary(self) -> dict[str, int]:
        return {"applied": len(self.applied), "repeats": self.repeats}

    def state(self) -> list[list[int]]:
        return sorted([t, p] for t, p in self.applied)

    def load(self, state: list[list[int]]) -> None:
        self.applied = {(int(t), int(p)) for t, p in state}
