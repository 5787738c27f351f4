"""What torch's model-parallel engines cost beyond the compute, measured on a small chain.

Used by :mod:`replicator.plan.measure` inside its worker processes: ``FSDPStrategy``'s cost
per sharded block (narrow and ``WIDE`` blocks, SGD and Adam, in a training loop's steps) and
``PipelineStrategy``'s cost per microbatch slot, each as a strategy's step of a 4-block chain
less the same step without a strategy.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["WIDE", "layer_call_seconds", "local_forward_backward_seconds",
           "local_step_seconds", "median_time", "pipeline_slot_seconds", "sgd_step",
           "strategy_step_overhead"]


def median_time(fn: Callable[[], Any], rounds: int, per_round: int = 1) -> float:
    """Median over ``rounds`` of the time of ``per_round`` back-to-back calls, per call."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(per_round):
            fn()
        times.append((time.perf_counter() - t0) / per_round)
    return statistics.median(times)


#: Width of the wide blocks FSDP's per-byte cost is measured on (1 MB of weights each).
WIDE = 512


def tiny_chain(blocks: int = 4, width: int = 8) -> torch.nn.Sequential:
    """The calibration model: ``blocks`` Linear(width, width) layers in a chain."""
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(blocks)])


def make_optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    """SGD, or Adam (its state is what a sharded optimizer step touches per parameter)."""
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.0)
    return torch.optim.SGD(model.parameters(), lr=0.0)


def strategy_step_overhead(name: str, t_local: float, batch: int = 8, width: int = 8,
                            optimizer: str = "sgd", rounds: int = 5, per_round: int = 4,
                            reduce_seconds: float | None = None) -> float:
    """Seconds per step that ``rp.get_strategy(name)`` adds to a 4-block model's forward,
    backward and optimizer step (``t_local``: the same step without a strategy); the median
    of ``rounds`` rounds of ``per_round`` steps. With ``reduce_seconds`` (a scalar reduce's
    own cost) each step is a training loop's, ``strategy.reduce`` of the loss after the
    run, and what the reduce costs beyond ``reduce_seconds`` (its wait for the last rank)
    counts in the strategy's cost."""
    import replicator as rp

    strategy = rp.get_strategy(name)
    with strategy.scope():
        torch.manual_seed(0)
        model = tiny_chain(width=width)
        opt = make_optimizer(optimizer, model)
    step = sgd_step(model, opt, torch.randn(batch, width))

    def one() -> None:
        if reduce_seconds is None:
            strategy.run(step)
        else:
            strategy.reduce("mean", strategy.run(step))

    for _ in range(3):
        one()
    seconds = median_time(one, rounds, per_round)
    strategy.close()
    return max(0.0, seconds - t_local - (reduce_seconds or 0.0))


def local_forward_backward_seconds(blocks: int, batch: int, width: int = 8) -> float:
    """Forward and backward of a ``blocks``-block chain on ``batch`` samples (no optimizer)."""
    model = tiny_chain(blocks, width)
    x = torch.randn(batch, width)

    def step() -> None:
        model(x).sum().backward()

    step()
    return median_time(step, 5, 10)


def layer_call_seconds(batch: int = 2) -> float:
    """One small layer's forward and backward call beyond the engine's fixed cost: the
    difference between a 4- and a 2-block chain, per block (what a pipeline stage pays per
    layer and microbatch, however few its samples)."""
    return max(0.0, (local_forward_backward_seconds(4, batch)
                     - local_forward_backward_seconds(2, batch)) / 2)


def pipeline_slot_seconds(t_chain: float, t_chain_fb: float, layer_call: float,
                           stages: int = 2, microbatches: int = 4) -> float:
    """The schedule's own cost per slot: a pipelined step of the 4-block chain, less what the
    cost model counts apart for any model: each stage's layer calls per slot, the extra
    forward of ``model(x)`` (a third of a forward and backward, per stage) and the stage's
    optimizer step."""
    slots = microbatches + stages - 1
    # point-to-point waits vary from step to step: 11 x 10 steps (about half a second)
    t_pipe = strategy_step_overhead("pipeline", t_chain, rounds=11, per_round=10) + t_chain
    counted = (slots * layer_call * 4 / stages + t_chain_fb / stages / 3
               + max(0.0, t_chain - t_chain_fb) / stages)
    return max(0.0, t_pipe - counted) / slots


def local_step_seconds(batch: int = 8, width: int = 8, optimizer: str = "sgd") -> float:
    """The 4-block model's step without any strategy (measured before one exists)."""
    model = tiny_chain(width=width)
    opt = make_optimizer(optimizer, model)
    step = sgd_step(model, opt, torch.randn(batch, width))
    step()
    return median_time(step, 5, 10)


def sgd_step(model: torch.nn.Module, opt: torch.optim.Optimizer,
              x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One forward, backward and optimizer step of ``model`` on ``x``, as a callable that
    returns the loss (detached), as a training loop's step does."""

    def step() -> torch.Tensor:
        loss = model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step
