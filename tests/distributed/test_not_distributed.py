"""A model never distributed, trained without ``strategy.run`` under a multi-replica strategy,
is refused at its first backward or optimizer step (real processes, no mocks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import replicator as rp
from replicator.testing import run_distributed


def _plain_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = F.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 2))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _case(case: str) -> str:
    strategy = rp.MirroredStrategy()
    torch.manual_seed(dist.get_rank())  # replicas would silently start from different weights
    try:
        if case == "plain_loop":
            model = nn.Linear(4, 2)
            _plain_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
        elif case == "optimizer_in_scope":
            model = nn.Linear(4, 2)
            with strategy.scope():
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            _plain_step(model, optimizer)
        elif case == "step_without_backward":  # gradients set by hand: the optimizer's check
            model = nn.Linear(4, 2)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            optimizer.step()
        elif case == "distributed_after_forward":
            model = nn.Linear(4, 2)
            model(torch.randn(2, 4)).sum()  # a forward before distribute_model: fine
            strategy.distribute_model(model)
            _plain_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
        elif case == "in_scope":
            with strategy.scope():
                model = nn.Linear(4, 2)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            _plain_step(model, optimizer)
        elif case == "frozen_and_reference":
            with strategy.scope():
                student = nn.Linear(4, 2)
                opt = torch.optim.SGD(student.parameters(), lr=0.1)
            teacher = nn.Linear(4, 2).requires_grad_(False)  # frozen: never trained
            idle = torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.1)
            idle.step()  # an optimizer whose parameters have no gradient
            reference = nn.Linear(4, 2)
            reference(torch.randn(2, 4))  # a forward with no backward: left alone
            loss = F.mse_loss(student(torch.randn(8, 4)), teacher(torch.randn(8, 4)))
            loss.backward()
            opt.step()
        elif case == "closed":
            strategy.close()
            model = nn.Linear(4, 2)
            _plain_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
        else:
            raise ValueError(case)
    except rp.errors.NotDistributedError as exc:
        return f"refused: {exc}"
    return "ok"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["plain_loop", "optimizer_in_scope", "step_without_backward"])
def test_undistributed_training_outside_run_is_refused(case):
    for rank, text in enumerate(run_distributed(_case, 2, args=(case,))):
        assert text.startswith(f"refused: replica {rank}: "), text
        assert "(2, 4)" in text or "(2,)" in text
        assert "strategy.scope()" in text and "distribute_model" in text
        how = "is stepped by an optimizer" if case == "step_without_backward" else \
            "got a gradient in backward()"
        assert how in text


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["distributed_after_forward", "in_scope",
                                  "frozen_and_reference", "closed"])
def test_no_false_positives(case):
    assert run_distributed(_case, 2, args=(case,)) == ["ok", "ok"]


def _fsdp_case(_: int) -> str:
    strategy = rp.FSDPStrategy()
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _plain_step(model, optimizer)  # sharded parameters: the strategy's own
    outside = nn.Linear(4, 2)
    try:
        _plain_step(outside, torch.optim.SGD(outside.parameters(), lr=0.1))
    except rp.errors.NotDistributedError as exc:
        return f"refused: {exc}"
    return "ok"


@pytest.mark.timeout(150)
def test_fsdp_shards_are_distributed_and_an_outside_model_is_not():
    for text in run_distributed(_fsdp_case, 2, args=(0,)):
        assert text.startswith("refused: ") and "FSDPStrategy" in text, text


def test_one_device_never_checks():
    strategy = rp.OneDeviceStrategy("cpu")
    model = nn.Linear(4, 2)
    _plain_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    strategy.close()
