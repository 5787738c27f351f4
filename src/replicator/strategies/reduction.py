"""``strategy.reduce`` and ``strategy.gather`` of a value or a nest of values, with ``axis``.

A nest goes leaf by leaf in ONE collective and comes back with its structure. ``axis`` reduces
each replica's tensor along those dimensions first; ``"mean"`` divides by the element count over
every replica (uneven batches give the mean over all rows), ``"min"``/``"max"`` skip empties.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from replicator.comm.reduce_op import ReduceOp
from replicator.strategies.nest import flatten, structure

#: ``axis`` as ``reduce`` takes it.
Axis = int | Sequence[int] | None

ReduceOne = Callable[[ReduceOp, torch.Tensor], torch.Tensor]
ReduceMany = Callable[[ReduceOp, list[torch.Tensor], str], list[torch.Tensor]]
GatherOne = Callable[[torch.Tensor, int], torch.Tensor]
GatherMany = Callable[[list[torch.Tensor], int, str], list[torch.Tensor]]


def as_tensor(value: Any, call: str) -> torch.Tensor:
    """``value`` as a tensor; a clear ``TypeError`` naming ``call`` otherwise."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (bool, int, float)):
        return torch.tensor(value)
    try:
        import numpy as np

        if isinstance(value, (np.ndarray, np.generic)):
            return torch.as_tensor(value)
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"{call}() takes a tensor, a Python number, or a nest of them (tuples, "
                    f"lists, dicts, namedtuples, dataclasses), got {type(value).__name__}")


def normalise_axes(axis: Axis, tensor: torch.Tensor, call: str = "reduce") -> tuple[int, ...]:
    """``axis`` as sorted non-negative dimensions of ``tensor``; a ``ValueError`` naming the
    shape for an axis out of range, a repeated one, or a scalar."""
    dims = (axis,) if isinstance(axis, int) else tuple(axis)  # type: ignore[arg-type]
    if not dims or any(isinstance(d, bool) or not isinstance(d, int) for d in dims):
        raise TypeError(f"{call}(..., axis=...) takes an int or a tuple of ints, got {axis!r}")
    if tensor.dim() == 0:
        raise ValueError(f"{call}(..., axis={axis!r}) needs a tensor with at least one "
                         "dimension, got a scalar")
    out = []
    for d in dims:
        if not -tensor.dim() <= d < tensor.dim():
            raise ValueError(f"{call}(..., axis={axis!r}): axis {d} is out of range for a "
                             f"tensor of shape {tuple(tensor.shape)}")
        out.append(d % tensor.dim())
    if len(set(out)) != len(out):
        raise ValueError(f"{call}(..., axis={axis!r}) names a dimension twice for a tensor of "
                         f"shape {tuple(tensor.shape)}")
    return tuple(sorted(out))


def _identity(op: ReduceOp, like: torch.Tensor) -> torch.Tensor:
    """What ``min``/``max`` leave unchanged, shaped like ``like`` (an empty replica's part)."""
    if like.dtype is torch.bool:
        value: float | int | bool = op is ReduceOp.MIN
    elif like.is_floating_point():
        value = math.inf if op is ReduceOp.MIN else -math.inf
    else:
        info = torch.iinfo(like.dtype)
        value = info.max if op is ReduceOp.MIN else info.min
    return torch.full_like(like, value)


def _local(op: ReduceOp, t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``op`` of one replica's tensor along ``dims`` (sum, min or max)."""
    if op is ReduceOp.SUM:
        return t.sum(dims)
    if any(t.shape[d] == 0 for d in dims):
        return _identity(op, t.sum(dims, dtype=t.dtype))
    return t.amin(dims) if op is ReduceOp.MIN else t.amax(dims)


def _mean_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype of a mean of ``t``: its own if floating, else the default float."""
    return t.dtype if (t.is_floating_point() or t.is_complex()) else torch.get_default_dtype()


def reduce_value(op: ReduceOp, value: Any, axis: Axis, reduce_one: ReduceOne,
                 reduce_many: ReduceMany) -> Any:
    """``strategy.reduce`` (see the module doc): ``reduce_one`` for a single tensor,
    ``reduce_many`` (one collective) for the leaves of a nest."""
    leaves, rebuild = flatten(value)
    where = [i for i, leaf in enumerate(leaves) if leaf is not None]
    tensors = [as_tensor(leaves[i], "reduce") for i in where]
    single = len(leaves) == 1 and leaves[0] is value and len(tensors) == 1
    shape = structure(value)
    if axis is None:
        if single:
            return reduce_one(op, tensors[0])
        out = reduce_many(op, tensors, shape) if tensors else []
        if op is ReduceOp.MEAN:
            out = [o.to(_mean_dtype(t)) for o, t in zip(out, tensors)]
    else:
        dims = [normalise_axes(axis, t) for t in tensors]
        if op is ReduceOp.MEAN:
            totals = [t.sum(d, dtype=torch.float64) if not t.is_complex() else t.sum(d)
                      for t, d in zip(tensors, dims)]
            counts = torch.tensor([float(math.prod(t.shape[i] for i in d))
                                   for t, d in zip(tensors, dims)], dtype=torch.float64)
            *totals, counts = reduce_many(ReduceOp.SUM, [*totals, counts], shape)
            out = [(total / count).to(_mean_dtype(t))
                   for total, count, t in zip(totals, counts.tolist(), tensors)]
        else:
            local = [_local(op, t, d) for t, d in zip(tensors, dims)]
            out = [reduce_one(op, local[0])] if single else \
                (reduce_many(op, local, shape) if local else [])
        if single:
            return out[0]
    new = list(leaves)
    for i, o in zip(where, out):
        new[i] = o
    return rebuild(new)


def gather_value(value: Any, axis: int, gather_one: GatherOne,
                 gather_many: GatherMany) -> Any:
    """``strategy.gather`` (every replica's value concatenated along ``axis``; a scalar
    counts as one row): ``gather_one`` for a single tensor, ``gather_many`` (one exchange)
    for the leaves of a nest."""
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"gather(..., axis=...) takes an int, got {axis!r}")
    leaves, rebuild = flatten(value)
    where = [i for i, leaf in enumerate(leaves) if leaf is not None]
    tensors = [as_tensor(leaves[i], "gather") for i in where]
    for t in tensors:
        if t.dim() and not -t.dim() <= axis < t.dim():
            raise ValueError(f"gather axis {axis} is out of range for a tensor of shape "
                             f"{tuple(t.shape)}")
    if len(leaves) == 1 and leaves[0] is value and len(tensors) == 1:
        return gather_one(tensors[0], axis)
    out = gather_many(tensors, axis, structure(value)) if tensors else []
    new = list(leaves)
    for i, o in zip(where, out):
        new[i] = o
    return rebuild(new)
