"""Nested values, and ``strategy.reduce`` and ``strategy.gather`` of them, as tf.distribute does
(docs/strategies/index.md): a nest's leaves travel in one collective and come back in its
structure; dataclasses are flattened here, not registered globally with ``_pytree``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from replicator.comm.reduce_op import ReduceOp

#: Builds the nest back around new leaves (in :func:`flatten`'s order).
Rebuild = Callable[[list[Any]], Any]


def _is_plain_dataclass(value: Any) -> bool:
    """A dataclass instance that ``_pytree`` does not know (flattened by its fields here)."""
    return (dataclasses.is_dataclass(value) and not isinstance(value, type)
            and type(value) not in pytree.SUPPORTED_NODES)


def _flatten_into(value: Any, leaves: list[Any]) -> Callable[[Iterator[Any]], Any]:
    flat, spec = pytree.tree_flatten(value, is_leaf=_is_plain_dataclass)
    parts: list[tuple[Any, Callable[[Iterator[Any]], Any]] | None] = []
    for leaf in flat:
        if _is_plain_dataclass(leaf):
            fields = {f.name: getattr(leaf, f.name) for f in dataclasses.fields(leaf)}
            parts.append((leaf, _flatten_into(fields, leaves)))
        else:
            leaves.append(leaf)
            parts.append(None)

    def rebuild(it: Iterator[Any]) -> Any:
        values = []
        for part in parts:
            if part is None:
                values.append(next(it))
                continue
            original, inner = part
            obj = copy.copy(original)
            for name, v in inner(it).items():
                object.__setattr__(obj, name, v)
            values.append(obj)
        return pytree.tree_unflatten(values, spec)

    return rebuild


def flatten(value: Any) -> tuple[list[Any], Rebuild]:
    """The leaves of ``value`` and a function that puts new leaves back into its structure."""
    leaves: list[Any] = []
    inner = _flatten_into(value, leaves)
    count = len(leaves)

    def rebuild(new: list[Any]) -> Any:
        if len(new) != count:
            raise ValueError(f"a nest of {count} leaves cannot take {len(new)}")
        return inner(iter(new))

    return leaves, rebuild


def clone_tree(value: Any, clone: Callable[[torch.Tensor], Any] = torch.Tensor.clone) -> Any:
    """A copy of a state tree (dicts, lists, tuples) with ``clone`` of each tensor, detached."""
    if isinstance(value, torch.Tensor):
        return clone(value.detach())
    if isinstance(value, dict):
        return {k: clone_tree(v, clone) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [clone_tree(v, clone) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    return value


def structure(value: Any) -> str:
    """A short description of ``value``'s shape, the same on every replica for one kind of nest."""
    def describe(v: Any) -> str:
        if _is_plain_dataclass(v):
            inner = ", ".join(f"{f.name}={describe(getattr(v, f.name))}"
                              for f in dataclasses.fields(v))
            return f"{type(v).__name__}({inner})"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k!r}: {describe(x)}" for k, x in v.items()) + "}"
        if isinstance(v, tuple) and hasattr(v, "_fields"):
            return f"{type(v).__name__}(" + ", ".join(describe(x) for x in v) + ")"
        if isinstance(v, (list, tuple)):
            inner = ", ".join(describe(x) for x in v)
            return f"[{inner}]" if isinstance(v, list) else f"({inner})"
        if v is None:
            return "None"
        if type(v) in pytree.SUPPORTED_NODES:
            children, _ = pytree.tree_flatten(v)
            return f"{type(v).__name__}<{len(children)}>"
        return "*"

    return describe(value)


# -- reduce and gather -----------------------------------------------------------------------
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
    np = sys.modules.get("numpy")  # a numpy value means numpy is imported
    if np is not None and isinstance(value, (np.ndarray, np.generic)):
        return torch.as_tensor(value)
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
    """A mean's dtype: ``t``'s own if floating, else the default float."""
    return t.dtype if (t.is_floating_point() or t.is_complex()) else torch.get_default_dtype()


def reduce_value(op: ReduceOp, value: Any, axis: Axis, reduce_one: ReduceOne,
                 reduce_many: ReduceMany) -> Any:
    """``strategy.reduce``: ``reduce_one`` for one tensor, ``reduce_many`` for a nest's leaves."""
    leaves, rebuild = flatten(value)
    tensors = [as_tensor(leaf, "reduce") for leaf in leaves if leaf is not None]
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
    results = iter(out)  # back into the nest, None leaves kept
    return rebuild([None if leaf is None else next(results) for leaf in leaves])


def gather_value(value: Any, axis: int, gather_one: GatherOne,
                 gather_many: GatherMany) -> Any:
    """``strategy.gather`` (every replica's value concatenated along ``axis``; a scalar
    counts as one row): ``gather_one`` for a single tensor, ``gather_many`` (one exchange)
    for the leaves of a nest."""
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"gather(..., axis=...) takes an int, got {axis!r}")
    leaves, rebuild = flatten(value)
    tensors = [as_tensor(leaf, "gather") for leaf in leaves if leaf is not None]
    for t in tensors:
        if t.dim() and not -t.dim() <= axis < t.dim():
            raise ValueError(f"gather axis {axis} is out of range for a tensor of shape "
                             f"{tuple(t.shape)}")
    if len(leaves) == 1 and leaves[0] is value and len(tensors) == 1:
        return gather_one(tensors[0], axis)
    results = iter(gather_many(tensors, axis, structure(value)) if tensors else [])
    return rebuild([None if leaf is None else next(results) for leaf in leaves])
