"""Notice the parameters and buffers that modules register while a strategy's scope is open.

This is what makes ``with strategy.scope(): model = Net()`` enough: the global registration
hooks of ``torch.nn`` report every parameter and buffer created inside the block, in creation
order, which is the same on every replica that runs the same code.
"""

from __future__ import annotations

import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)


class RegistrationCapture:
    """Collects ``(parameters, buffers)`` registered between :meth:`start` and :meth:`stop`."""

    def __init__(self) -> None:
        self.params: dict[int, torch.nn.Parameter] = {}
        self.buffers: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def start(self) -> None:
        self._handles = [register_module_parameter_registration_hook(self._on_param),
                         register_module_buffer_registration_hook(self._on_buffer)]

    def stop(self) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
        for h in self._handles:
            h.remove()
        self._handles = []
        return list(self.params.values()), list(self.buffers.values())

    def _on_param(self, module: torch.nn.Module, name: str, param: torch.nn.Parameter | None
                  ) -> None:
        if param is not None:
            self.params.setdefault(id(param), param)

    def _on_buffer(self, module: torch.nn.Module, name: str, buffer: torch.Tensor | None
                   ) -> None:
        if buffer is not None:
            self.buffers.setdefault(id(buffer), buffer)


def module_state(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    """The parameters and buffers of a module built outside a scope, in registration order."""
    return list(model.parameters()), [b for b in model.buffers() if b is not None]
