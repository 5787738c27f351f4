"""rp.data.Dataset: sources and operators give tf.data's elements, with process and thread
workers alike; the order is a function of the seed and the epoch; cache, state and errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import replicator as rp
from replicator.data import AUTOTUNE, Dataset, Options
from replicator.data.dataflow.work import default_batch_collate
from replicator.data.errors import InputPipelineError

pytestmark = pytest.mark.timeout(120)
THREADS = Options(worker_type="thread", cpu_budget=2)
PROCESSES = Options(worker_type="process", cpu_budget=2)


def double(x):
    return x * 2


def fail_on_seven(x):
    if int(x) == 7:
        raise ValueError("seven is not welcome")
    return x


def flat(batches) -> list[int]:
    out: list[int] = []
    for b in batches:
        out.extend(torch.as_tensor(b).reshape(-1).tolist())
    return out


class Squares(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int):
        return torch.tensor(i * i)


def test_sources_give_their_elements() -> None:
    x, y = torch.arange(6).reshape(3, 2), torch.tensor([7, 8, 9])
    pairs = list(Dataset.from_tensor_slices((x, y)))
    assert [(a.tolist(), int(b)) for a, b in pairs] == [([0, 1], 7), ([2, 3], 8), ([4, 5], 9)]
    dicts = list(Dataset.from_tensor_slices({"a": [1, 2], "b": ["u", "v"]}))
    assert dicts == [{"a": 1, "b": "u"}, {"a": 2, "b": "v"}]
    assert [int(v) for v in Dataset.from_dataset(Squares())] == [i * i for i in range(10)]
    gen = Dataset.from_generator(lambda n: iter(range(n)), args=(4,))
    assert list(gen) == [0, 1, 2, 3] and list(gen) == [0, 1, 2, 3]  # called at each pass
    with pytest.raises(ValueError, match="one length"):
        Dataset.from_tensor_slices((torch.arange(3), torch.arange(4)))
    with pytest.raises(TypeError, match="from_generator"):
        Dataset.from_generator(iter([1]))  # type: ignore[arg-type]


@pytest.mark.parametrize("options", [THREADS, PROCESSES], ids=["thread", "process"])
def test_parallel_map_equals_the_serial_one(options: Options) -> None:
    base = Dataset.from_tensor_slices(torch.arange(50))
    serial = flat(base.map(double, num_parallel_calls=None).batch(8))
    ds = base.map(double, num_parallel_calls=AUTOTUNE).batch(8).prefetch().with_options(options)
    assert flat(ds) == serial == [2 * i for i in range(50)]
    unordered = base.map(double, num_parallel_calls=2, deterministic=False).with_options(options)
    assert sorted(int(v) for v in unordered) == serial
    stage = ds.stats()["stages"]["map(double)+batch(8)"]
    assert stage["tasks"] == 7 and 1 <= stage["parallelism"] <= 2


def pair(x):
    return {"x": torch.full((3, 2), float(x)), "y": int(x)}


def collate_and_say_where(samples):
    batch = default_batch_collate(samples)
    return batch, batch["x"].is_shared()


@pytest.mark.parametrize("options", [THREADS, PROCESSES], ids=["thread", "process"])
def test_process_workers_collate_batches_into_shared_memory(options: Options) -> None:
    ds = (Dataset.from_tensor_slices(torch.arange(20)).map(pair, num_parallel_calls=AUTOTUNE)
          .batch(8, collate_fn=collate_and_say_where).with_options(options))
    batches = list(ds)
    assert [shared for _b, shared in batches] == [options.worker_type == "process"] * 3
    assert torch.equal(torch.cat([b["x"] for b, _s in batches]),
                       torch.arange(20.0).view(20, 1, 1).expand(20, 3, 2))
    assert torch.cat([b["y"] for b, _s in batches]).tolist() == list(range(20))
    # the default collate gives the same batches (no flag)
    plain = Dataset.from_tensor_slices(torch.arange(20)).map(pair).batch(8).with_options(options)
    assert [b["y"].tolist() for b in plain] == [b["y"].tolist() for b, _s in batches]


def test_operators() -> None:
    ds = Dataset.from_tensor_slices(torch.arange(10))
    assert [int(v) for v in ds.filter(lambda v: v % 3 == 0)] == [0, 3, 6, 9]
    assert [int(v) for v in ds.skip(7)] == [7, 8, 9] and [int(v) for v in ds.take(2)] == [0, 1]
    assert [int(v) for v in ds.take(3).repeat(2)] == [0, 1, 2, 0, 1, 2]
    assert [int(v) for v in ds.shard(3, 1)] == [1, 4, 7] and ds.shard(3, 0).cardinality() == 4
    batches = list(ds.batch(4))
    assert [b.tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert len(list(ds.batch(4, drop_remainder=True))) == 2
    assert len(ds.batch(4)) == 3 and len(ds.batch(4, drop_remainder=True)) == 2
    assert ds.repeat().cardinality() == rp.data.INFINITE
    assert ds.filter(bool).cardinality() == rp.data.UNKNOWN
    inter = Dataset.from_tensor_slices([0, 1, 2]).interleave(
        lambda i: Dataset.from_tensor_slices(torch.arange(3) + 10 * int(i)), cycle_length=2,
        block_length=2, num_parallel_calls=2)
    assert [int(v) for v in inter] == [0, 1, 10, 11, 2, 12, 20, 21, 22]
    assert [int(v) for v in ds.take(4).prefetch(2)] == [0, 1, 2, 3]


def test_shuffle_is_a_function_of_seed_and_epoch_only() -> None:
    def epochs(options: Options, parallel) -> list[list[int]]:
        ds = (Dataset.from_tensor_slices(torch.arange(40)).map(double, num_parallel_calls=parallel)
              .shuffle(16, seed=3).batch(5).with_options(options))
        return [flat(ds) for _ in range(3)]
    a = epochs(THREADS, AUTOTUNE)
    assert a == epochs(PROCESSES, 2) == epochs(Options(), None)
    assert sorted(a[0]) == [2 * i for i in range(40)] and a[0] != a[1] != a[2]
    other_seed = Dataset.from_tensor_slices(torch.arange(40)).shuffle(16, seed=4)
    assert flat(other_seed) != [v // 2 for v in a[0]]
    passes = [int(v) for v in Dataset.from_tensor_slices(torch.arange(8)).shuffle(8, seed=0)
              .repeat(2)]
    assert sorted(passes[:8]) == sorted(passes[8:]) and passes[:8] != passes[8:]


def test_cache_in_memory_and_in_a_file(tmp_path) -> None:
    calls: list[int] = []

    def record(x):
        calls.append(int(x))
        return x * 10

    mem = Dataset.from_tensor_slices(torch.arange(6)).map(record, num_parallel_calls=None).cache()
    assert [int(v) for v in mem] == [0, 10, 20, 30, 40, 50]
    assert [int(v) for v in mem.shuffle(6, seed=1)] != []  # a new dataset: its own cache
    calls.clear()
    assert [int(v) for v in mem] == [0, 10, 20, 30, 40, 50] and calls == []
    path = tmp_path / "cache.bin"
    partial = Dataset.from_tensor_slices(torch.arange(6)).map(record, num_parallel_calls=None)
    assert [int(v) for v in partial.cache(path).take(2)] == [0, 10]
    assert not path.exists()  # a pass left early fills nothing
    assert [int(v) for v in partial.cache(path)] == [0, 10, 20, 30, 40, 50] and path.exists()
    calls.clear()
    shuffled = partial.cache(path).shuffle(6, seed=2)  # a new pipeline reads the file
    assert sorted(int(v) for v in shuffled) == [0, 10, 20, 30, 40, 50] and calls == []
    with pytest.raises(ValueError, match="before shuffle"):
        Dataset.from_tensor_slices(torch.arange(6)).shuffle(6).cache()


def test_resume_mid_epoch_gives_exactly_the_rest() -> None:
    def build() -> Dataset:
        return (Dataset.from_tensor_slices(torch.arange(30)).shuffle(10, seed=1).map(double)
                .batch(4).with_options(THREADS))
    ref = build()
    whole = [[b.tolist() for b in ref] for _ in range(2)]
    ds = build()
    it = iter(ds)
    first = [next(it).tolist() for _ in range(3)]
    state = json.loads(json.dumps(ds.state_dict()))
    resumed = build()
    resumed.load_state_dict(state)
    assert first + [b.tolist() for b in resumed] == whole[0]
    assert [b.tolist() for b in resumed] == whole[1]
    with pytest.raises(ValueError, match="same pipeline"):
        Dataset.from_tensor_slices(torch.arange(3)).load_state_dict(state)


def test_a_failing_map_names_the_element_or_is_skipped_and_counted(caplog) -> None:
    ds = Dataset.from_tensor_slices(torch.arange(10))
    with pytest.raises(InputPipelineError, match=r"tensor\(7\).*seven is not welcome"):
        list(ds.map(fail_on_seven).batch(5).with_options(PROCESSES))
    skipping = ds.map(fail_on_seven, on_error="skip").with_options(THREADS)
    with caplog.at_level("WARNING", logger="replicator.data"):
        assert [int(v) for v in skipping] == [0, 1, 2, 3, 4, 5, 6, 8, 9]
        assert [int(v) for v in skipping] == [0, 1, 2, 3, 4, 5, 6, 8, 9]
    assert skipping.stats()["counters"]["skipped_samples"] == 2
    assert sum("seven" in r.getMessage() for r in caplog.records) == 1  # logged once
    with pytest.raises(ValueError, match="on_error"):
        ds.map(double, on_error="ignore")


def test_it_is_a_plain_iterable_dataset() -> None:
    ds = Dataset.from_tensor_slices(torch.arange(12)).map(double).batch(4)
    assert isinstance(ds, IterableDataset)
    assert flat(DataLoader(ds, batch_size=None)) == [2 * i for i in range(12)]
    with pytest.raises(Exception, match="once per worker"):
        list(DataLoader(Dataset.from_tensor_slices(torch.arange(4)), batch_size=None,
                        num_workers=2))
    assert os.cpu_count()
    stats = ds.stats()
    assert stats["cpu_budget"] >= 1 and stats["ram_budget"] > 0
    assert "map(double)+batch(4)" in stats["pipeline"]
