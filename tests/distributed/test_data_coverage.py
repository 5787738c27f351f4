"""2 real replicas, 1,000 samples, 3 epochs: every sample exactly once per epoch (or exactly the
documented drop rule), for every shard policy, both ways of drop_remainder, every engine."""

from __future__ import annotations

import pytest

import replicator as rp
from replicator.data import FileDataset, InputOptions
from replicator.data.batching import global_order
from replicator.data.sharding import FileShardPlan
from replicator.testing import run_distributed
from tests.data_helpers import IdDataset, IdStream, batch_ids, read_id_file, write_id_files

SIZES = [150, 50, 100, 120, 80, 100, 90, 110, 100, 100]  # 1,000 ids in 10 uneven files
N, BATCH, SEED, EPOCHS = 1000, 64, 5, 3

CONFIGS = {  # name: (input, options, the policy it resolves to)
    "map/auto": ("map", InputOptions(shard_policy="auto"), "data"),
    "map/data+threads": ("map", InputOptions(shard_policy="data", num_workers=2,
                                             worker_type="thread"), "data"),
    "map/off+processes": ("map", InputOptions(shard_policy="off", num_workers=1,
                                              worker_start_method="fork"), "off"),
    "stream/data": ("stream", InputOptions(shard_policy="data", shuffle_buffer=200), "data"),
    "files/file": ("files", InputOptions(shard_policy="file", prefetch=3), "file"),
    "files/auto": ("files", InputOptions(shard_policy="auto", prefetch=0), "file"),
}


def coverage_worker(paths: list[str]) -> dict:
    strategy = rp.MirroredStrategy()
    out = {}
    for name, (kind, options, _) in CONFIGS.items():
        for drop in (False, True):
            data = {"map": IdDataset(N), "stream": IdStream(N), "files": paths}[kind]
            dist = strategy.distribute_dataset(
                data, batch_size=BATCH, shuffle=True, seed=SEED, drop_remainder=drop,
                reader=read_id_file if kind == "files" else None, options=options)
            out[f"{name}/drop={drop}"] = (dist.shard_policy, [
                [batch_ids(batch, dist.mask) for batch in dist] for _ in range(EPOCHS)])
            dist.close()
    return out


def full_batches_per_shard(paths: list[str], epoch: int) -> list[int]:
    files = FileDataset(paths, read_id_file)
    return [sum(1 for s in FileShardPlan(files, BATCH, r, 2, shuffle=True, seed=SEED,
                                         shuffle_buffer=1024, drop_remainder=True,
                                         pad_last_batch=False).specs(epoch, 0))
            for r in range(2)]


@pytest.mark.timeout(120)
def test_every_sample_once_per_epoch_for_every_policy(tmp_path) -> None:
    paths = write_id_files(str(tmp_path / "files"), SIZES)
    ranks = run_distributed(coverage_worker, world_size=2, args=(paths,))
    assert ranks[0].keys() == {f"{n}/drop={d}" for n in CONFIGS for d in (False, True)}
    for key, (policy, epochs) in ranks[0].items():
        other_policy, other_epochs = ranks[1][key]
        assert policy == other_policy == CONFIGS[key.rsplit("/", 1)[0]][2], key
        for epoch, (mine, theirs) in enumerate(zip(epochs, other_epochs)):
            assert len(mine) == len(theirs), f"{key} epoch {epoch}: replicas ran apart"
            ids = [i for step in mine + theirs for i in step]
            assert len(ids) == len(set(ids)), f"{key} epoch {epoch}: a sample was seen twice"
            drop = key.endswith("True")
            if not drop:
                assert sorted(ids) == list(range(N)), f"{key} epoch {epoch}"
            elif policy == "file":  # all stop when the first replica is out of full batches
                steps = min(full_batches_per_shard(paths, epoch))
                assert len(mine) == steps and len(ids) == steps * BATCH
            elif key.startswith("map"):  # the seeded order without its short last batch
                order = global_order(N, True, SEED, epoch)[:960]
                assert [i for a, b in zip(mine, theirs) for i in a + b] == order
            else:
                assert len(ids) == 960 and len(mine) == 15
