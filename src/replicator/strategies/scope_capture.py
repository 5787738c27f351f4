"""Notice the modules built while a strategy's scope is open, and which of them are top-level.

``torch.nn``'s global registration hooks report every parameter, buffer and child registered in
the block, in creation order (the same on every replica); the strategy sets up each *top-level*
module (no other built in the block holds it), so it can shard, wrap or place it as a whole.
"""

from __future__ import annotations

import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)


class RegistrationCapture:
    """Collects the modules that register state between :meth:`start` and :meth:`stop` (held
    strongly only meanwhile, so ids are not reused); :meth:`stop` returns the top-level ones."""

    def __init__(self) -> None:
        self._modules: dict[int, torch.nn.Module] = {}
        self._children: set[int] = set()
        self._handles: list = []

    def start(self) -> None:
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
    """One line per named parameter and buffer (kind, name, shape, dtype): what must be the
    same on every replica (and every replica group)."""
    return [f"{kind} {name}: shape {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
            for kind, named in (("parameter", params), ("buffer", buffers)) for name, t in named]
