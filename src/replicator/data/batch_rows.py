"""Row operations on a collated batch (tensors nested in tuples, lists and dicts).

A batch's rows are along dimension 0 of every tensor; a list of plain values (strings, numbers)
such as ``default_collate`` makes of strings counts as one row per value. These operations let
the pipeline take a replica's slice of a collated global batch and pad a short batch with
copies of its first row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def _is_row_list(value: Any) -> bool:
    return isinstance(value, list) and not any(
        isinstance(v, (torch.Tensor, list, tuple, Mapping)) or hasattr(v, "shape") for v in value)


def _map_leaves(batch: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(batch, torch.Tensor) or _is_row_list(batch) or (
            hasattr(batch, "shape") and hasattr(batch, "__getitem__")):
        return fn(batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_map_leaves(b, fn) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map_leaves(b, fn) for b in batch)
    if isinstance(batch, Mapping):
        return type(batch)({k: _map_leaves(v, fn) for k, v in batch.items()})  # type: ignore[call-arg]
    return batch


def batch_rows(batch: Any) -> int | None:
    """The number of rows of a batch (dim 0 of its first tensor), ``None`` if it has none."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    if _is_row_list(batch):
        return len(batch)
    if hasattr(batch, "shape") and hasattr(batch, "__getitem__") and len(batch.shape):
        return int(batch.shape[0])
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            rows = batch_rows(item)
            if rows is not None:
                return rows
    return None


def slice_rows(batch: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of every leaf."""
    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() == 0:
            return leaf
        return leaf[start:stop]
    return _map_leaves(batch, cut)


def pad_rows(batch: Any, size: int) -> Any:
    """Append copies of row 0 until every leaf has ``size`` rows (masked padding)."""
    def pad(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0 or leaf.shape[0] >= size:
                return leaf
            if leaf.shape[0] == 0:
                raise ValueError("cannot pad an empty batch: it has no row to copy")
            extra = leaf[:1].expand(size - leaf.shape[0], *leaf.shape[1:])
            return torch.cat([leaf, extra])
        if isinstance(leaf, list):
            return leaf + [leaf[0]] * (size - len(leaf)) if leaf else leaf
        if hasattr(leaf, "shape") and len(leaf.shape) and leaf.shape[0] < size:
            import numpy as np

            return np.concatenate([leaf] + [leaf[:1]] * (size - leaf.shape[0]))
        return leaf
    return _map_leaves(batch, pad)


def repeat_first_row(batch: Any, size: int) -> Any:
    """A batch of ``size`` copies of row 0 (a fully masked batch for a replica out of data)."""
    return pad_rows(slice_rows(batch, 0, 1), size)
