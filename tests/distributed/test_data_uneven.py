"""Replicas whose inputs end at different steps stop together (or pad), and never hang."""

from __future__ import annotations

import pytest

import replicator as rp
from replicator.data import InputOptions
from replicator.testing import run_distributed
from tests.data_helpers import batch_ids, id_batches


def uneven_worker() -> dict:
    strategy = rp.MirroredStrategy()
    rank = strategy.replica_id
    n = 10 if rank == 0 else 7  # rank 1 has 3 fewer batches
    out: dict = {}
    for drop in (True, False):
        for prefetch in (0, 2, 5):
            dist = strategy.distribute_datasets_from_function(
                lambda ctx: id_batches(n, 4, start=100 * rank), drop_remainder=drop,
                options=InputOptions(prefetch=prefetch))
            out[(drop, prefetch)] = [[(batch_ids(b), dist.mask.tolist()) for b in dist]
                                     for _ in range(2)]
    # an empty shard is reported on every rank, naming the rank
    try:
        empty = strategy.distribute_datasets_from_function(
            lambda ctx: id_batches(5 if rank == 0 else 0, 4))
        list(empty)
        out["empty"] = "no error"
    except rp.data.EmptyShardError as exc:
        out["empty"] = str(exc)
    return out


@pytest.mark.timeout(120)
def test_one_rank_with_fewer_batches_ends_the_epoch_on_both() -> None:
    ranks = run_distributed(uneven_worker, world_size=2)
    for prefetch in (0, 2, 5):
        for epoch in range(2):
            # drop: both stop after rank 1's 7 batches
            stopped = [ranks[r][(True, prefetch)][epoch] for r in range(2)]
            assert [len(s) for s in stopped] == [7, 7]
            assert [ids for ids, _ in stopped[0]] == [b[0].tolist() for b in id_batches(7, 4)]
            # pad: both run 10 steps; rank 1's last 3 are fully masked copies
            padded = [ranks[r][(False, prefetch)][epoch] for r in range(2)]
            assert [len(s) for s in padded] == [10, 10]
            assert all(mask == [1.0] * 4 for _, mask in padded[0])
            assert [sum(mask) for _, mask in padded[1]] == [4.0] * 7 + [0.0] * 3
            real = [i for ids, mask in padded[1] for i, m in zip(ids, mask) if m]
            assert real == list(range(100, 128))
            assert padded[1][-1][0] == padded[1][6][0][:1] * 4  # copies of a real sample
    for rank in range(2):
        assert "shard of rank 1 has fewer samples than one per-replica batch" in \
            ranks[rank]["empty"]


def leaves_early_worker() -> str:
    strategy = rp.MirroredStrategy()
    dist = strategy.distribute_datasets_from_function(lambda ctx: id_batches(6, 4),
                                                      options=InputOptions(prefetch=0))
    batches = iter(dist)
    next(batches)
    if strategy.replica_id == 1:
        return "left after one step"  # a bug in a training loop: rank 1 stops iterating
    try:
        for _ in batches:
            pass
    except rp.ReplicatorError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(60)
def test_a_rank_that_stops_iterating_gives_an_error_not_a_hang() -> None:
    ranks = run_distributed(leaves_early_worker, world_size=2, timeout_seconds=20)
    assert ranks[1] == "left after one step"
    assert "rank 0" in ranks[0] and "end-of-data agreement" in ranks[0]
    assert "HINT" in ranks[0]
