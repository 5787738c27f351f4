"""Row slicing and padding of collated batches, seeded stream shuffling, the prefetch queue."""

from __future__ import annotations

import time
from collections import namedtuple

import pytest
import torch

from replicator.data.batching import (
    LocalBatch,
    batch_rows,
    buffer_shuffle,
    derived_seed,
    make_mask,
    pad_rows,
    repeat_first_row,
    slice_rows,
)
from replicator.data.errors import InputTimeoutError
from replicator.data.prefetch import DeviceStage, PrefetchQueue

Pair = namedtuple("Pair", "x y")


def test_rows_of_nested_batches_are_sliced_and_padded_together() -> None:
    batch = {"pair": Pair(torch.arange(6).reshape(3, 2), torch.tensor([7, 8, 9])),
             "names": ["a", "b", "c"], "scale": torch.tensor(2.0)}
    assert batch_rows(batch) == 3
    part = slice_rows(batch, 1, 3)
    assert part["pair"].y.tolist() == [8, 9] and part["names"] == ["b", "c"]
    assert part["scale"].item() == 2.0
    padded = pad_rows(part, 4)
    assert padded["pair"].x.tolist() == [[2, 3], [4, 5], [2, 3], [2, 3]]
    assert padded["names"] == ["b", "c", "b", "b"]
    assert isinstance(padded["pair"], Pair)
    assert repeat_first_row((torch.tensor([5, 6]),), 3)[0].tolist() == [5, 5, 5]
    assert make_mask(2, 4).tolist() == [1.0, 1.0, 0.0, 0.0]


def test_buffer_shuffle_is_a_seeded_permutation() -> None:
    a = list(buffer_shuffle(range(500), 50, derived_seed(1, 0)))
    assert sorted(a) == list(range(500)) and a != list(range(500))
    assert a == list(buffer_shuffle(range(500), 50, derived_seed(1, 0)))
    assert a != list(buffer_shuffle(range(500), 50, derived_seed(1, 1)))
    assert sorted(buffer_shuffle(range(3), 10, 0)) == [0, 1, 2]  # buffer larger than stream
    assert derived_seed(1, 2) != derived_seed(2, 1)


def _batches(n: int, delay: float = 0.0):
    for i in range(n):
        time.sleep(delay)
        yield LocalBatch(torch.tensor([i]), make_mask(1, 1), 1, i < n - 1, i + 1)


def test_prefetch_queue_is_bounded_and_counts_full_batches() -> None:
    queue = PrefetchQueue(_batches(10), lambda item: (item, None), capacity=3,
                          timeout_seconds=5, name="test-prefetch")
    deadline = time.monotonic() + 5
    while queue.counts()[0] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert queue.counts() == (3, 3)  # bounded: the producer waits for room
    got = []
    while (item := queue.pop()) is not None:
        got.append(item[0].position)
    assert got == list(range(1, 11)) and queue.finished
    queue.wait(need_full=True)  # finished: returns at once


def test_prefetch_queue_times_out_with_a_hint() -> None:
    queue = PrefetchQueue(_batches(2, delay=2.0), lambda item: (item, None), capacity=2,
                          timeout_seconds=0.2, name="test-slow", who="rank 3")
    with pytest.raises(InputTimeoutError, match="rank 3: no batch .*timeout_seconds"):
        queue.pop()
    queue.close()


def test_device_stage_builds_the_mask_and_copies_to_the_device() -> None:
    item = LocalBatch((torch.arange(4),), 5, 4, False, 9)
    cpu_batch = DeviceStage(torch.device("cpu")).ready(DeviceStage(torch.device("cpu"))(item))
    assert cpu_batch.mask.tolist() == [1.0] * 4 + [0.0]
    meta = DeviceStage(torch.device("meta"))
    moved = meta.ready(meta(item))
    assert moved.batch[0].device.type == "meta" and moved.mask.device.type == "meta"
    kept = DeviceStage(torch.device("meta"), fetch_to_device=False)
    assert kept.ready(kept(item)).batch[0].device.type == "cpu"
