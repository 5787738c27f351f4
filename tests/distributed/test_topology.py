"""The job's layout: mesh axes, roles and hosts, and strategies that replicate along one axis."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

import replicator as rp
from replicator.cluster import Topology
from replicator.testing import assert_params_close, run_distributed
from tests.helpers import make_mlp, regression_data

STEPS = 20
GLOBAL_BATCH = 32


def _train(strategy: rp.Strategy, data_seed: int) -> dict:
    with strategy.scope():
        model = make_mlp(seed=5)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    loader = DataLoader(regression_data(seed=data_seed), batch_size=GLOBAL_BATCH, shuffle=True)
    it = iter(strategy.distribute_dataset(loader, seed=3))
    for _ in range(STEPS):
        strategy.run(step, args=(next(it),))
    return {k: v.clone() for k, v in model.state_dict().items()}


def _reference(data_seed: int) -> dict:
    return _train(rp.OneDeviceStrategy("cpu"), data_seed)


def _two_data_groups(_: int) -> dict:
    mesh = Topology({"data": 2, "tensor": 2})
    # the two data groups ({0, 2} and {1, 3}) train on different data, at the same time
    strategy = rp.MirroredStrategy(mesh=mesh, axis="data")
    params = _train(strategy, data_seed=mesh.index("tensor"))
    return {"params": params, "tensor": mesh.index("tensor"), "replica": strategy.replica_id,
            "replicas": strategy.num_replicas_in_sync, "data_ranks": mesh.ranks("data"),
            "role": mesh.role}


@pytest.mark.timeout(180)
def test_two_mirrored_groups_of_a_2x2_mesh_each_equal_one_device():
    results = run_distributed(_two_data_groups, world_size=4, args=(0,), timeout_seconds=60)
    refs = {seed: _reference(seed) for seed in (0, 1)}
    assert not all(torch.allclose(refs[0][k], refs[1][k]) for k in refs[0]), \
        "the two groups must train on different data for this test to mean anything"
    assert [r["data_ranks"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["replica"] for r in results] == [0, 0, 1, 1]
    assert all(r["replicas"] == 2 for r in results)
    assert [r["role"] for r in results] == ["chief", "worker", "worker", "worker"]
    for r in results:
        assert_params_close(refs[r["tensor"]], r["params"], atol=1e-5)


def _layouts(_: int) -> dict:
    out: dict = {}
    t = Topology({"data": 2, "fsdp": -1})
    out["dp_fsdp"] = (t.replica_id, t.num_replicas, dist.get_process_group_ranks(t.data_group()))
    ps = Topology({"data": 3}, num_ps=1)
    out["ps"] = (ps.role, ps.is_worker, ps.coordinate)
    own = Topology(model=2, data=2)  # an axis of the user's own beside a known one
    out["own"] = (own.axes, own.ranks("model"), own.ranks("data"), own.num_replicas,
                  own.replica_id, dist.get_process_group_ranks(own.data_group()))
    errors = []
    for axes in ({"data": 3}, {"dta": 4}, {"data": -1, "tensor": -1}, {"data": 0},
                 {"tensr": 2, "data": 2}):
        try:
            Topology(axes)
        except rp.errors.ClusterConfigError as exc:
            errors.append(str(exc))
    try:
        Topology({"data": 2, "tensor": 2}).group("tensr")
    except rp.errors.ClusterConfigError as exc:
        errors.append(str(exc))
    if ps.is_ps:
        try:
            ps.group("data")
        except rp.errors.ClusterConfigError as exc:
            errors.append(str(exc))
    out["errors"] = errors
    return out


@pytest.mark.timeout(120)
def test_topology_axes_roles_and_clear_errors():
    results = run_distributed(_layouts, world_size=4, args=(0,), timeout_seconds=60)
    assert [r["dp_fsdp"] for r in results] == [(i, 4, [0, 1, 2, 3]) for i in range(4)]
    assert [r["ps"][0] for r in results] == ["chief", "worker", "worker", "ps"]
    assert results[3]["ps"][1:] == (False, {})
    errors = results[0]["errors"]
    assert "make 3 processes, but the job has 4 worker" in errors[0]
    assert "unknown mesh axis 'dta'" in errors[1] and "Did you mean 'data'" in errors[1]
    assert "only one axis may be -1" in errors[2]
    assert "positive" in errors[3]
    assert "unknown mesh axis 'tensr'" in errors[4] and "Did you mean 'tensor'" in errors[4]
    assert "no axis 'tensr'" in errors[5] and "Did you mean 'tensor'" in errors[5]
    own = [r["own"] for r in results]
    assert all(o[0] == {"model": 2, "data": 2} and o[3] == 2 for o in own)
    assert [o[1] for o in own] == [[0, 2], [1, 3], [0, 2], [1, 3]]  # model: across rows
    assert [o[2] for o in own] == [[0, 1], [0, 1], [2, 3], [2, 3]]  # data: neighbours
    assert [o[4] for o in own] == [0, 1, 0, 1]
    assert [o[5] for o in own] == [o[2] for o in own]  # the data group is the data axis
    assert "parameter server" in results[3]["errors"][-1]


def _hosts(_: int) -> dict:
    # two declared hosts of two processes each, as network-namespace test hosts would be
    os.environ["REPLICATOR_HOST"] = "host-a" if int(os.environ["RANK"]) < 2 else "host-b"
    t = Topology()
    node = t.node_group()
    return {"hosts": t.hosts, "num_hosts": t.num_hosts, "host_ranks": t.host_ranks(),
            "node_ranks": dist.get_process_group_ranks(node) if node is not None else None}


@pytest.mark.timeout(120)
def test_node_groups_follow_declared_hosts():
    os.environ.pop("REPLICATOR_HOST", None)
    results = run_distributed(_hosts, world_size=4, args=(0,), timeout_seconds=60)
    assert results[0]["hosts"] == ["host-a", "host-a", "host-b", "host-b"]
    assert all(r["num_hosts"] == 2 for r in results)
    assert [r["node_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["host_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
