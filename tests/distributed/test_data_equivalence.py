"""Same seed, 1 vs 2 replicas: the same global batches (sample ids), step by step."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader

import replicator as rp
from replicator.data import InputOptions
from replicator.testing import run_distributed
from tests.data_helpers import IdDataset, IdStream, take_steps

STEPS = 40  # 2.5 epochs of 1,000 samples in global batches of 64


def build(strategy: rp.Strategy, name: str) -> rp.data.DistributedDataset:
    if name == "loader":
        return strategy.distribute_dataset(DataLoader(IdDataset(1000), batch_size=64,
                                                      shuffle=True), seed=3)
    if name == "stream":
        return strategy.distribute_dataset(IdStream(1000), batch_size=64, shuffle=True, seed=3,
                                           options=InputOptions(shuffle_buffer=300))
    if name == "off-drop":
        return strategy.distribute_dataset(IdDataset(1000), batch_size=64, shuffle=True, seed=3,
                                           drop_remainder=True,
                                           options=InputOptions(shard_policy="off"))
    return strategy.distribute_dataset(IdDataset(1000), batch_size=64, shuffle=True, seed=3,
                                       options=InputOptions(num_workers=2, worker_type="thread"))


NAMES = ("map", "loader", "stream", "off-drop")


def two_replica_worker() -> dict[str, list[list[int]]]:
    strategy = rp.MirroredStrategy()
    return {name: take_steps(build(strategy, name), STEPS) for name in NAMES}


@pytest.mark.timeout(120)
def test_one_and_two_replicas_see_the_same_global_batches() -> None:
    one = rp.OneDeviceStrategy("cpu")
    reference = {name: take_steps(build(one, name), STEPS) for name in NAMES}
    ranks = run_distributed(two_replica_worker, world_size=2)
    for name in NAMES:
        assert len(ranks[0][name]) == len(ranks[1][name]) == STEPS
        for step, (a, b) in enumerate(zip(ranks[0][name], ranks[1][name])):
            assert len(a) == len(b), f"{name} step {step}: uneven split of a full batch"
            assert a + b == reference[name][step], f"{name}: global batch {step} differs"
