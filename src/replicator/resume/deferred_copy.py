"""Which tensors of a backup may be copied after its step, and the hook that makes that safe.

With the saver process, a save's state is copied into shared memory; the loop need not wait
for the parameters and the optimizer's state (most of the bytes): nothing changes them until
the next optimizer step. :class:`CopyGuard` registers a step pre-hook on each tracked
optimizer that waits for the copy of the last save, and names the tensors that may be
deferred: the CPU parameters of those optimizers and their state tensors. Everything else
(buffers a forward pass updates, such as batch norm's running statistics, the RNG and input
states, other tracked objects) is copied at the step, so the backup holds the values of its
step, bit for bit. Replica groups under live recovery roll back and heal their state in
place at a step's start, so they copy everything at the step. Other code that changes the
parameters in place between a save and the next optimizer step needs ``background=False``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class CopyGuard:
    """Step pre-hooks that wait for a save's deferred copy, and what may be deferred."""

    def __init__(self) -> None:
        self._hooks: dict[int, tuple[torch.optim.Optimizer, Any]] = {}

    def attach(self, objects: Iterable[Any], wait: Callable[[], None]) -> None:
        """Hook every optimizer among ``objects`` not hooked yet: its step first calls
        ``wait()``."""
        for obj in objects:
            if isinstance(obj, torch.optim.Optimizer) and id(obj) not in self._hooks:
                handle = obj.register_step_pre_hook(lambda *_: wait())
                self._hooks[id(obj)] = (obj, handle)

    def deferrable(self) -> Callable[[torch.Tensor], bool] | None:
        """A test for the tensors only a hooked optimizer's step changes (``None``: none)."""
        where: set[int] = set()
        for opt, _ in self._hooks.values():
            for group in opt.param_groups:
                where.update(p.data_ptr() for p in group["params"] if p.device.type == "cpu")
            for state in opt.state.values():
                where.update(v.data_ptr() for v in state.values()
                             if isinstance(v, torch.Tensor) and v.device.type == "cpu")
        where.discard(0)
        if not where:
            return None
        return lambda t: t.device.type == "cpu" and t.data_ptr() in where

    def remove(self) -> None:
        for _, handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
