"""Strategies watch every optimizer step through one pair of global hooks, registered once and
never removed: a strategy collected while an optimizer iterates over those hooks must not
change them under it, and a new strategy adds none."""

from __future__ import annotations

import gc

import torch
from torch.optim.optimizer import _global_optimizer_pre_hooks, register_optimizer_step_pre_hook

import replicator as rp


def test_a_strategy_collected_during_a_step_leaves_the_hooks_as_they_are():
    gc.collect()  # strategies other tests left behind go first
    strategy = rp.OneDeviceStrategy("cpu")
    strategy.cycle = strategy  # type: ignore[attr-defined]  # only the cycle collector frees it
    hooks = list(_global_optimizer_pre_hooks)
    del strategy

    def collect(optimizer, args, kwargs) -> None:
        gc.collect()  # the strategy is collected here, inside the step's loop over the hooks

    handle = register_optimizer_step_pre_hook(collect)
    try:
        p = torch.nn.Parameter(torch.ones(2))
        p.grad = torch.ones(2)
        torch.optim.SGD([p], lr=0.1).step()
    finally:
        handle.remove()
    torch.testing.assert_close(p.detach(), torch.full((2,), 0.9))
    assert list(_global_optimizer_pre_hooks) == hooks
    rp.OneDeviceStrategy("cpu").close()  # the next strategy adds no hook
    assert list(_global_optimizer_pre_hooks) == hooks
