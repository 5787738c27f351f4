"""Stop after 37 steps, save the input state as JSON, restore in fresh processes: the next 50
batches equal those of the uninterrupted run on every rank; on another number of replicas the
rest of the epoch is still every sample exactly once."""

from __future__ import annotations

import json

import pytest

import replicator as rp
from replicator.data import InputOptions
from replicator.testing import run_distributed
from tests.data_helpers import (
    IdDataset,
    IdStream,
    batch_ids,
    id_batches,
    read_id_file,
    take_steps,
    write_id_files,
)

SIZES = [150, 50, 100, 120, 80, 100, 90, 110, 100, 100]
NAMES = ("map", "stream", "files", "files-drop", "input_fn")


def build(strategy: rp.Strategy, name: str, paths: list[str]) -> rp.data.DistributedDataset:
    common = dict(batch_size=64, shuffle=True, seed=5)
    if name == "map":
        return strategy.distribute_dataset(IdDataset(1000), **common, options=InputOptions(
            prefetch=3, num_workers=2, worker_type="thread"))
    if name == "stream":
        return strategy.distribute_dataset(IdStream(1000), **common,
                                           options=InputOptions(shuffle_buffer=128))
    if name.startswith("files"):
        return strategy.distribute_dataset(paths, reader=read_id_file, **common,
                                           drop_remainder=name == "files-drop",
                                           options=InputOptions(shard_policy="file", prefetch=4))
    rank = strategy.replica_id
    return strategy.distribute_datasets_from_function(
        lambda ctx: id_batches(20 - 3 * rank, 8, start=1000 * rank), drop_remainder=False)


def save_worker(paths: list[str]) -> dict:
    strategy = rp.MirroredStrategy()
    out = {}
    for name in NAMES:
        dist = build(strategy, name, paths)
        before = take_steps(dist, 37)
        state = json.dumps(dist.state_dict())  # what a checkpoint stores
        out[name] = {"before": before, "state": state, "after": take_steps(dist, 50)}
        dist.close()
    return out


def restore_worker(paths: list[str], states: dict[str, str]) -> dict:
    strategy = rp.MirroredStrategy()
    out = {}
    for name, state in states.items():
        dist = build(strategy, name, paths)
        dist.load_state_dict(json.loads(state))
        out[name] = take_steps(dist, 50) if name in NAMES else [
            batch_ids(b, dist.mask) for b in dist]  # the rest of the epoch
        dist.close()
    return out


@pytest.mark.timeout(120)
def test_restart_continues_with_exactly_the_next_batches(tmp_path) -> None:
    paths = write_id_files(str(tmp_path / "files"), SIZES)
    saved = run_distributed(save_worker, world_size=2, args=(paths,))
    for name in NAMES:  # the same state on every rank: any rank's copy can be stored
        assert saved[0][name]["state"] == saved[1][name]["state"], name
    # an input saved by one replica, continued by two (FILE: its one shard goes to rank 0)
    one = rp.OneDeviceStrategy("cpu")
    single = build(one, "files", paths)
    first = take_steps(single, 5)
    states = {name: saved[0][name]["state"] for name in NAMES}
    states["files-from-1"] = json.dumps(single.state_dict())
    restored = run_distributed(restore_worker, world_size=2, args=(paths, states))
    for rank in range(2):
        for name in NAMES:
            assert restored[rank][name] == saved[rank][name]["after"], f"{name} rank {rank}"
    rest = [i for rank in range(2) for step in restored[rank]["files-from-1"] for i in step]
    assert len(restored[0]["files-from-1"]) == len(restored[1]["files-from-1"])
    assert sorted(sum(first, []) + rest) == list(range(1000))

    # two replicas' state continued by one replica
    for name in ("map", "stream"):  # global batches: the same ones, step by step
        dist = build(one, name, paths)
        dist.load_state_dict(json.loads(states[name]))
        expected = [a + b for a, b in zip(saved[0][name]["after"], saved[1][name]["after"])]
        assert take_steps(dist, 50) == expected, name
    # FILE shards: the rest of the interrupted epoch, each sample once
    state = json.loads(states["files"])
    dist = build(one, "files", paths)
    dist.load_state_dict(state)
    rest = [i for batch in dist for i in batch_ids(batch, dist.mask)]
    epoch_start = 37 - state["position"]  # steps of earlier epochs among the first 37
    before = [i for rank in range(2) for step in saved[rank]["files"]["before"][epoch_start:]
              for i in step]
    assert sorted(before + rest) == list(range(1000))
