"""ParameterServerStrategy with staleness=0 equals one device with the same global batch, as
Mirrored does (real processes; variables on real parameter-server processes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import replicator as rp
from replicator.testing import assert_params_close
from tests.helpers import launch, make_mlp, regression_data

STEPS = 20
GLOBAL_BATCH = 32


def batches(strategy: rp.Strategy):
    """The strategy's split of the global batches, epoch after epoch (20 batches an epoch)."""
    loader = DataLoader(regression_data(), batch_size=GLOBAL_BATCH, shuffle=True)
    data = strategy.distribute_dataset(loader, seed=3)
    while True:
        yield from data


def train(kind: str, num_ps: int = 1, shards: int = 0, momentum: float = 0.0,
          steps: int = STEPS) -> dict:
    """20 SGD steps of the MLP under ``kind``; returns the parameters and what the strategy
    measured (optimizer state held by the worker, shard versions, placement)."""
    if kind == "ps":
        part = rp.ps.partitioners.MinSizePartitioner(min_shard_bytes=512, max_shards=shards) \
            if shards else None
        strategy: rp.Strategy = rp.ParameterServerStrategy(num_ps=num_ps, staleness=0,
                                                           variable_partitioner=part)
    else:
        strategy = rp.OneDeviceStrategy("cpu")
    with strategy.scope():
        model = make_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)

    def step(batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return strategy.reduce("mean", loss.detach())

    it = batches(strategy)
    losses = [float(strategy.run(step, args=(next(it),))) for _ in range(steps)]
    out = {"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
           "losses": losses, "worker_optimizer_state": len(optimizer.state)}
    if isinstance(strategy, rp.ParameterServerStrategy):
        out["versions"] = strategy.shard_versions()
        out["placement"] = strategy.placement()
        out["stats"] = strategy.staleness_stats()
    return out


@pytest.mark.timeout(120)
def test_one_worker_one_server_sync_equals_one_device():
    ref = train("one_device")
    out = launch(train, num_replicas=2, num_ps=1, args=("ps",), timeout_seconds=60)
    assert out[1] is None  # the server's process returns nothing
    assert_params_close(ref["params"], out[0]["params"], atol=1e-6)
    assert ref["losses"][-1] < ref["losses"][0]
    assert out[0]["worker_optimizer_state"] == 0  # the server owns the optimizer state
    assert all(v["version"] == STEPS for v in out[0]["versions"])


@pytest.mark.timeout(180)
def test_two_workers_sync_equal_global_batch_with_one_and_two_servers():
    # Mirrored on 2 replicas equals one device with the same global batch
    # (test_equivalence.py); staleness=0 on 2 workers is held to the same reference.
    ref = train("one_device", momentum=0.9)
    one = launch(train, num_replicas=3, num_ps=1, args=("ps",), kwargs={"momentum": 0.9},
                 timeout_seconds=60)
    assert_params_close(ref["params"], one[0]["params"], atol=1e-5)
    assert_params_close(one[0]["params"], one[1]["params"], atol=0.0)  # workers agree
    assert one[0]["losses"] == pytest.approx(ref["losses"], abs=1e-5)  # reduce() over workers
    two = launch(train, num_replicas=4, num_ps=2, args=("ps",),
                 kwargs={"momentum": 0.9, "shards": 2, "num_ps": 2}, timeout_seconds=60)
    assert_params_close(ref["params"], two[0]["params"], atol=1e-5)
    split = [p for p in two[0]["placement"] if p["shards"] == 2]
    assert split, "the partitioner split no weight"
    assert {p["server"] for p in split if p["name"] == split[0]["name"]} == {0, 1}
    assert two[0]["worker_optimizer_state"] == 0
    assert all(v["version"] == STEPS for v in two[0]["versions"])
    assert two[0]["stats"]["max"] == 0 and two[0]["stats"]["count"] > 0


KILL_AT = 25
SAVE_EVERY = 10


def train_and_lose_a_server(checkpoint_dir: str, steps: int = 40) -> dict:
    """2 workers + 2 servers, staleness=0; the chief saves the servers' state every 10 steps
    and, in the first attempt, kills server 1 after step 25."""
    import os
    import signal

    strategy = rp.ParameterServerStrategy(num_ps=2, staleness=0, checkpoint_dir=checkpoint_dir,
                                          timeout_seconds=20)
    with strategy.scope():
        model = make_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return strategy.reduce("mean", loss.detach())

    start = strategy.restored_step or 0
    data = batches(strategy)
    for _ in range(start):  # the data position: skip what the checkpoint already holds
        next(data)
    losses = []
    attempt = int(os.environ.get("REPLICATOR_RESTART_COUNT", "0"))
    for i in range(start, steps):
        losses.append(float(strategy.run(step, args=(next(data),))))
        done = i + 1
        if done % SAVE_EVERY == 0:
            strategy.save_checkpoint(done, data_position={"step": done})
        if attempt == 0 and done == KILL_AT and strategy.is_chief:
            os.kill(strategy.server_pids[1], signal.SIGKILL)
    return {"start": start, "data": strategy.restored_data_position,
            "versions": strategy.shard_versions(), "losses": losses,
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.mark.timeout(180)
def test_lost_server_is_a_named_error_on_every_worker(tmp_path):
    with pytest.raises(rp.WorkerFailedError) as info:
        launch(train_and_lose_a_server, num_replicas=4, num_ps=2, args=(str(tmp_path),),
               timeout_seconds=20)
    text = str(info.value)
    # both workers failed by themselves (not stopped by the launcher), naming the server and
    # the variables it held
    for rank in (0, 1):
        line = next(line for line in [text, *info.value.others] if f"rank {rank}" in line)
        assert "ParameterServerLostError" in line, text
    assert "parameter server 1 (rank 3) is lost with the" in text
    held = [line for line in info.value.others if "rank 0" in line][0]
    assert "weight" in held or "bias" in held


@pytest.mark.timeout(240)
def test_lost_server_restarts_from_the_servers_checkpoint(tmp_path):
    out = launch(train_and_lose_a_server, num_replicas=4, num_ps=2, args=(str(tmp_path),),
                 timeout_seconds=20, max_restarts=1)
    chief = out[0]
    assert chief["start"] == 20 and chief["data"] == {"step": 20}
    assert all(v["version"] == 40 for v in chief["versions"]), chief["versions"]
    ref = train("one_device", momentum=0.9, steps=40)
    # the restart resumed the same global batches from the same variables and momentum
    assert_params_close(ref["params"], chief["params"], atol=1e-5)


SCRIPT = '''
import torch
import replicator as rp

strategy = rp.ParameterServerStrategy()          # num_ps comes from --num-ps
with strategy.scope():
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(64, 4, generator=torch.Generator().manual_seed(0)), torch.zeros(64, 1)
for _ in range(5):
    def step(x, y):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward(); optimizer.step(); optimizer.zero_grad()
        return loss
    strategy.run(step, args=(x, y))
print(f"worker {strategy.replica_id} of {strategy.num_replicas_in_sync} done, "
      f"servers {strategy.num_ps}, stale {strategy.staleness_stats()['count'] > 0}")
'''


@pytest.mark.timeout(120)
def test_replicator_run_with_num_ps(tmp_path, capfd):
    from replicator.cli import main

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    # the command line's own main in this process (one fresh interpreter fewer); the workers
    # and the server are new processes, their output reaches this process's stdout
    code = main(["run", "--nproc", "3", "--num-ps", "1", "--timeout", "60", str(script)])
    out = capfd.readouterr()
    assert code == 0, out.err
    assert "worker 0 of 2 done, servers 1, stale True" in out.out
    assert "worker 1 of 2 done" in out.out
    assert "[rank 2]" not in out.out  # the server ran no training loop
    # refused before anything starts
    assert main(["run", "--nproc", "2", "--num-ps", "2", str(script)]) == 2
    assert "leaves no worker" in capfd.readouterr().err
