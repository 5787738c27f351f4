"""Asynchronous and bounded-staleness ParameterServerStrategy on real processes: a CNN on the
digits reaches the accuracy, versions count the updates, staleness stays within its bound."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import replicator as rp
from tests.helpers import launch

PER_WORKER_BATCH = 16


def train_digits(staleness: int | None = None, steps: int = 120, num_ps: int = 2,
                 shards: int = 2, slow_rank: int | None = None, slow_seconds: float = 0.0
                 ) -> dict:
    """Train the digits CNN for ``steps`` steps per worker; the chief reports test accuracy."""
    from replicator.demo.digits import DigitsCNN, load_digits_split

    part = rp.ps.partitioners.FixedShardsPartitioner(shards) if shards else None
    strategy = rp.ParameterServerStrategy(num_ps=num_ps, staleness=staleness,
                                          variable_partitioner=part)
    with strategy.scope():
        torch.manual_seed(0)
        model = DigitsCNN()
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

    def step(batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if strategy.replica_id == slow_rank:
            time.sleep(slow_seconds)  # a straggler: slow between its pull and its push
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    train, test = load_digits_split()
    loader = DataLoader(train, batch_size=PER_WORKER_BATCH * strategy.num_replicas_in_sync,
                        shuffle=True, drop_last=True)
    data = strategy.distribute_dataset(loader, seed=0)
    # start together: a worker whose process came up late would otherwise train after the
    # others had finished, and no update would be stale at all
    strategy.collectives.barrier()
    done = 0
    while done < steps:
        for batch in data:
            strategy.run(step, args=(batch,))
            done += 1
            if done == steps:
                break
    strategy.collectives.barrier()  # every worker has pushed its last update
    strategy.pull()
    with torch.no_grad():
        x, y = test.tensors
        accuracy = float((model(x).argmax(1) == y).float().mean())
    return {"accuracy": accuracy, "steps": strategy.steps_pushed,
            "stats": strategy.staleness_stats(), "versions": strategy.shard_versions(),
            "placement": strategy.placement(), "optimizer_state": len(optimizer.state)}


@pytest.mark.timeout(180)
def test_async_three_workers_two_servers_sharded_digits():
    # 200 steps per worker: with every worker starting together the updates are staler than
    # when they trickle in, and 120 steps left the accuracy at the goal's edge (0.944 and
    # 0.964 in two runs; 200 steps: 0.983)
    out = launch(train_digits, num_replicas=5, num_ps=2, kwargs={"steps": 200},
                 timeout_seconds=60)
    workers = out[:3]
    assert out[3] is None and out[4] is None
    assert workers[0]["accuracy"] >= 0.95, workers[0]["accuracy"]
    total = sum(w["steps"] for w in workers)
    assert total == 3 * 200
    # every shard was updated once per push of every worker, never lost nor doubled
    versions = workers[0]["versions"]
    assert {v["server"] for v in versions} == {0, 1}
    assert all(v["version"] == total for v in versions), versions
    stats = workers[0]["stats"]
    assert stats["count"] == total * len(versions)
    assert sum(stats["histogram"].values()) == stats["count"]
    assert stats["max"] >= 1  # three workers pushing freely: some updates are stale
    assert all(w["optimizer_state"] == 0 for w in workers)


@pytest.mark.timeout(180)
def test_bounded_staleness_with_a_slow_worker():
    kwargs = {"steps": 25, "num_ps": 1, "shards": 0, "slow_rank": 1, "slow_seconds": 0.05}
    free = launch(train_digits, num_replicas=3, num_ps=1, kwargs=kwargs, timeout_seconds=60)
    bounded = launch(train_digits, num_replicas=3, num_ps=1, kwargs={**kwargs, "staleness": 2},
                     timeout_seconds=60)
    # without a bound the fast worker runs far ahead of the slow one
    assert free[0]["stats"]["max"] > 2, free[0]["stats"]
    stats = bounded[0]["stats"]
    assert stats["max"] <= 2, stats
    assert set(stats["histogram"]) <= {0, 1, 2}
    assert stats["histogram"].get(2, 0) > 0  # the bound was reached, and held


def train_and_lose_a_worker(epochs: int = 4, kill_rank: int = 2, kill_step: int = 30,
                            rejoin_flag: str | None = None, started_flag: str | None = None
                            ) -> dict:
    """3 workers + 2 servers, asynchronous; worker ``kill_rank`` SIGKILLs itself at global
    step ``kill_step`` (once the servers applied ``kill_step`` updates per worker). The
    survivors train ``epochs`` epochs of claimed batches. With ``rejoin_flag`` (a file path),
    the restarted worker creates the file after its first step, and the survivors wait for it
    at their step 25, so that training outlasts the restarted process's start. With
    ``started_flag``, the same for the first start of ``kill_rank`` at the survivors' step 5
    (on a busy machine it could start after the others had claimed every batch)."""
    import os
    import signal

    from replicator.demo.digits import DigitsCNN, load_digits_split

    strategy = rp.ParameterServerStrategy(
        num_ps=2, variable_partitioner=rp.ps.partitioners.FixedShardsPartitioner(2))
    with strategy.scope():
        torch.manual_seed(0)
        model = DigitsCNN()
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

    def step(batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    train, test = load_digits_split()
    loader = DataLoader(train, batch_size=PER_WORKER_BATCH * strategy.num_replicas_in_sync,
                        shuffle=True, drop_last=True)
    data = strategy.distribute_dataset(loader, seed=0)
    steps = 0
    for _ in range(epochs):
        for batch in data:
            strategy.run(step, args=(batch,))
            steps += 1
            if rejoin_flag and strategy.rejoined and steps == 1:
                open(rejoin_flag, "w").close()
            if started_flag and strategy.replica_id == kill_rank and steps == 1:
                open(started_flag, "w").close()
            if started_flag and strategy.replica_id != kill_rank and steps == 5:
                deadline = time.monotonic() + 90
                while not os.path.exists(started_flag) and time.monotonic() < deadline:
                    time.sleep(0.05)
            if rejoin_flag and strategy.replica_id != kill_rank and steps == 25:
                deadline = time.monotonic() + 90
                while not os.path.exists(rejoin_flag) and time.monotonic() < deadline:
                    time.sleep(0.1)
            if strategy.replica_id == kill_rank and not strategy.rejoined and \
                    strategy.shard_versions()[0]["version"] >= kill_step * 3:
                os.kill(os.getpid(), signal.SIGKILL)
    if rejoin_flag:
        # the restarted worker reports the model the job ends with: it waits for the others
        survivors = [r for r in range(strategy.num_replicas_in_sync) if r != kill_rank]
        if strategy.replica_id != kill_rank:
            open(f"{rejoin_flag}.done{strategy.replica_id}", "w").close()
        else:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and not all(
                    os.path.exists(f"{rejoin_flag}.done{r}") for r in survivors):
                time.sleep(0.1)
    # an epoch ends for a worker only when every batch of it is consumed: nothing is pending
    strategy.pull()
    with torch.no_grad():
        x, y = test.tensors
        accuracy = float((model(x).argmax(1) == y).float().mean())
    return {"accuracy": accuracy, "steps": steps, "accounting": strategy.data_accounting(),
            "versions": strategy.shard_versions(), "batches": len(data),
            "rejoined": strategy.rejoined, "optimizer_state": len(optimizer.state)}


@pytest.mark.timeout(180)
def test_lost_worker_others_finish_and_every_batch_is_consumed_once(tmp_path):
    out = launch(train_and_lose_a_worker, num_replicas=5, num_ps=2, timeout_seconds=60,
                 kwargs={"started_flag": str(tmp_path / "started")})
    assert out[2] is None  # the lost worker
    chief = out[0]
    # asynchronous around a kill: the accuracy varies with timing (0.90-0.96 seen); an
    # untrained model scores about 0.1, so 0.8 separates trained from not without flaking
    assert chief["accuracy"] >= 0.8, chief["accuracy"]
    accounting = chief["accounting"]
    assert sorted(accounting) == [0, 1, 2, 3]
    for epoch, acc in accounting.items():
        # exactly once: every batch of every epoch consumed by one applied update
        assert acc["consumed"] == acc["batches"] == chief["batches"], (epoch, acc)
        assert acc["repeated"] == 0 and acc["in_flight"] == 0, (epoch, acc)
        assert sum(acc["by_worker"].values()) == acc["batches"]
    lost = sum(e["by_worker"].get(2, 0) for e in accounting.values())
    assert lost >= 1  # the lost worker's updates before it died count once, like any other
    assert accounting[3]["by_worker"].get(2, 0) == 0
    updates = sum(acc["consumed"] for acc in accounting.values())
    assert all(v["version"] == updates for v in chief["versions"])
    assert out[1]["steps"] + chief["steps"] + lost == updates


@pytest.mark.timeout(180)
def test_lost_worker_restarted_alone_rejoins_and_continues(tmp_path):
    out = launch(train_and_lose_a_worker, num_replicas=5, num_ps=2,
                 kwargs={"epochs": 6, "kill_step": 10, "rejoin_flag": str(tmp_path / "back")},
                 timeout_seconds=120, max_restarts=1)
    rejoined = out[2]
    assert rejoined is not None and rejoined["rejoined"], rejoined
    assert rejoined["steps"] > 0  # it pulled the current values and trained on new batches
    # asynchronous updates around a kill and a restart: the final accuracy varies with timing
    # (0.8997-0.96 seen, the low one in a CI run); a model that missed the training scores
    # about 0.1, so 0.8 tells that the rejoined worker holds the trained one without flaking
    assert rejoined["accuracy"] >= 0.8, rejoined["accuracy"]
    assert rejoined["optimizer_state"] == 0
    accounting = out[0]["accounting"]
    assert len(accounting) == 6
    for epoch, acc in accounting.items():
        assert acc["consumed"] == acc["batches"] and acc["repeated"] == 0, (epoch, acc)
    assert sum(acc["by_worker"].get(2, 0) for acc in accounting.values()) > rejoined["steps"]
