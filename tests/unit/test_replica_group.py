"""The replica-group core in one process: the public methods every strategy has, and the
gradient engine's ``no_sync`` switch (synchronizers made inside the block start off)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import replicator as rp
from replicator.strategies.replicas import ReplicaGroup


def test_one_device_has_a_single_rank_core_and_the_public_methods():
    strategy = rp.OneDeviceStrategy("cpu")
    coll = strategy.collectives
    assert (coll.rank, coll.world_size) == (0, 1)
    assert strategy.shards_model is False
    assert strategy.reduce("mean", torch.tensor([1, 3])).tolist() == [1.0, 3.0]
    assert strategy.gather(torch.tensor(2.0)).tolist() == [2.0]
    strategy.barrier()
    with strategy.scope():
        model = nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy.prepare_optimizers(optimizer)  # nothing to do: the parameters stay
    assert optimizer.param_groups[0]["params"][0] is model.weight
    with pytest.raises(TypeError, match="prepare_optimizers takes torch optimizers"):
        strategy.prepare_optimizers(model)  # type: ignore[arg-type]
    strategy.close()


def test_an_axis_needs_its_topology():
    with pytest.raises(ValueError, match="needs the topology"):
        ReplicaGroup(torch.device("cpu"), axis="data")


def test_no_sync_switches_every_synchronizer_off_including_ones_made_inside():
    group = ReplicaGroup.single(torch.device("cpu"))
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    a = group.synchronize_gradients(first, list(first.parameters()))
    assert a is not None and a.enabled
    assert group.synchronize_gradients(first, []) is None
    with group.no_sync():
        assert not a.enabled
        b = group.synchronize_gradients(second, list(second.parameters()), automatic=False)
        assert b is not None and not b.enabled
        with group.no_sync():
            pass
        assert not a.enabled and not b.enabled  # the outer block still holds
    assert a.enabled and b.enabled
    assert group.synchronizers == [a, b]
    group.close()
    assert group.synchronizers == [] and not a.enabled
