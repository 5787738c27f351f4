"""FILE sharding at the plan level: disjoint shards, and exact resume on another world size."""

from __future__ import annotations

import pytest

from replicator.data import FileDataset, shard
from replicator.data.sharding import FileShardPlan
from tests.data_helpers import read_id_file, write_id_files

SIZES = [150, 50, 100, 120, 80, 100, 90, 110, 100, 100]


def plan(files: FileDataset, rank: int, world: int, batch: int = 64) -> FileShardPlan:
    return FileShardPlan(files, batch, rank, world, shuffle=True, seed=11, shuffle_buffer=64,
                         drop_remainder=False, pad_last_batch=False)


def real_ids(specs) -> list[int]:
    return [item[0] for spec in specs for item in spec.items[:spec.real]]


@pytest.fixture()
def files(tmp_path) -> FileDataset:
    return FileDataset(write_id_files(str(tmp_path), SIZES), read_id_file)


def test_shards_are_disjoint_and_cover_every_sample(files: FileDataset) -> None:
    for epoch in range(2):
        shards = [real_ids(plan(files, r, 3).specs(epoch, 0)) for r in range(3)]
        assert sorted(sum(shards, [])) == list(range(sum(SIZES)))
        assert len({len(s) for s in shards}) > 1  # uneven: the agreement has work to do
    one = real_ids(plan(files, 0, 3).specs(0, 0))
    assert one == real_ids(plan(files, 0, 3).specs(0, 0))      # deterministic
    assert one != real_ids(plan(files, 0, 3).specs(1, 0))      # reshuffled per epoch


def lockstep_consumed(plans: list[FileShardPlan], epoch: int, steps: int) -> list[int]:
    """What ``steps`` steps in lockstep consumed on every replica (a replica out of data pads)."""
    taken: list[int] = []
    for p in plans:
        specs = list(p.specs(epoch, 0))[:steps]
        taken += real_ids(specs)
    return taken


@pytest.mark.parametrize("old_world,new_world", [(2, 1), (2, 3), (3, 2), (1, 2)])
def test_restart_on_another_world_size_finishes_the_epoch_exactly_once(
        files: FileDataset, old_world: int, new_world: int) -> None:
    epoch, steps = 1, 2
    old = [plan(files, r, old_world, 60 * old_world) for r in range(old_world)]
    before = lockstep_consumed(old, epoch, steps)
    state = old[0].state(epoch, steps)
    assert state == {"phases": [[old_world, 60, steps]]}
    after = []
    for rank in range(new_world):
        p = plan(files, rank, new_world, 40 * new_world)
        position = p.load_state(state, epoch, steps)
        assert position == 0 and not p.fresh(epoch, position)
        after += real_ids(p.specs(epoch, position))
    assert sorted(before + after) == list(range(sum(SIZES)))


def test_two_restarts_chain_their_phases(files: FileDataset) -> None:
    epoch = 0
    first = [plan(files, r, 2, 64) for r in range(2)]
    before = lockstep_consumed(first, epoch, 3)
    state = first[0].state(epoch, 3)
    middle = []
    for rank in range(3):
        p = plan(files, rank, 3, 63)
        p.load_state(state, epoch, 3)
        middle += real_ids(list(p.specs(epoch, 0))[:2])
        if rank == 0:
            state2 = p.state(epoch, 2)
    assert state2["phases"] == [[2, 32, 3], [3, 21, 2]]
    rest = []
    for rank in range(2):
        p = plan(files, rank, 2, 64)
        p.load_state(state2, epoch, 2)
        rest += real_ids(p.specs(epoch, 0))
    assert sorted(before + middle + rest) == list(range(sum(SIZES)))


def test_same_world_continues_the_phase(files: FileDataset) -> None:
    p = plan(files, 1, 2)
    full = real_ids(p.specs(0, 0))
    assert p.load_state({"phases": [[2, 32, 4]]}, 0, 4) == 4
    assert p.fresh(0, 4) is False
    assert real_ids(p.specs(0, 4)) == full[4 * 32:]


def test_template_and_shard_helper(files: FileDataset) -> None:
    spec = plan(files, 0, 2).template_spec(0)
    assert spec is not None and spec.real == 0 and spec.size == 32
    assert shard(files, 3, 1).files == files.files[1::3]
    with pytest.raises(ValueError, match="10 files cannot give each of 11 shards one"):
        shard(files, 11, 0)
    with pytest.raises(TypeError, match="single path"):
        FileDataset(files.files[0], read_id_file)
