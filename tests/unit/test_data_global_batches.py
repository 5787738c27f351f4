"""Global-batch pipelines in one process: every replica's plan is run here side by side (these
plans need no collective: each replica finds the epoch's end by itself)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler

import replicator as rp
from replicator.data import AutoShardPolicy, InputContext, InputOptions, distribute_dataset
from replicator.data.batching import buffer_shuffle, derived_seed, global_order
from tests.data_helpers import (
    IdDataset,
    IdStream,
    batch_ids,
    double_x,
    read_id_file,
    take_steps,
    write_id_files,
)

CPU = torch.device("cpu")


def replica(data, rank: int, world: int, **kwargs):
    return distribute_dataset(data, InputContext(world, rank, world), CPU, **kwargs)


def epochs(data, world: int, n_epochs: int, **kwargs) -> list[list[list[list[int]]]]:
    """[rank][epoch][step] -> real ids."""
    out = []
    for rank in range(world):
        dist = replica(data, rank, world, **kwargs)
        out.append([[batch_ids(b, dist.mask) for b in dist] for _ in range(n_epochs)])
    return out


def global_steps(per_rank: list[list[list[int]]]) -> list[list[int]]:
    """Concatenate the replicas' parts of each step: the global batches of one epoch."""
    assert len({len(r) for r in per_rank}) == 1, "replicas ran different numbers of steps"
    return [sum(parts, []) for parts in zip(*per_rank)]


@pytest.mark.parametrize("policy", ["auto", "data", "off"])
@pytest.mark.parametrize("drop", [False, True])
def test_map_style_epochs_follow_the_seeded_order_exactly(policy: str, drop: bool) -> None:
    out = epochs(IdDataset(1000), 2, 3, batch_size=64, shuffle=True, seed=7,
                 drop_remainder=drop, options=InputOptions(shard_policy=policy))
    for e in range(3):
        steps = global_steps([out[0][e], out[1][e]])
        order = global_order(1000, True, 7, e)
        expected = order[:960] if drop else order  # 15 full batches + 40 left over
        assert sum(steps, []) == expected
        assert len(steps) == (15 if drop else 16)
    assert out[0][0] != out[0][1]  # reshuffled every epoch


@pytest.mark.parametrize("policy", ["data", "off"])
@pytest.mark.parametrize("drop", [False, True])
def test_streams_are_split_in_the_same_seeded_order_on_every_replica(policy: str,
                                                                      drop: bool) -> None:
    out = epochs(IdStream(1000), 2, 2, batch_size=64, shuffle=True, seed=3, drop_remainder=drop,
                 options=InputOptions(shard_policy=policy, shuffle_buffer=100))
    for e in range(2):
        order = list(buffer_shuffle(range(1000), 100, derived_seed(3, e)))
        assert sorted(order) == list(range(1000)) and order != list(range(1000))
        ids = sum(global_steps([out[0][e], out[1][e]]), [])
        assert ids == (order[:960] if drop else order)


def test_short_last_batch_gives_masked_copies_to_replicas_without_a_sample() -> None:
    data = IdDataset(9)
    parts = []
    for rank in range(4):
        dist = replica(data, rank, 4, batch_size=8)
        steps = [(b[0].tolist(), dist.mask.tolist()) for b in dist]
        parts.append(steps)
    assert [p[1] for p in parts] == [([8], [1.0]), ([8], [0.0]), ([8], [0.0]), ([8], [0.0])]
    padded = [[(b[0].tolist(), d.mask.tolist()) for b in d][-1] for d in
              (replica(data, r, 4, batch_size=8, options=InputOptions(pad_last_batch=True))
               for r in range(2))]
    assert padded == [([8, 8], [1.0, 0.0]), ([8, 8], [0.0, 0.0])]


def test_one_device_splits_the_last_batch_without_padding() -> None:
    dist = replica(IdDataset(10), 0, 1, batch_size=4)
    assert [b[0].tolist() for b in dist] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert dist.mask.tolist() == [1.0, 1.0]
    assert len(dist) == 3
    assert len(replica(IdDataset(10), 0, 1, batch_size=4, drop_remainder=True)) == 2


