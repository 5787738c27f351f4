"""The coordinator's and sparse tables' parts in one process: MaxSizePartitioner, a table's
row split, row-wise optimizers, the value codec, the task ledger and the task queue."""

from __future__ import annotations

import pytest
import torch

import replicator as rp
from replicator.ps.partitioners import place
from replicator.ps.server_updates import TaskLedger, build_shard_optimizer, sparse_gradient
from replicator.ps.sparse_tables import SparseTable
from replicator.ps.task_queue import (
    CANCELLED,
    Marker,
    ResourceRef,
    Task,
    TaskQueue,
    decode,
    encode,
)


def test_max_size_partitioner_keeps_every_shard_under_the_limit():
    part = rp.ps.MaxSizePartitioner(max_shard_bytes=4 << 20)
    assert part.num_shards((1_000_000, 32), torch.float32) == 31  # 128 MB / 4 MiB, whole rows
    assert part.num_shards((100, 32), torch.float32) == 1
    assert rp.ps.MaxSizePartitioner(1000, max_shards=3).num_shards((1000, 4), torch.float32) == 3
    assert rp.ps.MaxSizePartitioner(8).num_shards((5, 1000), torch.float32) == 5  # row each
    shards = place([("table", torch.zeros(1_000_000, 32))], 2, part)
    assert all(s.nbytes <= 4 << 20 for s in shards)
    assert {s.server for s in shards} == {0, 1}
    with pytest.raises(ValueError, match="max_shard_bytes"):
        rp.ps.MaxSizePartitioner(0)


def test_sparse_table_pulls_distinct_rows_per_shard_and_pushes_coalesced_rows():
    weight = torch.zeros(10, 2)
    shards = place([("t", weight)], 2, rp.ps.FixedShardsPartitioner(2))  # rows 0-4, 5-9
    table = SparseTable(weight, shards, "t")
    wanted = table.rows_to_pull(torch.tensor([[7, 1], [7, 3]]))
    flat = {sid: rows.tolist() for items in wanted.values() for sid, rows in items}
    assert flat == {shards[0].shard_id: [1, 3], shards[1].shard_id: [2]}  # shard-local
    grad = torch.sparse_coo_tensor(torch.tensor([[7, 1, 7]]), torch.ones(3, 2), (10, 2),
                                   check_invariants=True)
    pushes = {sid: (rows.tolist(), values.tolist())
              for items in table.gradient_rows(grad, {}).values() for sid, _, values, rows in items}
    assert pushes == {shards[0].shard_id: ([1], [[1.0, 1.0]]),
                      shards[1].shard_id: ([2], [[2.0, 2.0]])}  # duplicates summed


def test_row_wise_optimizers_refuse_what_has_no_row_wise_form():
    p = torch.nn.Parameter(torch.ones(4, 2))
    spec = {"class": "Adam", "groups": [{"lr": 0.1, "betas": [0.9, 0.99], "eps": 1e-8,
                                         "weight_decay": 0, "amsgrad": False}]}
    assert isinstance(build_shard_optimizer(spec, p, 0, sparse=True), torch.optim.SparseAdam)
    assert isinstance(build_shard_optimizer(spec, p, 0, sparse=False), torch.optim.Adam)
    with pytest.raises(rp.errors.ParameterServerError, match="weight_decay"):
        build_shard_optimizer({"class": "AdamW", "groups": [{"lr": 0.1, "weight_decay": 0.01}]},
                              p, 0, sparse=True)
    with pytest.raises(rp.errors.ParameterServerError, match="RMSprop cannot update"):
        build_shard_optimizer({"class": "RMSprop", "groups": [{"lr": 0.1}]}, p, 0, sparse=True)
    with pytest.raises(rp.errors.ParameterServerError, match="sorted"):
        sparse_gradient(torch.tensor([2, 1]), torch.ones(2, 2), p)


def test_values_travel_without_pickle_and_resources_resolve_on_the_worker():
    value = {"loss": torch.tensor(0.5), "ids": [1, (2.0, None)], "it": ResourceRef(3)}
    text, tensors = encode(value, "arg")
    back = decode(text, tensors, resolve=lambda n: f"iterator {n}")
    assert back["loss"].item() == 0.5 and back["ids"] == [1, (2.0, None)]
    assert back["it"] == "iterator 3"
    with pytest.raises(rp.errors.ParameterServerError, match=r"arg\['f'\] has type object"):
        encode({"f": object()}, "arg")


def test_task_ledger_applies_each_push_of_a_task_once():
    ledger = TaskLedger()
    assert ledger.first(7, 0) and ledger.first(7, 1) and not ledger.first(7, 0)
    assert ledger.summary() == {"applied": 2, "repeats": 1}


def test_task_queue_markers_first_a_lost_workers_task_runs_again_and_errors_cancel():
    queue = TaskQueue([1, 2], serial=True)
    queue.connect(1)
    queue.connect(2)
    a, b = queue.add("f", "f", ("{}", [])), queue.add("f", "f", ("{}", []))
    first = queue.next_for(1, 0.01)
    assert isinstance(first, Task) and first is a
    assert queue.next_for(2, 0.01) is None  # serial: one function at a time
    queue.post("join", 1, ("null", []))
    assert isinstance(queue.next_for(2, 0.01), Marker)  # a marker comes before a task
    assert queue.lost(1) is a and a.attempts == 1
    again = queue.next_for(2, 0.01)
    assert again is a and a.attempts == 2 and a.ran_on == [1, 2]
    queue.fail(2, a.task_id, RuntimeError("boom"))
    assert b.state == CANCELLED and "task 0 failed first" in str(b.error)
    assert isinstance(queue.take_error(), RuntimeError) and queue.take_error() is None


def test_a_worker_takes_one_task_ahead_and_a_lost_worker_gives_both_back_in_order():
    queue = TaskQueue([1, 2], serial=False)
    queue.connect(1)
    queue.connect(2)
    a, b, c, d = (queue.add("f", "f", ("{}", [])) for _ in range(4))
    assert queue.next_for(1, 0.01) is a
    assert queue.next_for(1, 5.0, ahead=True) is b  # answered at once
    assert queue.next_for(1, 5.0, ahead=True) is None  # one ahead at most
    assert queue.next_for(2, 0.01) is c
    assert queue.pending() == 4
    assert queue.lost(1) is a and queue.reruns == 1  # b had not started
    assert (a.attempts, b.attempts, b.ran_on) == (1, 0, [])
    assert queue.next_for(2, 0.01, ahead=True) is a  # back at the front, in order
    queue.complete(2, c.task_id, ("1", []))
    assert queue.next_for(2, 0.01, ahead=True) is b
    assert d.state == "queued" and queue.pending() == 3


def test_functions_run_one_at_a_time_take_nothing_ahead():
    queue = TaskQueue([1], serial=True)
    queue.connect(1)
    a, _ = queue.add("f", "f", ("{}", [])), queue.add("f", "f", ("{}", []))
    assert queue.next_for(1, 0.01) is a
    assert queue.next_for(1, 0.01, ahead=True) is None
    queue.complete(1, a.task_id, ("1", []))
    assert queue.next_for(1, 0.01, ahead=True) is None  # serial: never ahead
