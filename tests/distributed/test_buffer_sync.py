"""BatchNorm running statistics stay equal across replicas (so a saved model does not depend
on which rank saved it): averaged with "mean", replica 0's with "broadcast", left alone with
"none"."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import replicator as rp
from replicator.cluster.process_group import initialize
from replicator.comm.collectives import Collectives
from replicator.comm.gradient_sync import GradientSynchronizer
from replicator.testing import run_distributed

STEPS = 3


class BatchNormCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.bn(self.conv(x))).mean((2, 3)))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(8, 1, 6, 6, generator=g) * (rank + 1) + 2.0 * rank  # replicas differ
    return x, torch.randint(0, 2, (8,), generator=g)


def _stats(model: BatchNormCNN) -> dict:
    return {"mean": model.bn.running_mean.tolist(), "var": model.bn.running_var.tolist(),
            "count": int(model.bn.num_batches_tracked)}


def _train(model: nn.Module, steps: int, rank: int, first: int = 0) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(first, first + steps):
        x, y = _batch(rank, step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _buffer_modes(_: int) -> dict:
    # the engine alone first, with no strategy alive: a live multi-replica strategy refuses
    # training of models it never distributed (the removed-synchronizer step below)
    info = initialize()
    collectives = Collectives.for_group(None, torch.device("cpu"), info.timeout_seconds)
    rank = collectives.rank
    out: dict = {}
    for mode in ("none", "mean", "broadcast"):
        torch.manual_seed(0)
        model = BatchNormCNN()
        collectives.broadcast_([*model.parameters(), *model.buffers()])
        sync = GradientSynchronizer(list(model.parameters()), collectives,
                                    buffers=list(model.buffers()), buffer_sync=mode)
        _train(model, 1, rank)
        out[f"{mode}_1"] = _stats(model)
        _train(model, STEPS - 1, rank, first=1)
        out[mode] = _stats(model)
        sync.remove()
        sync.remove()  # idempotent
        # once removed, nothing is synchronized: gradients and statistics stay local
        x, y = _batch(rank, STEPS)
        F.cross_entropy(model(x), y).backward()
        out[f"{mode}_removed"] = {"grad": model.fc.bias.grad.tolist(), **_stats(model)}
    # the strategy's own path: a model built in scope() keeps its buffers equal ("mean")
    strategy = rp.MirroredStrategy()
    with strategy.scope():
        torch.manual_seed(0)
        model = BatchNormCNN()
    _train(model, STEPS, rank)
    out["scope"] = _stats(model)
    return out


def _avg(a: list[float], b: list[float]) -> list[float]:
    return [(x + y) / 2 for x, y in zip(a, b)]


@pytest.mark.timeout(120)
def test_buffer_sync_modes_keep_running_statistics_equal_or_not():
    a, b = run_distributed(_buffer_modes, world_size=2, args=(0,), timeout_seconds=20)
    # "none": each replica keeps its own statistics (the drift this fixes)
    assert a["none"]["mean"] != pytest.approx(b["none"]["mean"], abs=1e-3)
    for mode in ("mean", "broadcast", "scope"):
        assert a[mode] == b[mode], mode  # bit-identical on both ranks
    # "mean" is the average of what the replicas computed (one step from equal starts)
    assert a["mean_1"]["mean"] == pytest.approx(_avg(a["none_1"]["mean"], b["none_1"]["mean"]),
                                                abs=1e-6)
    assert a["mean_1"]["var"] == pytest.approx(_avg(a["none_1"]["var"], b["none_1"]["var"]),
                                               abs=1e-6)
    # "broadcast" is replica 0's own statistics
    assert a["broadcast_1"] == a["none_1"]
    assert a["mean"]["count"] == a["broadcast"]["count"] == STEPS
    # the strategy's default is "mean"
    assert a["scope"]["mean"] == pytest.approx(a["mean"]["mean"], abs=1e-5)
    for mode in ("none", "mean", "broadcast"):
        removed_a, removed_b = a[f"{mode}_removed"], b[f"{mode}_removed"]
        assert removed_a["grad"] != pytest.approx(removed_b["grad"], abs=1e-6), mode
        assert removed_a["mean"] != pytest.approx(removed_b["mean"], abs=1e-6), mode
