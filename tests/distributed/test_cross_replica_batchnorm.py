"""``sync_batchnorm=True``: a BatchNorm model under Mirrored equals one device exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

import replicator as rp
from replicator.testing import assert_params_close, run_distributed
from tests.helpers import image_data


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 6, 3, padding=1, bias=False)  # BN follows: a bias has no
        # gradient there, and Adam would turn its rounding noise into full steps
        self.bn2d = nn.BatchNorm2d(6)
        self.fc = nn.Linear(6 * 4 * 4, 16, bias=False)
        self.bn1d = nn.BatchNorm1d(16, momentum=None)  # cumulative average
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.bn2d(self.conv(x))), 2)
        return self.head(torch.relu(self.bn1d(self.fc(x.flatten(1)))))


def train(name: str, steps: int = 10) -> dict:
    strategy = rp.get_strategy(name, sync_batchnorm=True) if name != "one_device" else \
        rp.OneDeviceStrategy("cpu")
    with strategy.scope():
        torch.manual_seed(0)
        model = BNNet()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    def step(batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    loader = DataLoader(image_data(), batch_size=32, shuffle=True)
    it = iter(strategy.distribute_dataset(loader, seed=1))
    for _ in range(steps):
        strategy.run(step, args=(next(it),))
    model.eval()
    probe = image_data(n=16, seed=9).tensors[0]
    out = {k: v.clone() for k, v in model.state_dict().items()}
    out["eval_output"] = model(probe).detach()
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["mirrored", "central_storage"])
def test_sync_batchnorm_equals_one_device(name):
    ref = train("one_device")
    a, b = run_distributed(train, 2, args=(name,))
    assert_params_close(ref, a, atol=1e-5)
    assert_params_close(a, b, atol=0)
    assert "bn2d.running_var" in a and not torch.allclose(a["bn2d.running_var"],
                                                           torch.ones(6))
