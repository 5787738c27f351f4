"""Strategies see modules: undistributed models are refused, tensors are tracked weakly,
synchronizers go with their modules, and mismatched models name the parameter."""

from __future__ import annotations

import gc
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import replicator as rp
from replicator.testing import run_distributed


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x = torch.randn(8, 4)
    loss = F.mse_loss(model(x), torch.zeros(8, 2))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _outside_scope(case: str) -> str:
    strategy = rp.MirroredStrategy()
    torch.manual_seed(dist.get_rank())  # replicas would silently start from different weights
    model = nn.Linear(4, 2)
    if case == "distributed":
        strategy.distribute_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if case == "frozen_target":
        with strategy.scope():
            student = nn.Linear(4, 2)
            opt = torch.optim.SGD(student.parameters(), lr=0.1)

        def distill() -> None:
            with torch.no_grad():
                target = model(torch.randn(8, 4))  # a target network used without gradients
            loss = F.mse_loss(student(torch.randn(8, 4)), target)
            loss.backward()
            opt.step()
            opt.zero_grad()

        strategy.run(distill)
        return "ok"
    try:
        strategy.run(_step, args=(model, optimizer))
    except rp.errors.NotDistributedError as exc:
        return f"refused: {exc}"
    return "ok"


@pytest.mark.timeout(120)
def test_model_built_outside_scope_is_refused_with_the_fix():
    a, b = run_distributed(_outside_scope, 2, args=("outside",))
    for text in (a, b):
        assert text.startswith("refused: ")
        assert "Linear parameter 'weight' (2, 4)" in text
        assert "distribute_model" in text and "strategy.scope()" in text
    assert run_distributed(_outside_scope, 2, args=("distributed",)) == ["ok", "ok"]
    assert run_distributed(_outside_scope, 2, args=("frozen_target",)) == ["ok", "ok"]


def _freed_then_rebuilt(_: int) -> dict:
    strategy = rp.MirroredStrategy()
    with strategy.scope():
        first = nn.BatchNorm1d(4)
    n_after_first = len(strategy._replica_group.synchronizers)
    del first
    gc.collect()
    n_after_free = len(strategy._replica_group.synchronizers)
    # a new model built outside scope may reuse the freed tensors' ids: it must still be
    # broadcast (its buffer differs per rank before distribute_model)
    second = nn.BatchNorm1d(4)
    with torch.no_grad():
        second.running_mean.fill_(float(dist.get_rank() + 1))
        second.weight.fill_(float(dist.get_rank() + 1))
    strategy.distribute_model(second)
    strategy.close()
    return {"sync": (n_after_first, n_after_free), "mean": second.running_mean.tolist(),
            "weight": second.weight.tolist(),
            "closed": len(strategy._replica_group.synchronizers)}


@pytest.mark.timeout(120)
def test_tensors_tracked_weakly_and_synchronizers_follow_their_module():
    a, b = run_distributed(_freed_then_rebuilt, 2, args=(0,))
    assert a["sync"] == (1, 0)
    assert a["mean"] == b["mean"] == [1.0] * 4
    assert a["weight"] == b["weight"] == [1.0] * 4
    assert a["closed"] == 0


class _Wide(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3)
        self.head = nn.Linear(width, 2)


def _mismatch(_: int) -> str:
    strategy = rp.MirroredStrategy()
    try:
        with strategy.scope():
            _Wide(4 if dist.get_rank() == 0 else 5)
    except rp.errors.ReplicaMismatchError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(120)
def test_structure_mismatch_names_the_parameter():
    a, _ = run_distributed(_mismatch, 2, args=(0,))
    assert "conv1.weight" in a and "(4, 1, 3, 3)" in a and "(5, 1, 3, 3)" in a


def _top_level_modules(_: int) -> list[int]:
    strategy = rp.MirroredStrategy()
    torch.manual_seed(dist.get_rank())
    backbone = nn.Linear(3, 3)  # built outside, then wrapped by a model built inside
    with strategy.scope():
        model = nn.Sequential(backbone, nn.Linear(3, 1))
        other = nn.Linear(2, 2)
    built = [len(strategy._replica_group.synchronizers),
             int(strategy.is_distributed(backbone.weight))]
    del model, other
    gc.collect()
    return [*built, len(strategy._replica_group.synchronizers)] + \
        [round(float(v), 6) for v in backbone.weight.detach().flatten()]


@pytest.mark.timeout(120)
def test_scope_sets_up_each_top_level_module_with_its_children():
    a, b = run_distributed(_top_level_modules, 2, args=(0,))
    # the Sequential (with its outside-built child) and the other Linear; gone once freed
    assert a[:3] == [2, 1, 0]
    assert a == b  # the wrapped backbone was broadcast from replica 0


def test_one_device_strategy_in_a_multi_process_job_warns(tmp_path, capfd):
    from replicator.cli import main

    script = tmp_path / "one_device.py"
    script.write_text(textwrap.dedent("""
        import replicator as rp
        rp.OneDeviceStrategy("cpu")
    """))
    # `replicator run` by the command line's own main in this process (one fresh interpreter
    # fewer); the workers that warn are new processes, their stderr reaches this process's
    code = main(["run", "--nproc", "2", str(script)])
    err = capfd.readouterr().err
    assert code == 0, err
    assert "independent model" in err and "MirroredStrategy" in err
