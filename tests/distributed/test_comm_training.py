"""Mirrored training with each all-reduce algorithm (and central storage) equals one device.

One launch per world size trains every configuration in the same worker processes; the
one-device reference runs in the test process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

import replicator as rp
from replicator.comm import (
    CommunicationOptions,
    Compression,
    HierarchicalAllReduce,
    NativeAllReduce,
    ReductionToOneDevice,
    RingAllReduce,
    SharedMemoryAllReduce,
)
from replicator.strategies import CentralStorageStrategy
from replicator.strategies.memory import optimizer_state_bytes
from replicator.testing import assert_params_close, run_distributed
from tests.helpers import regression_data

STEPS = 20
GLOBAL_BATCH = 24  # divisible by 2 and 3: equal local batches make local means exact
EXACT_ATOL = 1e-5
#: Documented tolerances of the compressed variants after 20 steps (max |param diff|).
COMPRESSED_ATOL = {"fp16": 1e-3, "bf16": 5e-3, "powersgd": 5e-2}


def make_wide_mlp(seed: int = 1) -> nn.Module:
    """About 1.1 MB of parameters: several gradient buckets with a small bytes_per_pack."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 256), nn.ReLU(), nn.Linear(256, 1024), nn.ReLU(),
                         nn.Linear(1024, 3))


def train(strategy: rp.Strategy, optimizer_name: str = "sgd") -> dict:
    with strategy.scope():
        model = make_wide_mlp()
        if optimizer_name == "sgd":
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        else:
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    loader = DataLoader(regression_data(), batch_size=GLOBAL_BATCH, shuffle=True)
    it = iter(strategy.distribute_dataset(loader, seed=3))
    losses = [float(strategy.reduce("mean", strategy.run(step, args=(next(it),))))
              for _ in range(STEPS)]
    out = {"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
           "losses": losses, "state_bytes": optimizer_state_bytes([optimizer])}
    # the model's synchronizer lives as long as the model: look at it while the model exists
    syncs = strategy._replica_group.synchronizers
    out["buckets"] = len(syncs[0].buckets) if syncs else 0
    algo = getattr(strategy, "cross_device_ops", None)
    if isinstance(algo, SharedMemoryAllReduce):  # buckets made in shared memory
        out["resident"] = all(algo._resident_for(b.buffer, None) is not None
                              for b in syncs[0].buckets)
    return out


def _configs(world: int) -> dict:
    small = CommunicationOptions(bytes_per_pack=64 * 1024)
    configs = {
        "native": lambda: rp.MirroredStrategy(),
        "ring": lambda: rp.MirroredStrategy(cross_device_ops=RingAllReduce(),
                                            communication_options=small),
        "implementation_ring": lambda: rp.MultiWorkerMirroredStrategy(
            CommunicationOptions(implementation="ring")),
        "hierarchical_2_per_node": lambda: rp.MirroredStrategy(
            cross_device_ops=HierarchicalAllReduce(ranks_per_node=2)),
        "reduce_to_one": lambda: rp.MirroredStrategy(cross_device_ops=ReductionToOneDevice()),
        "shared_memory": lambda: rp.MirroredStrategy(cross_device_ops=SharedMemoryAllReduce(),
                                                     communication_options=small),
        "central_storage_sgd": lambda: CentralStorageStrategy(),
        "central_storage_adam": lambda: CentralStorageStrategy(communication_options=small),
    }
    if world == 2:
        configs.update({
            "fp16": lambda: rp.MirroredStrategy(
                cross_device_ops=NativeAllReduce(compression=Compression.fp16())),
            "bf16": lambda: rp.MirroredStrategy(
                cross_device_ops=RingAllReduce(compression=Compression.bf16(error_feedback=True))),
            "powersgd": lambda: rp.MirroredStrategy(
                cross_device_ops=SharedMemoryAllReduce(
                    compression=Compression.powersgd(rank=2)),
                communication_options=small),
        })
    return configs


def _train_everything(_: int) -> dict:
    world = rp.MirroredStrategy().num_replicas_in_sync
    out = {}
    for name, make in _configs(world).items():
        strategy = make()
        out[name] = train(strategy, "adam" if name.endswith("adam") else "sgd")
    return out


@pytest.fixture(scope="module")
def references() -> dict:
    return {opt: train(rp.OneDeviceStrategy("cpu"), opt) for opt in ("sgd", "adam")}


def _check_world(world: int, references: dict) -> None:
    results = run_distributed(_train_everything, world_size=world, args=(0,),
                              timeout_seconds=60)
    for name, out in results[0].items():
        ref = references["adam" if name.endswith("adam") else "sgd"]
        kind = next((k for k in COMPRESSED_ATOL if name.startswith(k)), None)
        atol = COMPRESSED_ATOL[kind] if kind else EXACT_ATOL
        assert_params_close(ref["params"], out["params"], atol=atol, label=f"{name}: ")
        for other in results[1:]:  # every replica holds the same parameters
            assert_params_close(out["params"], other[name]["params"], atol=0.0,
                                label=f"{name} replicas: ")
        first, last = sum(out["losses"][:3]) / 3, sum(out["losses"][-3:]) / 3
        assert last < 0.8 * first, f"{name}: loss did not fall ({first:.3f} -> {last:.3f})"
    assert results[0]["ring"]["buckets"] > 1 and results[0]["shared_memory"]["buckets"] > 1
    assert all(r["shared_memory"]["resident"] for r in results)
    for name in ("central_storage_sgd", "central_storage_adam"):
        assert results[0][name]["state_bytes"] > 0
        assert all(r[name]["state_bytes"] == 0 for r in results[1:]), \
            [r[name]["state_bytes"] for r in results]
    assert results[0]["native"]["state_bytes"] == results[1]["native"]["state_bytes"] > 0


@pytest.mark.timeout(150)
def test_every_algorithm_trains_like_one_device_on_two_replicas(references):
    _check_world(2, references)


@pytest.mark.timeout(150)
def test_every_algorithm_trains_like_one_device_on_three_replicas(references):
    _check_world(3, references)
