"""One optimizer step for many shards: dense shards of a push whose optimizers agree (class and
hyperparameters) step together, since ``torch.optim``'s fixed cost per ``step()`` outweighs
the arithmetic on small shards; each shard keeps its own state (the same dicts)."""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Hashable, Sequence
from typing import Any

import torch

#: ``torch.optim`` classes whose ``step()`` updates each parameter from its own gradient and
#: state alone (so stepping several parameters together equals stepping each alone).
PER_PARAMETER = frozenset({"SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD",
                           "NAdam", "RAdam", "RMSprop", "Rprop"})


def _signature(optimizer: torch.optim.Optimizer) -> Hashable | None:
    """What must agree for two optimizers to share a step; ``None``: step it alone."""
    cls = type(optimizer)
    if cls.__name__ not in PER_PARAMETER or getattr(torch.optim, cls.__name__, None) is not cls:
        return None
    if len(optimizer.param_groups) != 1 or optimizer._optimizer_step_pre_hooks \
            or optimizer._optimizer_step_post_hooks:
        return None
    group = optimizer.param_groups[0]
    params = group["params"]
    if any(p.grad is None or p.grad.is_sparse for p in params):
        return None
    hyper = tuple(sorted((k, repr(v)) for k, v in group.items() if k != "params"))
    devices = tuple(sorted({(str(p.device), str(p.dtype)) for p in params}))
    return cls, hyper, devices


class SharedSteps:
    """Steps lists of per-shard optimizers, sharing one step among those that agree."""

    def __init__(self) -> None:
        self._steppers: dict[tuple[int, ...], torch.optim.Optimizer] = {}

    def step(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """``step()`` every optimizer once (each appears at most once)."""
        groups: dict[Hashable, list[torch.optim.Optimizer]] = defaultdict(list)
        alone: list[torch.optim.Optimizer] = []
        for opt in optimizers:
            key = _signature(opt)
            (alone.append(opt) if key is None else groups[key].append(opt))
        for opts in groups.values():
            if len(opts) == 1:
                alone.extend(opts)
            else:
                self._stepper(opts).step()
        for opt in alone:
            opt.step()

    def _stepper(self, opts: list[torch.optim.Optimizer]) -> torch.optim.Optimizer:
        key = tuple(id(o) for o in opts)
        stepper = self._steppers.get(key)
        params = [p for o in opts for p in o.param_groups[0]["params"]]
        if stepper is None or any(stepper.state[p] is not o.state[p]
                                  for o in opts for p in o.param_groups[0]["params"]):
            if len(self._steppers) > 64:  # shards re-registered or optimizers rebuilt often
                self._steppers.clear()
            stepper = copy.copy(opts[0])
            state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
            for o in opts:
                for p in o.param_groups[0]["params"]:
                    state[p] = o.state[p]  # the shard's own dict: updates land there
            stepper.state = state
            stepper.param_groups = [dict(opts[0].param_groups[0], params=params)]
            self._steppers[key] = stepper
        else:  # hyperparameters may have changed (a learning-rate schedule): all agree
            stepper.param_groups[0].update({k: v for k, v in opts[0].param_groups[0].items()
                                            if k != "params"})
        return stepper
