"""Named points inside a save, or a parameter server's commit, where tests may inject a fault
(``rp.testing.kill_during_save``); :func:`fire` with no hook registered costs one lookup."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: Where hooks may attach: before a background save copies the state it deferred (on its
#: thread), before any file is written, between the data files and the commit marker, and
#: after the commit; between two servers' commits of a coordinator's update (``staleness=0``)
#: or between two servers' pushes of one (asynchronous).
POINTS = ("before_copy", "before_write", "before_commit", "after_commit",
          "between_server_commits", "between_server_pushes")

_HOOKS: dict[str, list[Callable[..., None]]] = {}


def add_hook(point: str, hook: Callable[..., None]) -> Callable[[], None]:
    """Call ``hook(step=..., path=..., rank=...)`` at ``point``; returns a function removing it."""
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; available: {', '.join(POINTS)}")
    _HOOKS.setdefault(point, []).append(hook)

    def remove() -> None:
        hooks = _HOOKS.get(point, [])
        if hook in hooks:
            hooks.remove(hook)

    return remove


def fire(point: str, **details: Any) -> None:
    """Run the hooks registered at ``point`` (none in normal operation)."""
    for hook in list(_HOOKS.get(point, ())):
        hook(**details)
