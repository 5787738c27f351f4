"""``check_finite=True``: a NaN returned by ``strategy.run`` on one replica stops every replica
at the same step, naming the step and the rank (real processes)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import replicator as rp
from replicator.testing import run_distributed


def _loop(kind: str, check: bool) -> str:
    cls = {"mirrored": rp.MirroredStrategy, "central": rp.CentralStorageStrategy}[kind]
    strategy = cls(check_finite=check)
    with strategy.scope():
        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(i: int) -> dict:
        x = torch.randn(8, 4)
        if i == 3 and strategy.replica_id == 1:
            x[0, 0] = float("nan")  # one bad sample on replica 1 only
        loss = F.mse_loss(model(x), torch.zeros(8, 1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return {"loss": loss.detach(), "seen": torch.tensor(i)}

    done = 0
    try:
        for i in range(1, 6):
            out = strategy.run(step, args=(i,))
            strategy.reduce("mean", out)  # the loop goes on: no replica may be left waiting
            done = i
    except rp.errors.NonFiniteLossError as exc:
        return f"stopped after {done}: {exc}"
    return f"finished {done}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["mirrored", "central"])
def test_nan_on_one_replica_stops_all_at_that_step(kind):
    for text in run_distributed(_loop, 2, args=(kind, True)):
        assert text.startswith("stopped after 2: strategy.run step 3:"), text
        assert "rank(s) 1" in text and "check_finite=True" in text


@pytest.mark.timeout(120)
def test_off_by_default():
    assert run_distributed(_loop, 2, args=("mirrored", False)) == ["finished 5"] * 2


def test_one_device_and_every_constructor():
    strategy = rp.OneDeviceStrategy("cpu", check_finite=True)
    assert strategy.run(lambda: (1.0, torch.tensor([2.0]), "text", 3))[0] == 1.0
    with pytest.raises(rp.errors.NonFiniteLossError, match=r"step 2: .*rank\(s\) 0 \(here: inf"):
        strategy.run(lambda: {"loss": torch.tensor(float("inf"))})
    for cls in (rp.OneDeviceStrategy, rp.MirroredStrategy, rp.MultiWorkerMirroredStrategy,
                rp.CentralStorageStrategy, rp.MeshStrategy, rp.FSDPStrategy,
                rp.TensorParallelStrategy, rp.PipelineStrategy, rp.ParameterServerStrategy):
        assert "check_finite" in inspect.signature(cls).parameters, cls
