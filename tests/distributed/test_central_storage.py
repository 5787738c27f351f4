"""CentralStorageStrategy: gradients reduced to replica 0, one optimizer step there, parameters
broadcast, and no optimizer state anywhere else."""

from __future__ import annotations

import pytest
import torch

import replicator as rp
from replicator.errors import ReplicatorError
from replicator.strategies import CentralStorageStrategy
from replicator.strategies.memory import optimizer_state_bytes
from replicator.testing import run_distributed


def _central_semantics(_: int) -> dict:
    strategy = rp.get_strategy("central_storage")
    assert isinstance(strategy, CentralStorageStrategy)
    r = strategy.replica_id
    with strategy.scope():
        model = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.ones_(model.weight)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.tensor([[float(r + 1)]])           # d(w x)/dw = x: local grads 1 and 2
    model(x).sum().backward()
    grad_after_backward = float(model.weight.grad)
    sgd.step()
    weight_after_step = float(model.weight)
    grad_after_step = float(model.weight.grad)   # the optimizer hid it only for the step
    sgd.zero_grad()

    with strategy.scope():
        big = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        adam = torch.optim.Adam(big.parameters(), lr=1e-3)
    for _ in range(3):
        big(torch.randn(4, 64)).square().mean().backward()
        adam.step()
        adam.zero_grad()
    same = [p.detach().clone() for p in big.parameters()]

    outside = torch.nn.Linear(2, 2)
    mixed = torch.optim.SGD([*model.parameters(), *outside.parameters()], lr=0.1)
    model(x).sum().backward()
    try:
        mixed.step()
        mixed_error = ""
    except ReplicatorError as exc:
        mixed_error = str(exc)
    try:
        sgd.step(lambda: torch.zeros(()))
        closure_error = ""
    except ReplicatorError as exc:
        closure_error = str(exc)
    return {"rank": r, "grad_after_backward": grad_after_backward, "closure_error": closure_error,
            "grad_after_step": grad_after_step, "weight_after_step": weight_after_step,
            "sgd_state": optimizer_state_bytes([sgd]), "adam_state": optimizer_state_bytes([adam]),
            "params": same, "mixed_error": mixed_error,
            "param_bytes": sum(p.numel() * p.element_size() for p in big.parameters())}


@pytest.mark.timeout(60)
def test_central_storage_reduces_steps_once_and_broadcasts():
    a, b = run_distributed(_central_semantics, world_size=2, args=(0,))
    assert a["grad_after_backward"] == pytest.approx(1.5)        # the average, on replica 0
    assert b["grad_after_backward"] == pytest.approx(2.0)        # the local gradient elsewhere
    assert b["grad_after_step"] == pytest.approx(2.0)
    assert a["weight_after_step"] == pytest.approx(1 - 0.1 * 1.5)
    assert b["weight_after_step"] == a["weight_after_step"]      # broadcast from replica 0
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y)
    # optimizer state: all on replica 0, none on replica 1
    assert a["sgd_state"] == 4                                   # one float32 momentum
    assert a["adam_state"] >= 2 * a["param_bytes"]               # exp_avg + exp_avg_sq (+ steps)
    assert b["sgd_state"] == 0 and b["adam_state"] == 0
    for r in (a, b):
        assert "created outside" in r["mixed_error"] and "scope()" in r["mixed_error"]
        assert "closure" in r["closure_error"]
