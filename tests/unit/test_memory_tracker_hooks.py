"""A strategy's memory tracker watches every optimizer step through a global hook; a tracker
collected while an optimizer iterates over those hooks must not change them under it."""

from __future__ import annotations

import gc

import torch
from torch.optim.optimizer import _global_optimizer_pre_hooks, register_optimizer_step_pre_hook

from replicator.strategies.memory import MemoryTracker


def test_a_tracker_collected_during_a_step_leaves_the_hooks_as_they_are():
    gc.collect()  # trackers other tests left behind go first
    tracker = MemoryTracker(lambda p: False, None)
    tracker.cycle = tracker  # only the cycle collector frees it
    hook = tracker._hook.id
    del tracker

    def collect(optimizer, args, kwargs) -> None:
        gc.collect()  # the tracker is collected here, inside the step's loop over the hooks

    handle = register_optimizer_step_pre_hook(collect)
    try:
        p = torch.nn.Parameter(torch.ones(2))
        p.grad = torch.ones(2)
        torch.optim.SGD([p], lr=0.1).step()
    finally:
        handle.remove()
    torch.testing.assert_close(p.detach(), torch.full((2,), 0.9))
    assert hook in _global_optimizer_pre_hooks  # the dead hook waits, doing nothing
    MemoryTracker(lambda p: False, None)  # the next tracker removes it
    assert hook not in _global_optimizer_pre_hooks
