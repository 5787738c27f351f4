"""``memory_report()`` on every strategy: OneDevice, Mirrored and CentralStorage here (the mesh
strategies' reports are tested with pipeline, tensor and FSDP training)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import replicator as rp
from replicator.testing import run_distributed

PARAMS = (16 * 32 + 32) + (32 * 4 + 4)  # the model below, float32


def _train(strategy: rp.Strategy) -> dict:
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    before = strategy.memory_report()

    def step() -> torch.Tensor:
        loss = F.mse_loss(model(torch.randn(8, 16)), torch.zeros(8, 4))
        loss.backward()
        optimizer.step()
        return loss.detach()

    for _ in range(2):
        strategy.run(step)
    after = strategy.memory_report()
    return {"before": before.as_dict(), "after": after.as_dict(), "text": str(after),
            "all": [r.as_dict() for r in strategy.memory_reports()]}


def _check(report: dict, rank: int, optimizer_state: bool) -> None:
    assert report["rank"] == rank
    assert report["parameter_bytes"] == 4 * PARAMS
    assert report["gradient_bytes"] == 4 * PARAMS
    # Adam: two moments per parameter plus a step count per tensor
    expected = 2 * 4 * PARAMS + 4 * 4 if optimizer_state else 0
    assert report["optimizer_state_bytes"] == expected
    assert report["peak_activation_bytes"] > 8 * 32 * 4  # at least the hidden layer's output


def test_one_device_report():
    out = _train(rp.OneDeviceStrategy("cpu"))
    assert out["before"]["optimizer_state_bytes"] == 0
    assert out["before"]["peak_activation_bytes"] == 0
    _check(out["after"], 0, True)
    assert out["all"] == [out["after"]]
    assert out["text"].startswith("rank 0: parameters ")


def _replicated(kind: str) -> dict:
    cls = {"mirrored": rp.MirroredStrategy, "central": rp.CentralStorageStrategy}[kind]
    return _train(cls())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["mirrored", "central"])
def test_replicated_reports(kind):
    results = run_distributed(_replicated, 2, args=(kind,))
    for rank, out in enumerate(results):
        # central storage: the optimizer state lives on replica 0 only
        _check(out["after"], rank, optimizer_state=kind == "mirrored" or rank == 0)
        assert [r["rank"] for r in out["all"]] == [0, 1]
        assert out["all"][rank] == out["after"]
