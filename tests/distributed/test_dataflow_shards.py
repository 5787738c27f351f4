"""Shards from the loopback S3 server under distribute_dataset on 2 replicas: every sample once
per epoch in the global order of one process, each shard fetched once for the host (the
replicas share the local shard cache), a decode that runs only on each replica's part."""

from __future__ import annotations

import os

import pytest
import torch

import replicator as rp
from replicator.data import Dataset, Options, write_shards
from replicator.testing import run_distributed
from tests.s3_server import s3_server  # noqa: F401 - a fixture

pytestmark = pytest.mark.timeout(240)


def decode(sample: dict) -> torch.Tensor:
    return torch.tensor(int(sample["cls"]))


def pipeline(cache: str) -> Dataset:
    files = Dataset.list_files("s3://dshards/train-*.tar", shuffle=True, seed=4)
    return (Dataset.from_shards(files, cache_dir=cache).shuffle(8, seed=1).map(decode)
            .batch(4).with_options(Options(cpu_budget=2, timeout_seconds=60)))


def worker(cache: str) -> dict:
    strategy = rp.MirroredStrategy()
    ds = pipeline(cache)
    dist = strategy.distribute_dataset(ds)
    epochs = [[[int(v) for v, m in zip(b.tolist(), dist.mask.tolist()) if m] for b in dist]
              for _ in range(2)]
    counters = ds.stats()["counters"]
    dist.close()
    ds.close()
    return {"epochs": epochs, "counters": counters}


def test_shards_from_s3_on_two_replicas(s3_server, tmp_path) -> None:  # noqa: F811
    s3_server.make_bucket("dshards")
    write_shards(({"__key__": f"k{i:03d}", "cls": i} for i in range(30)), "s3://dshards/train",
                 samples_per_shard=7)
    cache = str(tmp_path / "cache")
    reference = pipeline(str(tmp_path / "ref-cache"))
    ref = [[b.tolist() for b in reference] for _ in range(2)]
    results = run_distributed(worker, world_size=2, args=(cache,))
    for epoch in range(2):
        steps = [r["epochs"][epoch] for r in results]
        assert [a + b for a, b in zip(*steps)] == ref[epoch]
        assert sorted(sum(ref[epoch], [])) == list(range(30))
    assert ref[0] != ref[1]
    fetches = sum(r["counters"].get("shard_fetches", 0) for r in results)
    hits = sum(r["counters"].get("shard_cache_hits", 0) for r in results)
    assert fetches == 5 and hits == 2 * 2 * 5 - 5  # 5 shards, fetched once for the host
    assert len([f for f in os.listdir(cache) if f.endswith(".tar")]) == 5
