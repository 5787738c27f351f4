"""Which modules a strategy sees: the top-level ones registered while its scope is open (by
``torch.nn``'s global registration hooks, in creation order), and trainable parameters it never
distributed, refused by process-wide hooks with ``NotDistributedError`` (docs/troubleshooting.md);
DDP and DTensor parameters count as distributed. The hooks stay (torch.compile guards on them).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_forward_pre_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from replicator.errors import NotDistributedError


class RegistrationCapture:
    """Collects the modules that register state from its creation to :meth:`stop` (held
    strongly only meanwhile, so ids are not reused); :meth:`stop` returns the top-level ones."""

    def __init__(self) -> None:
        self._modules: dict[int, torch.nn.Module] = {}
        self._children: set[int] = set()
        self._handles = [register_module_parameter_registration_hook(self._on_state),
                         register_module_buffer_registration_hook(self._on_state),
                         register_module_module_registration_hook(self._on_child)]

    def stop(self) -> list[torch.nn.Module]:
        """The top-level modules built in the block, in creation order."""
        for h in self._handles:
            h.remove()
        self._handles = []
        top = [m for key, m in self._modules.items() if key not in self._children]
        self._modules, self._children = {}, set()
        return top

    def _on_state(self, module: torch.nn.Module, name: str, value: torch.Tensor | None) -> None:
        if value is not None:
            self._modules.setdefault(id(module), module)

    def _on_child(self, parent: torch.nn.Module, name: str, child: torch.nn.Module | None
                  ) -> None:
        self._modules.setdefault(id(parent), parent)
        if child is not None:
            self._modules.setdefault(id(child), child)
            self._children.add(id(child))


def named_state(module: torch.nn.Module) -> tuple[list[tuple[str, torch.nn.Parameter]],
                                                  list[tuple[str, torch.Tensor]]]:
    """A module's named parameters and buffers (shared ones once), in registration order."""
    return (list(module.named_parameters()),
            [(n, b) for n, b in module.named_buffers() if b is not None])


def describe_state(params: list[tuple[str, torch.nn.Parameter]],
                   buffers: list[tuple[str, torch.Tensor]]) -> list[str]:
    """One line per named parameter and buffer (kind, name, shape, dtype)."""
    return [f"{kind} {name}: shape {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
            for kind, named in (("parameter", params), ("buffer", buffers)) for name, t in named]


# -- parameters never distributed -----------------------------------------------------------

def _checks(strategy: Any) -> bool:
    return (strategy._guards_undistributed and not strategy._closed
            and strategy.num_replicas_in_sync > 1)


class UndistributedWatch:
    """The process-wide checks (see the module doc); one instance, :data:`WATCH`."""

    def __init__(self) -> None:
        self._strategies: weakref.WeakSet[Any] = weakref.WeakSet()
        self._clean_modules: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._clean_optimizers: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._armed: WeakIdKeyDictionary = WeakIdKeyDictionary()
        #: parameters of modules that torch's own DistributedDataParallel wraps (its
        #: reducer averages their gradients: distributed, though by no strategy of ours)
        self._external: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._depth = 0
        self._handles: list[Any] = []

    def add(self, strategy: Any) -> None:
        """Know ``strategy``; the hooks go in with the first that checks."""
        self._strategies.add(strategy)
        if not self._handles and _checks(strategy):
            self._handles = [register_module_forward_pre_hook(self._on_forward),
                             register_optimizer_step_pre_hook(self._on_step)]

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Inside ``strategy.run``: an undistributed parameter raises at its forward."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def _checking(self) -> Any:
        """A live strategy that checks (the first), or ``None``: the hooks are idle."""
        return next((s for s in list(self._strategies) if _checks(s)), None)

    def _distributed(self, p: torch.Tensor) -> bool:
        return p in self._external or _is_dtensor(p) or \
            any(not s._closed and s.is_distributed(p) for s in list(self._strategies))

    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return  # inference and target networks; compiled graphs are checked eagerly
        if isinstance(module, DistributedDataParallel):  # runs before its inner modules
            for p in module.parameters():
                self._external[p] = True
            return
        count = len(module._parameters)
        if not count or self._clean_modules.get(module) == count or \
                (strategy := self._checking()) is None:
            return
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or self._distributed(p):
                continue
            what = f"{type(module).__name__} parameter {name!r} {tuple(p.shape)}"
            if self._depth:
                raise _error(strategy, what, "is used with gradients in strategy.run")
            if p not in self._armed:
                self._armed[p] = True
                p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, what))
        self._clean_modules[module] = count

    def _on_grad(self, what: str, p: torch.Tensor) -> None:
        strategy = self._checking()
        if strategy is not None and not self._distributed(p):
            raise _error(strategy, what, "got a gradient in backward()")

    def _on_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        count = sum(len(g["params"]) for g in optimizer.param_groups)
        if self._clean_optimizers.get(optimizer) == count or \
                (strategy := self._checking()) is None:
            return
        params = [p for g in optimizer.param_groups for p in g["params"]]
        pending = False  # an undistributed trainable parameter without a gradient yet
        for i, p in enumerate(params):
            if (p.grad is None and not p.requires_grad) or self._distributed(p):
                continue
            if p.grad is not None:
                raise _error(strategy, f"parameter {i} {tuple(p.shape)} of "
                             f"{type(optimizer).__name__}", "is stepped by an optimizer")
            pending = True
        if not pending:  # clean for good; otherwise checked again at the next step
            self._clean_optimizers[optimizer] = count


def _is_dtensor(p: torch.Tensor) -> bool:
    """A DTensor parameter (without importing DTensor's module: none exists until it is)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(p, module.DTensor)


def _error(strategy: Any, what: str, how: str) -> NotDistributedError:
    n = strategy.num_replicas_in_sync
    return NotDistributedError(
        f"replica {strategy.replica_id}: {what} {how} but was never distributed by "
        f"{type(strategy).__name__}: it was built outside strategy.scope(), so each of the "
        f"{n} replicas would silently train its own copy (no initial broadcast, no gradient "
        "averaging). HINT: build the model (and then its optimizer) inside `with "
        "strategy.scope():`, or call `model = strategy.distribute_model(model)` before "
        "creating the optimizer; freeze parameters you do not train "
        "(requires_grad_(False)); close() a strategy you no longer use.")


#: The one watch of this process.
WATCH = UndistributedWatch()
