"""Nested values: what ``reduce``, ``gather`` and ``all_reduce`` take, as tf.distribute does.

Tuples, lists, dicts, namedtuples, dataclasses and ``_pytree`` nodes of tensors or numbers.
:func:`flatten` gives the leaves in a fixed order and a rebuild function, so a nest travels in
one collective (``None`` leaves stay). Dataclasses are flattened here, not registered globally
with ``_pytree``. :func:`structure` describes the shape for the fingerprint.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

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
    """The leaves of ``value`` (a tensor, a number, or a nest of them) and a function that
    puts new leaves back into the same structure."""
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
    """A short description of ``value``'s shape (containers, keys, field names), the same on
    every replica that passes the same kind of nest."""
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
