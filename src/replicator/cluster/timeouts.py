"""The one place a timeout is chosen (:func:`resolve_timeout`); a group's is remembered, so that
waits over it last as long as its collectives."""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from replicator.cluster.env_names import TIMEOUT_ENV
from replicator.defaults import DEFAULT_TIMEOUT_SECONDS
from replicator.errors import ClusterConfigError

if TYPE_CHECKING:  # imported where a group is given: the launcher reads timeouts without torch
    import torch.distributed as dist

_NO_GROUP: Any = object()  # "the wait is not over a process group"
_OF_GROUP: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()


def resolve_timeout(timeout_seconds: float | None = None, options: Any = None, *,
                    group: dist.ProcessGroup | None = _NO_GROUP,
                    env: Mapping[str, str] | None = None) -> float:
    """Seconds a group, store or wait may last: the first set of ``timeout_seconds``,
    ``options.timeout_seconds``, ``group``'s own (when passed; ``None``: the default group),
    ``REPLICATOR_TIMEOUT_SECONDS`` and 300 s."""
    for given in (timeout_seconds, getattr(options, "timeout_seconds", None)):
        if given is not None:
            if not given > 0:
                raise ValueError(f"timeout_seconds must be positive, got {given}")
            return float(given)
    if group is not _NO_GROUP:  # the timeout the group was made with, if remembered
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            key = dist.group.WORLD if group is None else group
            if key in _OF_GROUP:
                return _OF_GROUP[key]
    return env_number(os.environ if env is None else env, TIMEOUT_ENV, DEFAULT_TIMEOUT_SECONDS)


def env_number(env: Mapping[str, str], name: str, default: float, what: str = "seconds"
               ) -> float:
    """The positive number the variable ``name`` of ``env`` holds, ``default`` when unset."""
    raw = env.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ClusterConfigError(f"{name}={raw!r} is not a number of {what}") from None
    if value <= 0:
        raise ClusterConfigError(f"{name}={raw!r} must be positive ({what})")
    return value


def set_group_timeout(group: dist.ProcessGroup | None, seconds: float) -> None:
    """Make collectives over ``group`` (not ``None`` or a non-member) wait at most ``seconds``
    (a ``DeviceMesh`` axis group waits 30 minutes otherwise) and remember it."""
    import torch.distributed as dist

    if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
        return
    _OF_GROUP[group] = float(seconds)
    set_timeout = getattr(group, "set_timeout", None)
    if callable(set_timeout):  # torch >= 2.6; older ones keep the group's creation timeout
        set_timeout(timedelta(seconds=seconds))
