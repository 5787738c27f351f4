"""The exact-data split of live recovery: each step's global batch is shared by the groups of
its quorum, every sample once, each group's weight its share; a redone step (another quorum)
trains the same samples; group ranks get equal counts."""

from __future__ import annotations

import pytest

from replicator.data.batching import global_order
from replicator.data.live_split import StepSplit


@pytest.mark.parametrize("group_size", [1, 2])
@pytest.mark.parametrize("participants", [1, 2, 3])
def test_every_sample_of_a_step_once_whatever_the_quorum(group_size, participants):
    split = StepSplit(100, 24, shuffle=True, seed=3, drop_remainder=False,
                      group_size=group_size, max_groups=3)
    assert split.steps_per_epoch == 5
    for step in range(12):
        expected = split.global_indices(step)
        taken, weight = [], 0.0
        for p in range(participants):
            counts = set()
            for r in range(group_size):
                share = split.share(step, p, participants, r)
                taken += share.indices
                counts.add(len(share.indices))
            weight += share.group_weight
            assert len(counts) == 1  # every rank of a group holds the same count
        assert sorted(taken) == sorted(expected)
        assert weight == pytest.approx(1.0)


def test_global_batches_follow_the_one_device_order():
    split = StepSplit(50, 10, shuffle=True, seed=7, drop_remainder=True)
    for epoch in range(3):
        order = global_order(50, True, 7, epoch)
        for i in range(5):
            assert split.global_indices(epoch * 5 + i) == order[i * 10:(i + 1) * 10]


def test_split_errors_name_the_fix():
    with pytest.raises(ValueError, match="not divisible by the 2 processes"):
        StepSplit(100, 25, shuffle=False, seed=0, drop_remainder=True, group_size=2)
    with pytest.raises(ValueError, match="some group would train on nothing"):
        StepSplit(100, 2, shuffle=False, seed=0, drop_remainder=True, max_groups=3)
    with pytest.raises(ValueError, match="drop_remainder=True"):
        StepSplit(101, 10, shuffle=False, seed=0, drop_remainder=False, group_size=2)


def test_epochs_loop_without_replica_groups_runs_every_epoch_once():
    import torch
    from torch.utils.data import TensorDataset

    import replicator as rp

    strategy = rp.OneDeviceStrategy("cpu")
    data = TensorDataset(torch.arange(20).float())
    counted = strategy.distribute_dataset(data, batch_size=5, shuffle=True, epochs=3)
    assert len(counted) == 12
    seen = [b[0].tolist() for b in counted]
    by_hand = strategy.distribute_dataset(data, batch_size=5, shuffle=True)
    expected = [b[0].tolist() for _ in range(3) for b in by_hand]
    assert seen == expected and len(seen) == 12
    for epoch in range(3):  # each epoch holds every sample once
        assert sorted(sum(seen[epoch * 4:(epoch + 1) * 4], [])) == list(map(float, range(20)))
    with pytest.raises(ValueError, match="epochs must be a positive integer"):
        strategy.distribute_dataset(data, batch_size=5, epochs=0)
