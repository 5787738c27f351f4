"""Mirrored on 2 replicas equals one device with the same global batch (real gloo processes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import replicator as rp
from replicator.testing import assert_equivalent, assert_params_close, run_distributed
from tests.helpers import image_data, make_cnn, make_mlp, regression_data

STEPS = 20
GLOBAL_BATCH = 32


def _train(strategy: rp.Strategy, model_fn, data, optimizer_name: str) -> dict:
    with strategy.scope():
        model = model_fn()
        if optimizer_name == "sgd":
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        else:
            optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    def step(batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    loader = DataLoader(data, batch_size=GLOBAL_BATCH, shuffle=True)
    it = iter(strategy.distribute_dataset(loader, seed=3))
    for _ in range(STEPS):
        strategy.run(step, args=(next(it),))
    return model.state_dict()


def train_four_configs(strategy: rp.Strategy) -> dict:
    """MLP and CNN, each with SGD (momentum) and Adam."""
    out = {}
    for model_name, model_fn, data in (("mlp", make_mlp, regression_data()),
                                       ("cnn", make_cnn, image_data())):
        for opt in ("sgd", "adam"):
            for k, v in _train(strategy, model_fn, data, opt).items():
                out[f"{model_name}_{opt}.{k}"] = v.clone()
    return out


@pytest.mark.timeout(120)
def test_mirrored_equals_one_device_mlp_cnn_sgd_adam():
    results = assert_equivalent(train_four_configs, strategies=["one_device", "mirrored"],
                                world_size=2, atol=1e-5)
    assert len(results["mirrored"]) == 24  # 3 linear layers x2 + 3 cnn layers x2, per config
    initial = make_mlp().state_dict()
    trained = {k.split(".", 1)[1]: v for k, v in results["one_device"].items()
               if k.startswith("mlp_sgd.")}
    assert any(not torch.equal(trained[k], initial[k]) for k in initial), "training moved nothing"


def _train_and_report(_: int) -> dict:
    strategy = rp.MirroredStrategy()
    state = train_four_configs(strategy)
    return {"rank": strategy.replica_id, "state": state}


@pytest.mark.timeout(120)
def test_replicas_hold_identical_parameters_after_training():
    a, b = run_distributed(_train_and_report, world_size=2, args=(0,))
    assert (a["rank"], b["rank"]) == (0, 1)
    assert_params_close(a["state"], b["state"], atol=0.0)


def _initial_params_synced(_: int) -> list:
    strategy = rp.MirroredStrategy()
    with strategy.scope():
        torch.manual_seed(100 + strategy.replica_id)  # different on purpose
        model = torch.nn.Linear(4, 4)
        torch.nn.init.normal_(model.weight)
    return [model.weight.detach().clone(), model.bias.detach().clone()]


@pytest.mark.timeout(60)
def test_scope_broadcasts_initial_parameters_from_replica_0():
    a, b = run_distributed(_initial_params_synced, world_size=2, args=(0,))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _distribute_model_outside_scope(_: int) -> list:
    strategy = rp.MirroredStrategy()
    torch.manual_seed(strategy.replica_id)
    model = strategy.distribute_model(torch.nn.Linear(3, 1))
    x = torch.full((2, 3), float(strategy.replica_id + 1))
    model(x).sum().backward()
    return [model.weight.grad.clone()]


@pytest.mark.timeout(60)
def test_distribute_model_averages_gradients():
    a, b = run_distributed(_distribute_model_outside_scope, world_size=2, args=(0,))
    # d(sum(Wx))/dW = sum of rows of x: rank 0 -> 2*1, rank 1 -> 2*2; mean 3 in every entry
    assert torch.allclose(a[0], torch.full((1, 3), 3.0)) and torch.equal(a[0], b[0])


def _uneven_local_batches(_: int) -> list:
    strategy = rp.MirroredStrategy()
    with strategy.scope():
        model = torch.nn.Linear(2, 1, bias=False)
        torch.nn.init.ones_(model.weight)
    # rank 0 has 1 example, rank 1 has 3: the global batch is 4
    x = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    local = x[:1] if strategy.replica_id == 0 else x[1:]
    per_example = model(local).squeeze(1) ** 2
    loss = rp.compute_average_loss(per_example)
    loss.backward()
    return [model.weight.grad.clone(), strategy.reduce("sum", loss)]


@pytest.mark.timeout(60)
def test_compute_average_loss_is_exact_for_uneven_batches():
    a, b = run_distributed(_uneven_local_batches, world_size=2, args=(0,))
    w = torch.ones(1, 2, requires_grad=True)
    x = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    ref = ((x @ w.t()).squeeze(1) ** 2).mean()
    ref.backward()
    assert torch.allclose(a[0], w.grad) and torch.allclose(b[0], w.grad)
    assert torch.allclose(a[1], ref.detach()) and torch.allclose(b[1], ref.detach())


def _accumulate_with_no_sync(_: int) -> list:
    strategy = rp.MirroredStrategy()
    with strategy.scope():
        model = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.ones_(model.weight)
    r = float(strategy.replica_id + 1)
    with strategy.no_sync():
        model(torch.tensor([[r]])).sum().backward()   # local only: grad r
    model(torch.tensor([[10 * r]])).sum().backward()  # synced: mean of (r + 10r) over ranks
    return [model.weight.grad.clone()]


@pytest.mark.timeout(60)
def test_no_sync_accumulates_then_averages_once():
    a, b = run_distributed(_accumulate_with_no_sync, world_size=2, args=(0,))
    assert torch.allclose(a[0], torch.tensor([[16.5]])) and torch.equal(a[0], b[0])
