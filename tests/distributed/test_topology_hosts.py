"""Hosts declared with ``rp.Topology(hosts=...)`` on 4 processes of one machine: DiLoCo and
LocalSGD over them train as over the hosts the launcher names (``REPLICATOR_HOST``) and as
hand-written averaging of the 2 groups; the topology's host groups follow the declaration; bad
declarations are refused on every rank with a hint."""

from __future__ import annotations

import os

import pytest

import replicator as rp
from replicator.errors import ClusterConfigError
from replicator.testing import assert_params_close, run_distributed
from tests.distributed.test_diloco import _one_device, _train_two_level

pytestmark = pytest.mark.timeout(180)


def _train_on_declared_hosts(kwargs: dict, hosts: object) -> dict:
    mesh = rp.Topology(hosts=hosts)
    out = _train_two_level({**kwargs, "mesh": mesh})
    out["host_groups"] = mesh.host_groups
    return out


@pytest.mark.parametrize("hosts,groups", [(2, [[0, 1], [2, 3]]),
                                          ([[0, 1], [2, 3]], [[0, 1], [2, 3]]),
                                          ([[0, 2], [1, 3]], [[0, 2], [1, 3]])])
def test_local_sgd_on_declared_hosts_equals_hand_written_averaging(hosts, groups):
    """Hosts of consecutive ranks or not (a scheduler may number a node's processes apart):
    each host trains on its ranks' rows, the hosts average every 4 steps."""
    kwargs = {"name": "local_sgd", "inner_steps": 4}
    results = run_distributed(_train_on_declared_hosts, world_size=4, args=(kwargs, hosts),
                              timeout_seconds=60)
    assert [r["host"] for r in results] == [next(h for h, g in enumerate(groups) if rank in g)
                                            for rank in range(4)]
    assert all(r["hosts"] == 2 and r["host_groups"] == groups for r in results)
    reference = _one_device(hosts_every=4, hosts=tuple(map(tuple, groups)))
    for r in results:
        assert_params_close(reference, r["params"], atol=1e-5)
    # the groups trained apart between averagings: averaging every 5 steps gives other weights
    with pytest.raises(AssertionError):
        assert_params_close(_one_device(hosts_every=5, hosts=tuple(map(tuple, groups))),
                            results[0]["params"], atol=1e-5)


def test_diloco_on_declared_hosts_equals_the_launchers_hosts():
    kwargs = {"inner_steps": 3}  # the outer Nesterov SGD of the paper (0.7, 0.9)
    declared = run_distributed(_train_on_declared_hosts, world_size=4, args=(kwargs, 2),
                               timeout_seconds=60)
    by_env = run_distributed(_train_two_level, world_size=4, args=(dict(kwargs), True),
                             timeout_seconds=60)
    assert [r["host"] for r in declared] == [r["host"] for r in by_env] == [0, 0, 1, 1]
    for a, b in zip(declared, by_env):
        assert_params_close(b["params"], a["params"], atol=1e-6)
        assert a["wire"] == b["wire"]
    # four hosts of one process each train otherwise: the declaration decides the groups
    four = run_distributed(_train_on_declared_hosts, world_size=4, args=(kwargs, 4),
                           timeout_seconds=60)
    assert [r["host"] for r in four] == [0, 1, 2, 3]
    with pytest.raises(AssertionError):
        assert_params_close(by_env[0]["params"], four[0]["params"], atol=1e-5)


def _refusals(_: int) -> dict:
    """Each bad layout's message on this rank ('accepted' when none was raised)."""
    def message(build) -> str:  # type: ignore[no-untyped-def]
        try:
            build()
        except (ClusterConfigError, TypeError) as exc:
            return str(exc)
        return "accepted"

    rank = int(os.environ["RANK"])
    out = {
        "count": message(lambda: rp.Topology(hosts=3)),
        "server": message(lambda: rp.Topology(hosts=[[0, 1], [2, 3]], num_ps=1)),
        "order": message(lambda: rp.Topology(worker_order=[0, 0, 1, 2])),
        "uneven": message(lambda: rp.DiLoCoStrategy(inner_steps=4, mesh=rp.Topology(
            hosts=[[0, 1, 2], [3]]))),
        "twice": message(lambda: rp.LocalSGDStrategy(inner_steps=4, hosts=2,
                                                      mesh=rp.Topology(hosts=2))),
        "model_axes": message(lambda: rp.DiLoCoStrategy(inner_steps=4, mesh=rp.Topology(
            {"data": 2, "tensor": 2}, hosts=2))),
    }
    with_ps = rp.Topology(hosts=[[0, 2], [1]], num_ps=1)
    out["ps_layout"] = (with_ps.host_groups, with_ps.num_hosts,
                        with_ps.host_ranks() if with_ps.is_worker else None)
    os.environ["REPLICATOR_HOST"] = f"node-{rank // 2}"  # the launcher says 2 hosts
    out["joins"] = message(lambda: rp.Topology(hosts=1))
    split = rp.Topology(hosts=4)  # splitting the launcher's hosts is allowed
    out["split"] = (split.num_hosts, split.host_ranks())
    return out


def test_bad_host_declarations_are_refused_on_every_rank():
    results = run_distributed(_refusals, world_size=4, args=(0,), timeout_seconds=90)
    expected = {
        "count": "hosts=3 does not divide the job's 4 processes",
        "server": "rank 3 is a parameter server",
        "order": "must list each of the 4 worker ranks 0..3 once",
        "uneven": "different numbers of processes",
        "twice": "declare the hosts once, on the topology",
        "model_axes": "splits the model along ['tensor']",
    }
    for rank, r in enumerate(results):
        for case, match in expected.items():
            assert match in r[case] and "HINT" in r[case], (rank, case, r[case])
        assert "places them on different hosts" in r["joins"]
        assert "HINT: a declared host may split" in r["joins"]
        assert r["split"] == (4, [rank])
    groups, num_hosts, _ = results[0]["ps_layout"]
    assert groups[:2] == [[0, 2], [1]] and groups[2] == [3] and num_hosts == 3
    assert [r["ps_layout"][2] for r in results] == [[0, 2], [1], [0, 2], None]
