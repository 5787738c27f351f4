"""rp.ClusterCoordinator on real processes: the chief schedules, workers run functions against
real parameter servers; values, per-worker datasets, errors with the worker's traceback, and
exactly-once updates when a worker is SIGKILLed before or after its push."""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import replicator as rp
from replicator.testing import assert_params_close
from tests.helpers import launch, make_mlp, regression_data

BATCH = 16


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``i`` of the regression data (the same on every process)."""
    x, y = regression_data().tensors
    rows = torch.randperm(len(x), generator=torch.Generator().manual_seed(i))[:BATCH]
    return x[rows], y[rows]


def scheduled_training(steps: int = 24, fail_at: int | None = None,
                       kill_after: int | None = None, flag_dir: str = "") -> dict:
    """Chief + workers + 1 server: a per-worker dataset, ``steps`` scheduled steps, join."""
    strategy = rp.ParameterServerStrategy(num_ps=1)
    coordinator = rp.ClusterCoordinator(strategy)
    with strategy.scope():
        model = make_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def input_fn(ctx: rp.InputContext):
        loader = DataLoader(regression_data(), batch_size=BATCH, shuffle=True,
                            generator=torch.Generator().manual_seed(ctx.input_pipeline_id))
        while True:
            yield from loader

    def step(it, i):
        x, y = next(it)
        if i == fail_at:
            raise ValueError(f"bad batch {i}")
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if kill_after is not None and i == kill_after and _first_time(flag_dir, "after"):
            os.kill(os.getpid(), signal.SIGKILL)  # after the push: the update is committed
        return {"loss": loss.detach(), "i": i, "rank": strategy.replica_id}

    it = iter(coordinator.create_per_worker_dataset(input_fn))
    values = [coordinator.schedule(step, args=(it, i)) for i in range(steps)]
    error = ""
    try:
        coordinator.join()
    except rp.ps.RemoteFunctionError as exc:
        error = str(exc)
    done = [v.fetch() for v in values[: (fail_at if fail_at is not None else steps)]]
    # after an error, the coordinator goes on
    again = coordinator.schedule(step, args=(it, -1)).fetch()
    return {"done": done, "error": error, "again": again, "stats": coordinator.stats(),
            "finished": coordinator.done(), "chief": coordinator.is_chief,
            "versions": strategy.shard_versions(), "tasks": strategy.task_stats()}


@pytest.mark.timeout(180)
def test_schedule_join_fetch_on_two_workers_with_a_per_worker_dataset():
    out = launch(scheduled_training, num_replicas=4, num_ps=1, timeout_seconds=60)
    chief, w1, w2, server = out
    assert server is None and chief["chief"] and not w1["chief"]
    assert [d["i"] for d in chief["done"]] == list(range(24))
    assert {d["rank"] for d in chief["done"]} <= {1, 2}  # the chief only schedules
    assert chief["error"] == "" and chief["finished"]
    assert chief["again"]["i"] == -1
    # every worker's mirror of fetch() returned the chief's values
    for w in (w1, w2):
        assert [d["i"] for d in w["done"]] == list(range(24))
        assert torch.equal(w["done"][5]["loss"], chief["done"][5]["loss"])
    # one update per function: every shard was stepped 25 times
    assert all(v["version"] == 25 for v in chief["versions"])
    assert chief["stats"]["reruns"] == 0


@pytest.mark.timeout(180)
def test_asynchronous_worker_killed_after_its_push_is_not_applied_twice(tmp_path, capfd):
    # with a restart allowed: the restarted worker is not handed functions (the chief does not
    # replay its calls to a newcomer); it says so and ends cleanly, and the job finishes
    out = launch(scheduled_training, num_replicas=4, num_ps=1,
                 kwargs={"kill_after": 7, "flag_dir": str(tmp_path)}, timeout_seconds=60,
                 max_restarts=1)
    chief = out[0]
    assert out[1] is None or out[2] is None  # the worker that ran step 7 was killed
    err = capfd.readouterr().err
    assert "restarting it alone" in err, err[-3000:]
    assert "under a ClusterCoordinator a lost worker is not replaced" in err, err[-3000:]
    assert [d["i"] for d in chief["done"]] == list(range(24))  # step 7's value, from its rerun
    assert chief["stats"]["reruns"] == 1
    assert chief["tasks"] == {"applied": 25, "repeats": 1, "repeats_seen": 0}
    assert all(v["version"] == 25 for v in chief["versions"])  # 24 steps + 1, each once


@pytest.mark.timeout(180)
def test_an_error_names_the_worker_and_its_traceback_and_cancels_the_rest():
    out = launch(scheduled_training, num_replicas=3, num_ps=1, kwargs={"fail_at": 4},
                 timeout_seconds=60)
    chief = out[0]
    assert "ValueError: bad batch 4" in chief["error"]
    assert "worker rank 1" in chief["error"] and "worker traceback" in chief["error"]
    assert "in step" in chief["error"]  # the worker's own frame
    assert out[1]["error"] == chief["error"].split(": ", 1)[1] or "bad batch 4" in out[1]["error"]
    # functions 0-3 ran (one worker, in order); 5.. were cancelled, then one more ran
    assert [d["i"] for d in chief["done"]] == [0, 1, 2, 3]
    assert all(v["version"] == 5 for v in chief["versions"])


STEPS = 16
KILL_BEFORE, KILL_AFTER, KILL_BETWEEN = 5, 11, 8


def _first_time(flag_dir: str, name: str) -> bool:
    """True for the first process to get here (an exclusive create): a re-run does not kill."""
    try:
        os.close(os.open(os.path.join(flag_dir, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def train_serial(kind: str, flag_dir: str = "", between: bool = False) -> dict:
    """16 SGD-with-momentum steps on batches 0..15, one device or scheduled with staleness=0
    on 3 workers + 2 servers; the worker running step 5 is SIGKILLed before its push, the one
    running step 11 after it (``between``: instead, the worker running step 8 is SIGKILLed
    after server 0 applied its update and before server 1 did)."""
    current = [-1]
    if kind != "one_device" and between:
        from replicator import fault_points

        def die(**_: object) -> None:
            if current[0] == KILL_BETWEEN and _first_time(flag_dir, "between"):
                os.kill(os.getpid(), signal.SIGKILL)

        fault_points.add_hook("between_server_commits", die)
    if kind == "one_device":
        strategy: rp.Strategy = rp.OneDeviceStrategy("cpu")
    else:
        strategy = rp.ParameterServerStrategy(
            num_ps=2, staleness=0, variable_partitioner=rp.ps.FixedShardsPartitioner(2))
        coordinator = rp.ClusterCoordinator(strategy)
    with strategy.scope():
        model = make_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    kills = kind != "one_device" and not between

    def step(i):
        current[0] = i
        x, y = _batch(i)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if kills and i == KILL_BEFORE and _first_time(flag_dir, "before"):
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.step()
        optimizer.zero_grad()
        if kills and i == KILL_AFTER and _first_time(flag_dir, "after"):
            os.kill(os.getpid(), signal.SIGKILL)
        return loss.detach()

    if kind == "one_device":
        losses = [float(step(i)) for i in range(STEPS)]
        return {"params": {k: v.clone() for k, v in model.state_dict().items()},
                "losses": losses}
    values = [coordinator.schedule(step, args=(i,)) for i in range(STEPS)]
    coordinator.join()
    losses = [float(v.fetch()) for v in values]
    strategy.pull()
    return {"params": {k: v.clone() for k, v in model.state_dict().items()}, "losses": losses,
            "stats": coordinator.stats(), "tasks": strategy.task_stats(),
            "versions": strategy.shard_versions(), "chief": coordinator.is_chief}


@pytest.mark.timeout(240)
def test_staleness0_exactly_once_with_workers_killed_before_and_after_their_push(tmp_path):
    ref = train_serial("one_device")
    out = launch(train_serial, num_replicas=6, num_ps=2, args=("ps", str(tmp_path)),
                 timeout_seconds=60)
    chief = out[0]
    assert chief["chief"] and out[4] is None and out[5] is None
    assert sum(o is None for o in out[1:4]) == 2  # two of the three workers were killed
    stats = chief["stats"]
    assert stats["reruns"] == 2 and len(stats["lost_workers"]) == 2, stats
    assert stats["commit_order"] == list(range(STEPS))  # one at a time, in schedule order
    # every update applied once: the re-run after the push was turned away by both servers
    assert chief["tasks"]["repeats"] == 2 and chief["tasks"]["applied"] == 2 * STEPS
    assert all(v["version"] == STEPS for v in chief["versions"])
    # serializable: the same parameters (and momentum) as one device fed batches 0..15
    assert_params_close(ref["params"], chief["params"], atol=1e-5)
    # the step killed before its push ran again from the same parameters; the one killed
    # after its push ran again for its value, reading its own committed update
    same = [i for i in range(STEPS) if i != KILL_AFTER]
    assert [chief["losses"][i] for i in same] == pytest.approx([ref["losses"][i] for i in same],
                                                              abs=1e-5)


@pytest.mark.timeout(240)
def test_staleness0_worker_killed_between_two_servers_commits_is_applied_once(tmp_path):
    """The update of step 8 reached server 0 and not server 1 when its worker died: the re-run
    (which reads server 0's half of it) commits the first attempt's update on server 1, so
    each half is applied once and the run still equals one device."""
    ref = train_serial("one_device")
    out = launch(train_serial, num_replicas=5, num_ps=2, args=("ps", str(tmp_path), True),
                 timeout_seconds=60)
    chief = out[0]
    assert chief["chief"] and sum(o is None for o in out[1:3]) == 1, out
    assert chief["stats"]["reruns"] == 1, chief["stats"]
    assert chief["tasks"]["repeats"] == 1 and chief["tasks"]["applied"] == 2 * STEPS
    assert all(v["version"] == STEPS for v in chief["versions"])
    assert_params_close(ref["params"], chief["params"], atol=1e-5)


def lose_a_server_under_the_coordinator() -> dict:
    """2 workers + 2 servers under a coordinator; the chief SIGKILLs server 1 after 6 of 16
    scheduled steps have completed, and schedules the rest."""
    strategy = rp.ParameterServerStrategy(
        num_ps=2, staleness=0, timeout_seconds=20,
        variable_partitioner=rp.ps.FixedShardsPartitioner(2))
    coordinator = rp.ClusterCoordinator(strategy)
    with strategy.scope():
        model = make_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(i):
        x, y = _batch(i)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        return i

    first = [coordinator.schedule(step, args=(i,)) for i in range(6)]
    coordinator.join()
    os.kill(strategy.server_pids[1], signal.SIGKILL)
    for i in range(6, STEPS):
        coordinator.schedule(step, args=(i,))
    coordinator.join()
    return {"first": [v.fetch() for v in first]}


@pytest.mark.timeout(180)
def test_a_server_lost_under_the_coordinator_stops_the_job_naming_it():
    with pytest.raises(rp.WorkerFailedError) as info:
        launch(lose_a_server_under_the_coordinator, num_replicas=5, num_ps=2,
               timeout_seconds=20)
    # the launcher stops the job at the server's death and names it first (the cause), not
    # the chief or a worker whose request failed after it
    assert str(info.value).startswith("rank 4 failed (exit code -9): parameter server 1 was "
                                      "killed by SIGKILL"), str(info.value)


def train_async_killed_between_pushes(flag_dir: str) -> dict:
    """16 steps scheduled asynchronously on 2 workers + 2 servers; the worker running step 8
    is SIGKILLed after its push reached server 0 and before it reached server 1."""
    from replicator import fault_points

    current = [-1]

    def die(**_: object) -> None:
        if current[0] == KILL_BETWEEN and _first_time(flag_dir, "between"):
            os.kill(os.getpid(), signal.SIGKILL)

    fault_points.add_hook("between_server_pushes", die)
    strategy = rp.ParameterServerStrategy(
        num_ps=2, variable_partitioner=rp.ps.FixedShardsPartitioner(2))
    coordinator = rp.ClusterCoordinator(strategy)
    with strategy.scope():
        model = make_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(i):
        current[0] = i
        x, y = _batch(i)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    values = [coordinator.schedule(step, args=(i,)) for i in range(STEPS)]
    coordinator.join()
    return {"losses": [float(v.fetch()) for v in values], "stats": coordinator.stats(),
            "tasks": strategy.task_stats(), "versions": strategy.shard_versions(),
            "chief": coordinator.is_chief}


@pytest.mark.timeout(240)
def test_asynchronous_worker_killed_between_two_servers_pushes_is_applied_once(tmp_path):
    """Asynchronous functions push to each server in one round trip: server 0 applied step 8's
    part of the killed attempt and turns the re-run's away; server 1 applies the re-run's."""
    out = launch(train_async_killed_between_pushes, num_replicas=5, num_ps=2,
                 args=(str(tmp_path),), timeout_seconds=60)
    chief = out[0]
    assert chief["chief"] and sum(o is None for o in out[1:3]) == 1, out
    assert chief["stats"]["reruns"] == 1, chief["stats"]
    assert chief["tasks"]["repeats"] == 1 and chief["tasks"]["applied"] == 2 * STEPS
    assert all(v["version"] == STEPS for v in chief["versions"]), chief["versions"]
    assert len(chief["losses"]) == STEPS and all(math.isfinite(v) for v in chief["losses"])
