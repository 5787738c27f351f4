"""Sharded tar datasets: written and read back locally and through the loopback S3 server,
fetched once per host into a size-limited cache, and bad input (a truncated shard, a missing
one, an undecodable sample) named clearly or skipped and counted, never a silently short
epoch."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from replicator.data import Dataset, Options, write_shards
from replicator.data.dataflow.shards import ShardError
from replicator.data.errors import InputPipelineError
from tests.s3_server import s3_server  # noqa: F401 - a fixture

pytestmark = pytest.mark.timeout(120)
THREADS = Options(worker_type="thread", cpu_budget=2)


def samples(n: int, start: int = 0):
    for i in range(start, start + n):
        yield {"__key__": f"s{i:04d}", "cls": i, "txt": f"sample {i}"}


def label(sample: dict) -> int:
    if sample["txt"] == b"garbage":
        raise ValueError("cannot decode")
    return int(sample["cls"])


def test_written_shards_read_back_in_order(tmp_path) -> None:
    urls = write_shards(samples(25), str(tmp_path / "train"), samples_per_shard=10)
    assert [os.path.basename(u) for u in urls] == [f"train-00000{i}.tar" for i in range(3)]
    got = list(Dataset.from_shards(urls))
    assert [s["__key__"] for s in got] == [f"s{i:04d}" for i in range(25)]
    assert got[12] == {"__key__": "s0012", "__url__": urls[1], "cls": b"12", "txt": b"sample 12"}
    assert Dataset.list_files(str(tmp_path / "train-*.tar")).take(3).cardinality() == 3
    assert [str(u) for u in Dataset.list_files(str(tmp_path / "train-*.tar"))] == urls
    files = Dataset.list_files(str(tmp_path / "train-*.tar"), shuffle=True, seed=3)
    orders = [[str(u) for u in files] for _ in range(4)]
    assert all(sorted(o) == urls for o in orders) and len({tuple(o) for o in orders}) > 1
    with pytest.raises(ValueError, match="may not contain"):
        write_shards([{"__key__": "a.b", "x": b""}], str(tmp_path / "bad"))


def test_resume_mid_epoch_over_shards(tmp_path) -> None:
    urls = write_shards(samples(40), str(tmp_path / "train"), samples_per_shard=8)

    def build() -> Dataset:
        return (Dataset.from_shards(Dataset.list_files(urls, shuffle=True, seed=1))
                .shuffle(10, seed=2).map(label).batch(6).with_options(THREADS))
    whole = [b.tolist() for b in build()]
    ds = build()
    it = iter(ds)
    first = [next(it).tolist() for _ in range(3)]
    resumed = build()
    resumed.load_state_dict(json.loads(json.dumps(ds.state_dict())))
    assert first + [b.tolist() for b in resumed] == whole
    assert sorted(sum(whole, [])) == list(range(40))


def test_bad_shards_are_named_or_skipped_and_counted(tmp_path, caplog) -> None:
    urls = write_shards(samples(30), str(tmp_path / "train"), samples_per_shard=10)
    with open(urls[1], "r+b") as f:  # cut the middle shard inside a member's data
        f.truncate(os.path.getsize(urls[1]) // 2 + 100)
    with pytest.raises(ShardError, match=r"train-000001\.tar is truncated.*after sample 's00"):
        list(Dataset.from_shards(urls))
    missing = urls + [str(tmp_path / "train-000009.tar")]
    with pytest.raises(ShardError, match=r"train-000009\.tar does not exist"):
        list(Dataset.from_shards(missing[3:] + urls[:1]))
    skipping = Dataset.from_shards(missing, on_error="skip")
    with caplog.at_level("WARNING", logger="replicator.data"):
        keys = [s["__key__"] for s in skipping]
    assert keys[:10] == [f"s{i:04d}" for i in range(10)] and keys[-10:] == [
        f"s{i:04d}" for i in range(20, 30)]
    assert skipping.stats()["counters"]["skipped_shards"] == 2
    assert sum("skipped" in r.getMessage() for r in caplog.records) == 1


def test_an_undecodable_sample_is_named_or_skipped(tmp_path) -> None:
    rows = list(samples(12))
    rows[5]["txt"] = "garbage"
    urls = write_shards(rows, str(tmp_path / "train"), samples_per_shard=6)
    with pytest.raises(InputPipelineError, match=r"sample 's0005' of shard .*train-000000\.tar"):
        list(Dataset.from_shards(urls).map(label).batch(4).with_options(THREADS))
    ds = Dataset.from_shards(urls).map(label, on_error="skip").batch(4).with_options(THREADS)
    assert sorted(sum((b.tolist() for b in ds), [])) == [i for i in range(12) if i != 5]
    assert ds.stats()["counters"]["skipped_samples"] == 1


def test_a_shard_fetched_ahead_stays_cached_until_it_is_read(tmp_path) -> None:
    """The shard-fetch threads start together: each must hold its shard in the one cache of
    the pipeline (a second cache, dropped, released its lock and the shard was evicted before
    it was read, about one pass in two)."""
    urls = write_shards(samples(30), "memory://ahead/train", samples_per_shard=10)
    for round_ in range(40):
        cache = str(tmp_path / f"cache{round_}")
        list(Dataset.from_shards(urls, cache_dir=cache))  # all three cached, then one at most
        tight = Dataset.from_shards(urls, cache_dir=cache, cache_limit_bytes=1)
        assert sum((b.tolist() for b in tight.map(label).batch(5).with_options(THREADS)),
                   []) == list(range(30))


def test_shards_on_s3_fetched_once_per_host_into_a_limited_cache(s3_server,  # noqa: F811
                                                                  tmp_path) -> None:
    s3_server.make_bucket("shards")
    urls = write_shards(samples(30), "s3://shards/train", samples_per_shard=10)
    assert Dataset.list_files("s3://shards/train-*.tar").cardinality() == 3
    listed = [str(u) for u in Dataset.list_files("s3://shards/train-*.tar")]
    assert listed == urls
    cache = str(tmp_path / "cache")

    def build(limit=None) -> Dataset:
        return Dataset.from_shards(listed, cache_dir=cache, cache_limit_bytes=limit).map(
            label).batch(5).with_options(THREADS)
    ds = build()
    for _ in range(2):
        assert sum((b.tolist() for b in ds), []) == list(range(30))
    assert ds.stats()["counters"] == {"shard_fetches": 3, "shard_cache_hits": 3}
    other = build()  # another process of this host: the shards are already here
    assert sum((b.tolist() for b in other), []) == list(range(30))
    assert other.stats()["counters"] == {"shard_cache_hits": 3}
    one_shard = max(os.path.getsize(os.path.join(cache, f)) for f in os.listdir(cache))
    small = build(limit=one_shard)  # one shard at most stays
    assert sum((b.tolist() for b in small), []) == list(range(30))
    assert len([f for f in os.listdir(cache) if not f.endswith(".lock")]) == 1
    with pytest.raises(ShardError, match=r"s3://shards/nothing\.tar does not exist"):
        list(Dataset.from_shards(["s3://shards/nothing.tar"], cache_dir=cache))
    assert torch.cuda.device_count() >= 0


def test_a_store_that_stops_mid_epoch_is_named(tmp_path, caplog) -> None:
    from tests.s3_server import S3Server

    server = S3Server(str(tmp_path / "moto.log"))
    server.start()
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    try:
        server.make_bucket("stops")
        urls = write_shards(samples(20), "s3://stops/train", samples_per_shard=10)

        def build(on_error: str) -> Dataset:
            return Dataset.from_shards(urls, cache_dir=str(tmp_path / on_error),
                                       prefetch_shards=0, on_error=on_error)
        skip_ds = build("skip")
        failing, skipping = iter(build("raise")), iter(skip_ds)
        assert [next(failing)["__key__"] for _ in range(10)][-1] == "s0009"
        assert [next(skipping)["__key__"] for _ in range(10)][-1] == "s0009"
        server.stop()
        with pytest.raises(ShardError, match=r"could not fetch shard s3://stops/train-000001"):
            next(failing)
        with caplog.at_level("WARNING", logger="replicator.data"):
            assert list(skipping) == []
        assert skip_ds.stats()["counters"]["skipped_shards"] == 1
        assert sum("skipped" in r.getMessage() for r in caplog.records) == 1
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _another_process_reading(cache: str, url: str) -> Iterator[list[str]]:
    """A process of this host that holds ``url``'s shard in ``cache`` (as a reader does) until
    the block ends; yields the counters its fetch reported."""
    reader = subprocess.Popen(
        [sys.executable, "-c", "import sys; from replicator.data.dataflow.shards import "
         "ShardCache; c = ShardCache(sys.argv[1], 1, 30); c.get(sys.argv[2], print); "
         "print('held', flush=True); sys.stdin.read()", cache, url],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout is not None
        counts = []
        while (line := reader.stdout.readline().strip()) != "held":
            assert line, "the reading process ended before it held the shard"
            counts.append(line)
        yield counts
    finally:
        reader.communicate("", timeout=30)


def test_a_shard_being_read_is_never_evicted_by_this_or_another_process(tmp_path) -> None:
    from replicator.data.dataflow.shards import ShardCache

    urls = ["file://" + u for u in write_shards(samples(30), str(tmp_path / "src"),
                                                  samples_per_shard=10)]
    counts: list[str] = []
    cache = ShardCache(str(tmp_path / "cache"), limit_bytes=1, timeout_s=30)  # room for none
    first = cache.get(urls[0], counts.append)
    second = cache.get(urls[1], counts.append)  # evicting beyond the limit spares both
    assert os.path.exists(first) and os.path.exists(second)
    cache.release(first)
    assert not os.path.exists(first) and os.path.exists(second)
    # another process of the host reads the third shard: this one's eviction spares it
    with _another_process_reading(str(tmp_path / "cache"), urls[2]):
        third = cache.path_of(urls[2])
        cache.release(second)
        assert os.path.exists(third) and not os.path.exists(second)
    cache.release(cache.get(urls[0], counts.append))
    assert not os.path.exists(third)  # the other process is done with it: it could leave
    assert counts == ["shard_fetches"] * 3  # the first shard twice, the second once


def test_a_shard_another_process_reads_is_read_here_too_without_waiting(tmp_path) -> None:
    from replicator.data.dataflow.shards import ShardCache

    urls = ["file://" + u for u in write_shards(samples(10), str(tmp_path / "src"),
                                                  samples_per_shard=10)]
    # another process of the host fetches the shard and reads it
    with _another_process_reading(str(tmp_path / "cache"), urls[0]) as its_counts:
        assert its_counts == ["shard_fetches"]
        counts: list[str] = []
        cache = ShardCache(str(tmp_path / "cache"), None, timeout_s=3)  # a wait would raise
        path = cache.get(urls[0], counts.append)
        assert counts == ["shard_cache_hits"] and os.path.exists(path)
        cache.release(path)


def test_shards_fetched_ahead_of_an_epoch_left_early_are_released(s3_server,  # noqa: F811
                                                                 tmp_path) -> None:
    from replicator.data.dataflow.shards import ShardCache

    s3_server.make_bucket("ahead")
    urls = write_shards(samples(40), "s3://ahead/train", samples_per_shard=10)
    cache = str(tmp_path / "cache")
    ds = Dataset.from_shards(urls, cache_dir=cache, prefetch_shards=2)
    it = iter(ds)
    assert next(it)["__key__"] == "s0000"
    deadline = time.monotonic() + 30
    while len([f for f in os.listdir(cache) if f.endswith(".tar")]) < 3:  # the two ahead
        assert time.monotonic() < deadline, os.listdir(cache)
        time.sleep(0.05)
    it.close()  # the epoch is left after one sample (as a next epoch's iter() leaves it)
    ShardCache(cache, limit_bytes=1, timeout_s=5)._evict()  # removes whatever no process holds
    assert [f for f in os.listdir(cache) if f.endswith(".tar")] == []


def _start_then_sleep(started) -> None:  # type: ignore[no-untyped-def]
    started.set()
    time.sleep(60)


def test_a_shard_released_here_is_not_held_by_a_process_forked_while_it_was_read(
        tmp_path) -> None:
    import multiprocessing as mp

    from replicator.data.dataflow.shards import ShardCache

    urls = ["file://" + u for u in write_shards(samples(10), str(tmp_path / "src"),
                                                  samples_per_shard=10)]
    cache = ShardCache(str(tmp_path / "cache"), None, timeout_s=5)
    path = cache.get(urls[0], lambda _: None)
    ctx = mp.get_context("fork")
    started = ctx.Event()
    child = ctx.Process(target=_start_then_sleep, args=(started,), daemon=True)
    child.start()  # as a decode worker started mid-epoch: it shares this process's open files
    try:
        assert started.wait(30)
        cache.release(path)
        ShardCache(str(tmp_path / "cache"), limit_bytes=1, timeout_s=5)._evict()
        assert not os.path.exists(path)  # nobody reads it: it could leave
    finally:
        child.terminate()
        child.join(10)
