"""Strategies by name: ``rp.get_strategy("mirrored")``."""

from __future__ import annotations

import difflib
from typing import Any

from replicator.strategies.base import Strategy

_REGISTRY: dict[str, type[Strategy]] = {}


def register_strategy(cls: type[Strategy], *aliases: str,
                      override: bool = False) -> type[Strategy]:
    """Make ``cls`` available to :func:`get_strategy` under ``cls.name`` and ``aliases`` (a name
    another class holds is an error unless ``override=True``)."""
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise TypeError(f"register_strategy takes a Strategy subclass, got {cls!r}")
    keys = (cls.name, *aliases)
    taken = [k for k in keys if k in _REGISTRY and _REGISTRY[k] is not cls]
    if taken and not override:
        owners = ", ".join(f"{k!r} ({_REGISTRY[k].__name__})" for k in taken)
        raise ValueError(f"strategy name(s) {owners} already registered. HINT: choose another "
                         "name, or pass override=True to replace it on purpose.")
    for key in keys:
        _REGISTRY[key] = cls
    return cls


def available_strategies() -> list[str]:
    return sorted({cls.name for cls in _REGISTRY.values()})


def _key(name: str) -> str:
    return name.strip().lower().replace("-", "_").removesuffix("strategy").rstrip("_")


def find_strategy_class(name: str) -> type[Strategy] | None:
    """The class :func:`get_strategy` would build for ``name`` (``"MirroredStrategy"`` too)."""
    return _REGISTRY.get(_key(name))


def get_strategy(name: str, **kwargs: Any) -> Strategy:
    """Build the strategy registered as ``name`` with ``kwargs``; unknown names list the known."""
    if not isinstance(name, str):
        raise TypeError(f"get_strategy takes a strategy name, got {type(name).__name__}")
    cls = find_strategy_class(name)
    if cls is None:
        close = difflib.get_close_matches(_key(name), list(_REGISTRY), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown strategy {name!r}; available: "
                         f"{', '.join(available_strategies())}.{hint}")
    return cls(**kwargs)
