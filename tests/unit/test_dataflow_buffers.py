"""Process workers reuse the shared memory of a batch the consumer has let go of, never that of a
batch it still holds; every batch keeps its values either way."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from replicator.data import Dataset, Options
from replicator.data.dataflow.buffers import FREE_CAP, LENT_CAP, Leases, WorkerBuffers

pytestmark = pytest.mark.timeout(120)


def test_a_buffer_is_reused_once_no_storage_of_the_consumer_holds_it() -> None:
    reader, writer = mp.Pipe(duplex=False)
    worker, leases = WorkerBuffers(reader), Leases()
    leases.releases.append(writer)

    def batch(value: float) -> tuple[torch.Tensor, list]:
        out = torch.empty(0).set_(worker.storage(4 * 64), 0, (64,)).fill_(value)
        keys = worker.settle(True)
        leases.track(0, keys, (out, 1, []))
        return out, keys

    first, first_keys = batch(1.0)
    view = first[8:16]  # a view keeps the batch's storage
    del first
    leases.release()
    second, second_keys = batch(2.0)
    assert second_keys != first_keys and torch.equal(view, torch.full((8,), 1.0))
    del view
    leases.release()
    third, third_keys = batch(3.0)
    assert third_keys == first_keys  # the same shared-memory file, written anew
    assert torch.equal(second, torch.full((64,), 2.0))
    assert torch.equal(third, torch.full((64,), 3.0))
    assert worker.settle(False) == []
    leases.close()


def test_a_failed_task_keeps_its_buffers_for_the_next() -> None:
    reader, _writer = mp.Pipe(duplex=False)
    worker = WorkerBuffers(reader)
    worker.storage(1024)
    assert worker.settle(False) == []
    assert len(worker.free) == 1 and not worker.lent


def indexed(i):
    return torch.full((3, 16, 16), float(i)), int(i)


def test_batches_held_or_let_go_keep_their_values(monkeypatch) -> None:
    made = mp.Value("i", 0)
    new_shared = torch.UntypedStorage._new_shared

    def counted(nbytes, *args, **kwargs):
        with made.get_lock():
            made.value += 1
        return new_shared(nbytes, *args, **kwargs)

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared", staticmethod(counted))
    ds = (Dataset.from_tensor_slices(torch.arange(16 * 60)).map(indexed).batch(16).prefetch()
          .with_options(Options(worker_type="process", cpu_budget=2)))
    held = []
    for n, (x, y) in enumerate(ds):
        assert torch.equal(x[:, 0, 0, 0], y.float())
        if n % 3 == 0:
            held.append((x, y))
    assert len(held) == 20
    assert all(torch.equal(x, y.float().view(16, 1, 1, 1).expand_as(x)) for x, y in held)
    assert made.value < 40  # of 60 batches, the 40 let go were mostly written into reused memory
    ds.close()


def test_batches_kept_for_long_are_no_longer_tracked() -> None:
    reader, writer = mp.Pipe(duplex=False)
    worker, leases = WorkerBuffers(reader), Leases()
    leases.releases.append(writer)
    kept = []
    for _ in range(LENT_CAP + 8):
        out = torch.empty(0).set_(worker.storage(64), 0, (16,))
        leases.track(0, worker.settle(True), out)
        kept.append(out)
    assert len(leases.held) == LENT_CAP and len(worker.lent) == LENT_CAP
    leases.close()


def _own_shared_files(pid: int) -> int:
    names = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            names.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return sum(f"torch_{pid}_" in name for name in names)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc")
def test_idle_workers_keep_few_buffers_once_the_batches_are_let_go_of() -> None:
    ds = (Dataset.from_tensor_slices(torch.arange(16 * 40)).map(indexed).batch(16).prefetch()
          .with_options(Options(worker_type="process", cpu_budget=2)))
    held = list(ds)
    workers = [w.pid for pool in ds.runtime.pools.values() for w in pool._workers]
    assert sum(_own_shared_files(pid) for pid in workers) >= 20  # the batches held here
    del held
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
            _own_shared_files(pid) > FREE_CAP + 2 for pid in workers):
        time.sleep(0.1)
    # each keeps FREE_CAP for reuse and its last result (images, labels) until the next task
    assert all(_own_shared_files(pid) <= FREE_CAP + 2 for pid in workers)
    ds.close()


def sample_of_three(i):
    if int(i) % 7 == 3:
        raise ValueError(f"bad sample {int(i)}")
    return {"x": torch.full((2, 5), float(i)), "id": torch.tensor([i, -i]), "name": f"s{int(i)}"}


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_each_sample_lands_in_its_row_as_it_is_made_and_the_batch_is_the_stacked_one(
        monkeypatch, worker_type) -> None:
    stacks = mp.Value("i", 0)
    real_stack = torch.stack

    def counted(*args, **kwargs):
        with stacks.get_lock():
            stacks.value += 1
        return real_stack(*args, **kwargs)

    monkeypatch.setattr(torch, "stack", counted)
    ds = (Dataset.from_tensor_slices(torch.arange(8 * 12)).map(sample_of_three, on_error="skip")
          .batch(8).prefetch().with_options(Options(worker_type=worker_type, cpu_budget=2)))
    kept = [i for i in range(8 * 12) if i % 7 != 3]
    got = list(ds)
    ds.close()
    ids = torch.cat([b["id"][:, 0] for b in got]).tolist()
    assert sorted(ids) == kept  # one sample of a batch skipped: that batch is shorter
    for b in got:
        assert torch.equal(b["x"], b["id"][:, 0].float().view(-1, 1, 1).expand(-1, 2, 5))
        assert torch.equal(b["id"][:, 1], -b["id"][:, 0])
        assert b["name"] == [f"s{i}" for i in b["id"][:, 0].tolist()]
    if worker_type == "process":  # the rows were filled in place: nothing left to stack
        assert stacks.value == 0
    else:
        assert stacks.value >= 2 * len(got)


def with_empty(i):
    return torch.zeros(0), torch.full((3,), float(i)), torch.tensor(2.0)


def test_tensors_that_get_no_row_are_stacked_as_before() -> None:
    """An empty tensor gets no row; the other places of the sample still do, and the batch is
    the stacked one."""
    ds = (Dataset.from_tensor_slices(torch.arange(12)).map(with_empty).batch(4).prefetch()
          .with_options(Options(worker_type="process", cpu_budget=2)))
    got = list(ds)
    ds.close()
    assert [tuple(b[0].shape) for b in got] == [(4, 0)] * 3
    assert torch.equal(torch.cat([b[1][:, 0] for b in got]), torch.arange(12).float())
    assert all(torch.equal(b[2], torch.full((4,), 2.0)) for b in got)


def uneven(i):
    return torch.zeros(int(i) % 3 + 1)


def test_samples_of_different_shapes_are_refused_as_the_stack_refuses_them() -> None:
    ds = (Dataset.from_tensor_slices(torch.arange(8)).map(uneven).batch(4).prefetch()
          .with_options(Options(worker_type="process", cpu_budget=2)))
    with pytest.raises(Exception, match="stack expects each tensor to be equal size"):
        list(ds)
    ds.close()


def with_graph(i):
    return torch.full((2,), float(i), requires_grad=True) * 2  # a tensor with a graph


def test_a_result_the_workers_cannot_send_fails_its_task_at_once() -> None:
    """torch refuses to send a tensor with a graph between processes; the batch fails with
    torch's reason (it used to be lost in the worker, the consumer waiting out its timeout)."""
    ds = (Dataset.from_tensor_slices(torch.arange(8)).map(with_graph).batch(4).prefetch()
          .with_options(Options(worker_type="process", cpu_budget=2)))
    with pytest.raises(Exception, match="requires_grad") as err:
        list(ds)
    assert "map(with_graph)+batch(4) failed" in str(err.value)
    ds.close()
