"""ParameterServerStrategy with staleness=0 equals one device with the same global batch, as
Mirrored does (real processes; variables on real parameter-server processes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import replicator as rp
from replicator.cluster import launch
from replicator.testing import assert_params_close
from tests.helpers import make_mlp, regression_data

STEPS = 20
GLOBAL_BATCH = 32


def train(kind: str, num_ps: int = 1, shards: int = 0, momentum: float = 0.0) -> dict:
    """20 SGD steps of the MLP under ``kind``; returns the parameters and what the strategy
    measured (optimizer state held by the worker, shard versions, placement)."""
    if kind == "ps":
        part = rp.partitioners.MinSizePartitioner(min_shard_bytes=512, max_shards=shards) \
            if shards else None
        strategy: rp.Strategy = rp.ParameterServerStrategy(num_ps=num_ps, staleness=0,
                                                           variable_partitioner=part)
    else:
        strategy = rp.OneDeviceStrategy("cpu")
    with strategy.scope():
        model = make_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)

    def step(batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return strategy.reduce("mean", loss.detach())

    loader = DataLoader(regression_data(), batch_size=GLOBAL_BATCH, shuffle=True)
    it = iter(strategy.distribute_dataset(loader, seed=3))
    losses = [float(strategy.run(step, args=(next(it),))) for _ in range(STEPS)]
    out = {"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
           "losses": losses, "worker_optimizer_state": len(optimizer.state)}
    if isinstance(strategy, rp.ParameterServerStrategy):
        out["versions"] = strategy.shard_versions()
        out["placement"] = strategy.placement()
        out["stats"] = strategy.staleness_stats()
    return out


@pytest.mark.timeout(120)
def test_one_worker_one_server_sync_equals_one_device():
    ref = train("one_device")
    out = launch(train, num_replicas=2, num_ps=1, args=("ps",), timeout_seconds=60)
    assert out[1] is None  # the server's process returns nothing
    assert_params_close(ref["params"], out[0]["params"], atol=1e-6)
    assert ref["losses"][-1] < ref["losses"][0]
    assert out[0]["worker_optimizer_state"] == 0  # the server owns the optimizer state
    assert all(v["version"] == STEPS for v in out[0]["versions"])


@pytest.mark.timeout(180)
def test_two_workers_sync_equal_global_batch_with_one_and_two_servers():
    # Mirrored on 2 replicas equals one device with the same global batch
    # (test_equivalence.py); staleness=0 on 2 workers is held to the same reference.
    ref = train("one_device", momentum=0.9)
    one = launch(train, num_replicas=3, num_ps=1, args=("ps",), kwargs={"momentum": 0.9},
                 timeout_seconds=60)
    assert_params_close(ref["params"], one[0]["params"], atol=1e-5)
    assert_params_close(one[0]["params"], one[1]["params"], atol=0.0)  # workers agree
    assert one[0]["losses"] == pytest.approx(ref["losses"], abs=1e-5)  # reduce() over workers
    two = launch(train, num_replicas=4, num_ps=2, args=("ps",),
                 kwargs={"momentum": 0.9, "shards": 2, "num_ps": 2}, timeout_seconds=60)
    assert_params_close(ref["params"], two[0]["params"], atol=1e-5)
    split = [p for p in two[0]["placement"] if p["shards"] == 2]
    assert split, "the partitioner split no weight"
    assert {p["server"] for p in split if p["name"] == split[0]["name"]} == {0, 1}
    assert two[0]["worker_optimizer_state"] == 0
    assert all(v["version"] == STEPS for v in two[0]["versions"])
    assert two[0]["stats"]["max"] == 0 and two[0]["stats"]["count"] > 0