def test_transform_runs_per_sample_in_every_engine_with_the_same_result() -> None:
    results = []
    for options in (InputOptions(prefetch=0), InputOptions(num_workers=2, worker_type="thread"),
                    InputOptions(num_workers=2, worker_type="process", prefetch=3)):
        dist = replica(IdDataset(100), 1, 2, batch_size=16, shuffle=True, seed=1,
                       transform=double_x, options=options)
        results.append([(b[0].tolist(), b[1][:, 0].tolist()) for b in dist])
        dist.close()
    assert results[0] == results[1] == results[2]
    ids, xs = results[0][0]
    assert xs == [2.0 * i for i in ids]


def test_dataloader_settings_are_kept() -> None:
    loader = DataLoader(IdDataset(50), batch_size=10, shuffle=True, drop_last=True,
                        collate_fn=lambda samples: (torch.tensor([s[0] for s in samples]),))
    dist = replica(loader, 0, 2, seed=4)
    steps = [b[0].tolist() for b in dist]
    assert len(steps) == 5 and all(len(s) == 5 for s in steps)
    assert steps[0] == global_order(50, True, 4, 0)[:5]
    assert dist.state_dict()["shuffle"] is True


def test_custom_batch_sampler_falls_back_to_splitting_each_loaded_batch() -> None:
    sampler = BatchSampler(SequentialSampler(range(30)), batch_size=8, drop_last=False)
    loader = DataLoader(IdDataset(30), batch_sampler=sampler)
    out = epochs(loader, 2, 1, batch_size=8)
    assert sum(global_steps([out[0][0], out[1][0]]), []) == list(range(30))
    assert replica(loader, 0, 2, batch_size=8).shard_policy == "off"
    with pytest.raises(ValueError, match="AutoShardPolicy.OFF"):
        replica(loader, 0, 2, batch_size=8, options=InputOptions(shard_policy="data"))


def test_files_with_data_policy_are_read_by_every_replica(tmp_path) -> None:
    files = write_id_files(str(tmp_path), [30, 0, 70])
    with pytest.warns(UserWarning, match="sharding by DATA"):
        out = epochs(files, 4, 1, reader=read_id_file, batch_size=8, shuffle=True)
    ids = sum(global_steps([r[0] for r in out]), [])
    assert sorted(ids) == list(range(100))


def test_a_loop_left_early_continues_and_set_epoch_restarts() -> None:
    dist = replica(IdDataset(40), 0, 1, batch_size=4)
    first = []
    for batch in dist:
        first.append(batch[0].tolist())
        if len(first) == 3:
            break
    rest = [b[0].tolist() for b in dist]
    assert first + rest == [list(range(i, i + 4)) for i in range(0, 40, 4)]
    assert dist.epoch == 1
    dist.set_epoch(0)
    batches = iter(dist)
    assert next(batches)[0].tolist() == [0, 1, 2, 3]
    assert batches.state_dict() == dist.state_dict() and dist.state_dict()["position"] == 4


def test_state_round_trips_through_json_and_continues_exactly() -> None:
    kwargs = dict(batch_size=8, shuffle=True, seed=5,
                  options=InputOptions(num_workers=2, worker_type="thread", prefetch=4))
    ref = replica(IdDataset(100), 0, 1, **kwargs)
    take_steps(ref, 17)   # into the second epoch; prefetched batches are in flight
    state = json.loads(json.dumps(ref.state_dict()))
    assert state["epoch"] == 1 and state["position"] == 32
    expected = take_steps(ref, 20)
    again = replica(IdDataset(100), 0, 1, **kwargs)
    again.load_state_dict(state)
    assert take_steps(again, 20) == expected
    # two replicas continue the same global batches from the same state
    parts = []
    for rank in range(2):
        other = replica(IdDataset(100), rank, 2, **kwargs)
        other.load_state_dict(state)
        parts.append(take_steps(other, 20))
    assert [a + b for a, b in zip(*parts)] == expected


