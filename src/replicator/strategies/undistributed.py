"""Refuse trainable parameters that a synchronous strategy never distributed.

A model built outside ``strategy.scope()`` (and never passed to ``distribute_model``) gets no
initial broadcast and no gradient averaging: under N replicas it silently trains N separate
models. While ``strategy.run`` executes, a global forward pre-hook looks at every module called
with gradients enabled, and an optimizer step pre-hook at every optimizer stepped; a trainable
parameter the strategy does not know raises :class:`~replicator.errors.NotDistributedError`
before anything diverges. Modules and optimizers found clean are remembered (weakly), so the
check costs a dictionary look-up per call after the first step.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from replicator.errors import NotDistributedError

if TYPE_CHECKING:
    from replicator.strategies.base import Strategy


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(d) for d in t.shape) + ")"


class UndistributedGuard:
    """The checks ``Strategy.run`` switches on while a step runs (see the module doc)."""

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = weakref.ref(strategy)
        self._clean_modules: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._clean_optimizers: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._depth = 0
        self._handles: list[Any] = []

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Check modules and optimizers used inside the block. The global hooks stay
        registered between blocks (idle outside them): registering them anew every step
        would change torch's global hook table, which torch.compile guards on, and make a
        compiled model recompile at every step."""
        if not self._handles:
            self._handles = [register_module_forward_pre_hook(self._on_forward),
                             register_optimizer_step_pre_hook(self._on_step)]
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- the checks --------------------------------------------------------------------------
    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self._depth == 0 or not torch.is_grad_enabled():
            return  # outside run(); inference, target networks under no_grad
        if torch.compiler.is_compiling():
            return  # traced by torch.compile: checked in eager calls only (else no graph)
        count = len(module._parameters)
        if self._clean_modules.get(module) == count:
            return
        strategy = self._strategy()
        if strategy is None:
            return
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad and not strategy.is_distributed(p):
                raise self._error(strategy, f"{type(module).__name__} parameter {name!r} "
                                  f"{_shape(p)}", "is used with gradients in strategy.run")
        self._clean_modules[module] = count

    def _on_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._depth == 0:
            return
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if self._clean_optimizers.get(optimizer) == len(params):
            return
        strategy = self._strategy()
        if strategy is None:
            return
        for i, p in enumerate(params):
            if p.grad is not None and not strategy.is_distributed(p):
                raise self._error(strategy, f"parameter {i} {_shape(p)} of "
                                  f"{type(optimizer).__name__}", "is stepped by an optimizer "
                                  "in strategy.run")
        self._clean_optimizers[optimizer] = len(params)

    @staticmethod
    def _error(strategy: Strategy, what: str, how: str) -> NotDistributedError:
        n = strategy.num_replicas_in_sync
        return NotDistributedError(
            f"replica {strategy.replica_id}: {what} {how} but was never distributed by "
            f"{type(strategy).__name__}: it was built outside strategy.scope(), so each of the "
            f"{n} replicas would silently train its own copy (no initial broadcast, no gradient "
            "averaging). HINT: build the model (and then its optimizer) inside `with "
            "strategy.scope():`, or call `model = strategy.distribute_model(model)` before "
            "creating the optimizer; freeze parameters you do not train "
            "(requires_grad_(False)).")
