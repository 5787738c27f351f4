"""The outer weights of a two-level run and the optimizer that moves them.

Every rank keeps the same outer weights and outer optimizer (torch's SGD, Nesterov when
``momentum > 0``; LocalSGD is ``lr=1, momentum=0``) whose gradient is the averaged
pseudo-gradient, so every rank computes the same new outer weights and nothing but the
pseudo-gradient crosses the hosts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from replicator.strategies.nest import clone_tree


class OuterFragment:
    """The outer weights of one fragment's parameters and their optimizer."""

    def __init__(self, params: Sequence[torch.nn.Parameter], lr: float, momentum: float) -> None:
        self.params = list(params)
        self.outer = [torch.nn.Parameter(p.detach().clone().float(), requires_grad=False)
                      for p in self.params]
        self.numel = sum(p.numel() for p in self.params)
        self.optimizer = torch.optim.SGD(self.outer, lr=lr, momentum=momentum,
                                         nesterov=momentum > 0)

    def pseudo_gradient(self) -> torch.Tensor:
        """Outer weights minus this host's inner weights, flat, in float32."""
        return torch.cat([(o - p.detach().float()).reshape(-1)
                          for o, p in zip(self.outer, self.params)])

    @torch.no_grad()
    def step(self, averaged: torch.Tensor) -> None:
        """Take one outer step with the hosts' averaged pseudo-gradient (flat) and set the
        inner weights to the new outer weights."""
        at = 0
        for outer in self.outer:
            outer.grad = averaged[at:at + outer.numel()].view_as(outer).to(outer.device)
            at += outer.numel()
        self.optimizer.step()
        for outer, param in zip(self.outer, self.params):
            outer.grad = None
            param.copy_(outer)

    def state_dict(self) -> dict[str, Any]:
        return {"outer": [o.detach().clone() for o in self.outer],
                "optimizer": clone_tree(self.optimizer.state_dict())}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = list(state["outer"])
        if len(saved) != len(self.outer) or any(
                s.shape != o.shape for s, o in zip(saved, self.outer)):
            raise ValueError(
                "the saved outer weights do not match this model's fragment (different "
                "parameters or fragments=). HINT: resume with the model and the DiLoCo "
                "settings of the run that wrote the backup")
        for outer, value in zip(self.outer, saved):
            outer.copy_(value)
        self.optimizer.load_state_dict(clone_tree(state["optimizer"]))
