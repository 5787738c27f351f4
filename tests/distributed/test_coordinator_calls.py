"""Which ClusterCoordinator calls the workers must share, on real processes: ``fetch()`` and
``done()`` need nothing from the workers (a result read on the chief only, as tf.distribute users
do), ``schedule``/``join``/``create_per_worker_dataset`` must match on every process (a mismatch
is an error naming both sides, within the timeout), and an error is the same exception class on
every process."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import replicator as rp
from tests.helpers import launch

ROWS, DIM, BATCH = 400, 4, 8


class Toy(nn.Module):
    """DLRM-like: a sparse embedding table (split over the servers) and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(ROWS, DIM, sparse=True)
        self.head = nn.Linear(2 * DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids).flatten(1)).squeeze(1)


def _setup(timeout: float = 30.0, worker_delay: float = 0.0):  # type: ignore[no-untyped-def]
    strategy = rp.ParameterServerStrategy(
        num_ps=2, staleness=0, timeout_seconds=timeout,
        variable_partitioner=rp.ps.MaxSizePartitioner(max_shard_bytes=ROWS * DIM * 2))
    if not strategy.is_chief:
        time.sleep(worker_delay)  # a worker slow to start (a busy host)
    coordinator = rp.ClusterCoordinator(strategy)
    with strategy.scope():
        model = Toy()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(it):
        ids, y = next(it)
        loss = F.binary_cross_entropy_with_logits(model(ids), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return strategy, coordinator, step


def _input_fn(seed: int):  # type: ignore[no-untyped-def]
    def input_fn(ctx: rp.InputContext):
        g = torch.Generator().manual_seed(seed + ctx.input_pipeline_id)
        while True:
            yield (torch.randint(0, ROWS, (BATCH, 2), generator=g),
                   torch.randint(0, 2, (BATCH,), generator=g).float())
    return input_fn


def read_results(everywhere: bool) -> dict:
    """20 functions scheduled and joined; their values fetched (on the chief only unless
    ``everywhere``); a new per-worker dataset and a 2 s function on every process, whose value
    and ``done()`` the chief (or every process) reads."""
    strategy, coordinator, step = _setup()
    it = iter(coordinator.create_per_worker_dataset(_input_fn(0)))
    values = [coordinator.schedule(step, args=(it,)) for _ in range(20)]
    coordinator.join()
    out: dict = {"chief": coordinator.is_chief}
    if everywhere or coordinator.is_chief:
        out["losses"] = [float(v.fetch()) for v in values]
    it2 = iter(coordinator.create_per_worker_dataset(_input_fn(100)))

    def slow(it):
        time.sleep(2.0)
        return step(it)

    last = coordinator.schedule(slow, args=(it2,))
    if everywhere or coordinator.is_chief:
        out["last"] = float(last.fetch())
        out["done"] = coordinator.done()
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("everywhere", [False, True], ids=["chief_only", "every_process"])
def test_fetch_and_done_on_the_chief_only_or_on_every_process(everywhere, capfd):
    out = launch(read_results, num_replicas=5, num_ps=2, args=(everywhere,),
                 timeout_seconds=30)
    assert "never started a parameter server" not in capfd.readouterr().err
    chief = out[0]
    assert chief["chief"] and len(chief["losses"]) == 20 and chief["done"] is True
    assert chief["last"] == chief["last"]  # a number (not NaN)
    for worker in out[1:3]:
        assert not worker["chief"]
        if everywhere:  # a worker's fetch() returns the chief's values
            assert worker["losses"] == chief["losses"] and worker["last"] == chief["last"]
            assert worker["done"] is True
        else:
            assert "losses" not in worker


def chief_schedules_more() -> None:
    """The chief alone schedules a second function, then every process joins."""
    _, coordinator, step = _setup(timeout=60.0)
    it = iter(coordinator.create_per_worker_dataset(_input_fn(0)))
    coordinator.schedule(step, args=(it,))
    if coordinator.is_chief:
        coordinator.schedule(step, args=(it,))
    coordinator.join()


@pytest.mark.timeout(120)
def test_a_function_scheduled_on_the_chief_only_is_a_mismatch_not_a_timeout():
    with pytest.raises(rp.WorkerFailedError) as info:
        launch(chief_schedules_more, num_replicas=5, num_ps=2, timeout_seconds=60)
    text = str(info.value)
    # found as soon as every worker waits in join() having scheduled one function, not after
    # the 60 s timeout as NoWorkerError
    assert "CallMismatchError" in text and "NoWorkerError" not in text, text
    assert "(schedule #1) but no worker can run it" in text, text
    assert "worker rank 1 waits in coordinator.join() (call 1) having scheduled 1" in text, text


def chief_creates_a_dataset(worker_delay: float = 0.0) -> None:
    """The chief alone creates a per-worker dataset, then every process joins."""
    _, coordinator, _ = _setup(worker_delay=worker_delay)
    if coordinator.is_chief:
        coordinator.create_per_worker_dataset(_input_fn(0))
    coordinator.join()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("worker_delay", [0.0, 3.0], ids=["together", "workers_late"])
def test_a_dataset_created_on_the_chief_only_is_a_mismatch_at_join(worker_delay):
    # workers_late: the chief's script ends before any worker connects; it waits for them
    # (they get its markers and find the mismatch), not closing the socket in their faces
    with pytest.raises(rp.WorkerFailedError) as info:
        launch(chief_creates_a_dataset, args=(worker_delay,), num_replicas=5, num_ps=2,
               timeout_seconds=30)
    text = str(info.value)
    assert "CallMismatchError: worker rank" in text, text
    assert "reached coordinator.join() (call 1) with 0 function(s) scheduled, 0 per-worker " \
           "dataset(s)" in text and "the chief with 0 function(s) scheduled, 1 per-worker" \
           in text, text


def errors_everywhere() -> dict:
    """A function raises and cancels the queued ones; the classes every process sees."""
    _, coordinator, _ = _setup()

    def boom(i):
        if i == 0:
            raise ValueError("bad input")
        return i

    values = [coordinator.schedule(boom, args=(i,)) for i in range(4)]
    seen = {}
    for name, call in (("join", coordinator.join), ("fetch_failed", values[0].fetch),
                       ("fetch_cancelled", values[2].fetch),
                       ("schedule_object", lambda: coordinator.schedule(boom, args=(object(),)))):
        try:
            call()
            seen[name] = None
        except rp.ps.ParameterServerError as exc:
            seen[name] = type(exc).__name__
    seen["again"] = coordinator.schedule(boom, args=(7,)).fetch()
    return seen


@pytest.mark.timeout(120)
def test_every_process_raises_the_same_exception_class():
    out = launch(errors_everywhere, num_replicas=5, num_ps=2, timeout_seconds=30)
    expected = {"join": "RemoteFunctionError", "fetch_failed": "RemoteFunctionError",
                "fetch_cancelled": "TaskCancelledError",
                "schedule_object": "ParameterServerError", "again": 7}
    for rank in range(3):
        assert out[rank] == expected, (rank, out[rank])