def test_a_new_batch_size_continues_from_the_same_sample() -> None:
    ref = replica(IdDataset(100), 0, 1, batch_size=10, shuffle=True, seed=2)
    take_steps(ref, 3)
    state = ref.state_dict()
    rest = sum(take_steps(ref, 7), [])
    smaller = replica(IdDataset(100), 0, 1, batch_size=5, shuffle=True, seed=2)
    smaller.load_state_dict(state)
    assert sum(take_steps(smaller, 14), []) == rest


def test_state_from_another_pipeline_or_setting_is_refused() -> None:
    dist = replica(IdDataset(20), 0, 1, batch_size=4, shuffle=True)
    state = dist.state_dict()
    with pytest.raises(ValueError, match="global_stream"):
        replica(IdStream(20), 0, 1, batch_size=4, shuffle=True).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle=True"):
        replica(IdDataset(20), 0, 1, batch_size=4).load_state_dict(state)
    with pytest.raises(ValueError, match="state_dict"):
        dist.load_state_dict({"epoch": 1})
    with pytest.warns(RuntimeWarning, match="seed 0"):
        replica(IdDataset(20), 0, 1, batch_size=4, shuffle=True, seed=9).load_state_dict(state)


def test_errors_say_what_is_wrong_and_how_to_fix_it(tmp_path) -> None:
    with pytest.raises(ValueError, match="not divisible by the 2 replicas.*HINT"):
        replica(IdDataset(20), 0, 2, batch_size=7)
    with pytest.raises(rp.data.EmptyShardError, match="3 samples for 4 replicas"):
        replica(IdDataset(3), 0, 4, batch_size=4)
    files = write_id_files(str(tmp_path), [5, 5])
    with pytest.raises(rp.data.EmptyShardError, match="2 files for 3 replicas"):
        replica(files, 0, 3, reader=read_id_file, batch_size=3,
                options=InputOptions(shard_policy=AutoShardPolicy.FILE))
    with pytest.raises(TypeError, match="needs a list of files"):
        replica(IdDataset(8), 0, 2, batch_size=4, options=InputOptions(shard_policy="file"))
    with pytest.raises(TypeError, match="reader=read_file"):
        replica(files, 0, 1, batch_size=4)
    with pytest.raises(ValueError, match="disagree"):
        replica(IdDataset(8), 0, 1, batch_size=4, drop_last=True, drop_remainder=False)
    with pytest.raises(TypeError, match="cannot be pickled.*module level"):
        replica(IdDataset(8), 0, 1, batch_size=4, transform=lambda s: s,
                options=InputOptions(num_workers=1, worker_start_method="spawn"))
    sharded = DataLoader(IdDataset(8), batch_size=2, sampler=DistributedSampler(
        IdDataset(8), num_replicas=2, rank=0))
    with pytest.raises(ValueError, match="already shards"):
        replica(sharded, 0, 2)
    with pytest.raises(rp.data.EmptyShardError, match="fewer samples than one global batch"):
        next(iter(replica(IdDataset(6), 0, 2, batch_size=8, drop_remainder=True)))
    with pytest.raises(ValueError, match="unknown shard policy 'files'"):
        InputOptions(shard_policy="files")
    with pytest.raises(ValueError, match="prefetch"):
        InputOptions(prefetch=-1)


def _broken(sample):
    raise KeyError("no such key")


def test_a_failing_transform_names_the_rank_and_step() -> None:
    dist = replica(IdDataset(8), 1, 2, batch_size=4, transform=_broken)
    with pytest.raises(rp.data.InputPipelineError, match="rank 1 .*step 0 of epoch 0.*KeyError"):
        next(iter(dist))


def test_with_mask_yields_pairs() -> None:
    dist = replica(IdDataset(9), 1, 2, batch_size=4, options=InputOptions(with_mask=True))
    pairs = [(b[0].tolist(), m.tolist()) for b, m in dist]
    assert pairs[-1] == ([8], [0.0])
