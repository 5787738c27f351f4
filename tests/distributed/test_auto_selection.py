"""``CommunicationOptions(implementation="auto")``: the fastest correct algorithm by default.

On one host the default MirroredStrategy reports shared memory, keeps its gradient buckets in
the segment and trains like one device; with shared memory unusable it falls back to gloo and
still trains; with replicas declared on two hosts it is hierarchical.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import replicator as rp
from replicator.cluster.environment import resolve_cluster
from replicator.comm.selection import describe_auto, shared_memory_problem
from replicator.testing import assert_params_close, run_distributed
from tests.helpers import make_mlp, regression_data

STEPS = 8
GLOBAL_BATCH = 16


def train(strategy: rp.Strategy, keep: list | None = None) -> dict:
    with strategy.scope():
        model = make_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if keep is not None:
        keep.append(model)  # its gradient synchronizer lives as long as the model

    def step(batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    loader = DataLoader(regression_data(), batch_size=GLOBAL_BATCH, shuffle=True)
    it = iter(strategy.distribute_dataset(loader, seed=3))
    for _ in range(STEPS):
        strategy.run(step, args=(next(it),))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_default(_: int) -> dict:
    strategy = rp.MirroredStrategy()
    models: list = []
    params = train(strategy, models)
    algo = strategy.cross_device_ops
    sync = strategy._replica_group.synchronizers[0]
    resident = [algo._resident_for(b.buffer, None) is not None for b in sync.buckets] \
        if hasattr(algo, "_resident_for") else []
    return {"algorithm": algo.name, "params": params, "resident": resident}


def _train_without_room_for_buckets(_: int) -> dict:
    from replicator.comm import shared_memory
    from replicator.errors import ReplicatorError

    strategy = rp.MirroredStrategy()
    algo = strategy.cross_device_ops
    algo.channel(None)  # the 4 MB slots exist; the buckets' segment will not fit

    def full(*args: object, **kwargs: object) -> None:
        raise ReplicatorError("No space left on device (simulated)")

    shared_memory.SharedSegment.create = full  # type: ignore[method-assign, assignment]
    models: list = []
    params = train(strategy, models)
    sync = strategy._replica_group.synchronizers[0]
    return {"algorithm": algo.name, "params": params,
            "resident": [algo._resident_for(b.buffer, None) is not None for b in sync.buckets]}


def _train_central(_: int) -> dict:
    from replicator.strategies import CentralStorageStrategy

    strategy = CentralStorageStrategy()
    return {"algorithm": strategy.cross_device_ops.name, "params": train(strategy)}


def _collectives_through_shared_memory(_: int) -> dict:
    import torch.distributed as dist

    strategy = rp.MirroredStrategy()
    algo = strategy.cross_device_ops
    rank, world = strategy.replica_id, strategy.num_replicas_in_sync
    out = {}
    for n in (0, 1, 1000, 3_000_001):  # the last one spans several 4 MB slots
        mine = torch.arange(n, dtype=torch.float32) + 1000 * rank
        gathered = algo.all_gather(mine)
        expect = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(expect, mine)
        out[f"gather{n}"] = all(torch.equal(a, b) for a, b in zip(gathered, expect))
        tensors = [torch.full((n,), float(rank)), torch.arange(7, dtype=torch.int64) * (rank + 1)]
        algo.broadcast_(tensors, src=1)
        out[f"broadcast{n}"] = bool((tensors[0] == 1).all()) and \
            tensors[1].tolist() == [2 * i for i in range(7)]
    out["pays"] = (algo.pays_for([torch.zeros(1 << 20)]), algo.pays_for([torch.zeros(4)]),
                   algo.pays_for([torch.zeros(0)]))
    return out


def _train_two_hosts(_: int) -> str:
    os.environ["REPLICATOR_HOST"] = f"host{resolve_cluster().rank}"
    strategy = rp.MirroredStrategy()
    train(strategy)
    return strategy.cross_device_ops.name


@pytest.fixture(scope="module")
def reference() -> dict:
    return train(rp.OneDeviceStrategy("cpu"))


@pytest.mark.skipif(bool(shared_memory_problem(2)), reason="this host has no usable /dev/shm")
@pytest.mark.timeout(120)
def test_auto_on_one_host_is_shared_memory_resident_and_exact(reference):
    results = run_distributed(_train_default, world_size=2, args=(0,), timeout_seconds=60)
    for r in results:
        assert r["algorithm"] == "shared_memory"
        assert r["resident"] and all(r["resident"])  # buckets live in the segment
        assert_params_close(reference, r["params"], atol=1e-5)


@pytest.mark.skipif(bool(shared_memory_problem(2)), reason="this host has no usable /dev/shm")
@pytest.mark.timeout(120)
def test_buckets_that_do_not_fit_stay_in_ordinary_memory_and_train(reference):
    results = run_distributed(_train_without_room_for_buckets, world_size=2, args=(0,),
                              timeout_seconds=60)
    for r in results:
        assert r["algorithm"] == "shared_memory" and not any(r["resident"])
        assert_params_close(reference, r["params"], atol=1e-5)


@pytest.mark.skipif(bool(shared_memory_problem(2)), reason="this host has no usable /dev/shm")
@pytest.mark.timeout(120)
def test_central_storage_under_auto_goes_through_shared_memory(reference):
    results = run_distributed(_train_central, world_size=2, args=(0,), timeout_seconds=60)
    for r in results:
        assert r["algorithm"] == "shared_memory"
        assert_params_close(reference, r["params"], atol=1e-5)


@pytest.mark.skipif(bool(shared_memory_problem(2)), reason="this host has no usable /dev/shm")
@pytest.mark.timeout(120)
def test_broadcast_and_all_gather_through_shared_memory_equal_gloo():
    for r in run_distributed(_collectives_through_shared_memory, world_size=2, args=(0,),
                             timeout_seconds=60):
        assert r.pop("pays") == (True, True, False)  # any non-empty CPU tensor
        assert all(r.values()), r


@pytest.mark.timeout(120)
def test_auto_falls_back_to_gloo_without_shared_memory(reference, monkeypatch, tmp_path):
    monkeypatch.setenv("REPLICATOR_SHM_DIR", str(tmp_path / "no-such-dir"))
    results = run_distributed(_train_default, world_size=2, args=(0,), timeout_seconds=60)
    for r in results:
        assert r["algorithm"] == "native"
        assert_params_close(reference, r["params"], atol=1e-5)


@pytest.mark.skipif(bool(shared_memory_problem(1)), reason="this host has no usable /dev/shm")
@pytest.mark.timeout(120)
def test_auto_across_hosts_is_hierarchical():
    assert run_distributed(_train_two_hosts, world_size=2, args=(0,),
                           timeout_seconds=60) == ["hierarchical", "hierarchical"]


def test_describe_auto_names_the_choice_and_the_reason(monkeypatch, tmp_path):
    assert describe_auto(torch.device("cuda", 0)).name == "nccl"
    assert describe_auto(torch.device("cpu"), hosts=3).name in ("hierarchical", "gloo")
    monkeypatch.setenv("REPLICATOR_SHM_DIR", str(tmp_path / "missing"))
    choice = describe_auto(torch.device("cpu"))
    assert choice.name == "gloo" and "missing" in choice.reason
