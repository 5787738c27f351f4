"""AUTOTUNE: a stage whose consumer waits gets more workers, up to the CPU budget; a stage
whose consumer never waits gives workers back; the RAM budget bounds what is in flight; the
choices show in stats()."""

from __future__ import annotations

import time

import pytest
import torch

from replicator.data import AUTOTUNE, Dataset, Options
from replicator.data.dataflow.options import default_cpu_budget

pytestmark = pytest.mark.timeout(120)


def slow(x):
    time.sleep(0.01)  # waits without the GIL, like I/O
    return x


def stage(ds: Dataset) -> dict:
    (only,) = [s for name, s in ds.stats()["stages"].items() if name != "prefetch"]
    return only


def test_a_waiting_consumer_gets_more_workers_up_to_the_budget() -> None:
    ds = (Dataset.from_tensor_slices(torch.arange(600)).map(slow, num_parallel_calls=AUTOTUNE)
          .batch(4).with_options(Options(cpu_budget=4, worker_type="thread")))
    seen = sum(int(b.numel()) for b in ds)
    st = stage(ds)
    assert seen == 600
    assert st["autotune"] and st["max_parallelism"] == 4
    assert st["parallelism"] > 2, st  # started at 2, probed up while the consumer waited
    assert any("probe" in d for d in st["decisions"]) or st["parallelism"] == 4


def test_a_busy_consumer_gives_workers_back() -> None:
    ds = (Dataset.from_tensor_slices(torch.arange(160)).map(lambda v: v * 2)
          .batch(4).with_options(Options(cpu_budget=3, worker_type="thread")))
    for _ in ds:
        time.sleep(0.03)  # a slow training step: the input is always ready
    st = stage(ds)
    assert st["parallelism"] == 1, st
    assert st["wait_share"] < 0.5


def test_a_fixed_parallelism_is_kept_and_ram_bounds_the_flight() -> None:
    ds = (Dataset.from_tensor_slices(torch.zeros(64, 1000)).map(slow, num_parallel_calls=3)
          .batch(8).with_options(Options(cpu_budget=2, ram_budget=1, worker_type="thread")))
    assert sum(int(b.shape[0]) for b in ds) == 64
    st = stage(ds)
    assert not st["autotune"] and st["parallelism"] == 3  # the user's number wins
    assert st["in_flight_limit"] == 1 and st["result_bytes"] == 8 * 1000 * 4
    assert default_cpu_budget() >= 1
