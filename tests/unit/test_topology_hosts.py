"""Hosts declared with ``Topology(hosts=...)``: a count of consecutive-rank hosts or each host's
rank list; bad values (a count that does not divide, ranks missing, twice, out of range or of a
parameter server, a host that joins two of the environment's) are refused with a hint."""

from __future__ import annotations

import pytest

import replicator as rp
from replicator.cluster.hosts import apply_declared_hosts, declared_groups
from replicator.errors import ClusterConfigError

pytestmark = pytest.mark.timeout(60)


def test_a_count_makes_hosts_of_consecutive_ranks():
    assert declared_groups(2, 4) == [[0, 1], [2, 3]]
    assert declared_groups(3, 6) == [[0, 1], [2, 3], [4, 5]]
    assert declared_groups(1, 3) == [[0, 1, 2]]
    assert declared_groups(4, 4) == [[0], [1], [2], [3]]


def test_declared_hosts_become_host_keys_and_servers_keep_theirs():
    keys = apply_declared_hosts(2, ["m"] * 4)
    assert keys[0] == keys[1] != keys[2] == keys[3]
    assert apply_declared_hosts(None, ["a", "b"]) == ["a", "b"]
    keys = apply_declared_hosts([[0, 2], [1, 3]], ["m"] * 4 + ["server"], num_ps=1)
    assert keys[0] == keys[2] != keys[1] == keys[3] and keys[4] == "server"
    # a declared host may split one of the environment's hosts
    keys = apply_declared_hosts(4, ["a", "a", "b", "b"])
    assert len(set(keys)) == 4


@pytest.mark.parametrize("hosts,match", [
    (3, r"hosts=3 does not divide the job's 4 processes.*HINT: choose hosts among \[1, 2, 4\]"),
    (0, "hosts=0: a job runs on at least one host.*HINT"),
    (-2, "hosts=-2: a job runs on at least one host.*HINT"),
    (True, "hosts=True is neither a number of hosts nor a list of rank lists.*HINT"),
    (2.0, "hosts=2.0 is neither.*HINT"),
    ("2", "hosts='2' is neither.*HINT"),
    ([0, 1, 2, 3], r"hosts=\[0, 1, 2, 3\] is neither.*HINT"),
    ([], r"hosts=\[\] names no host.*HINT"),
    ([[0, 1], []], "host 1 has no rank.*HINT"),
    ([[0, 1], [2]], r"leaves worker rank\(s\) \[3\] on no host.*HINT"),
    ([[0, 1], [1, 2, 3]], "puts rank 1 on host 0 and on host 1.*HINT"),
    ([[0, 1], [2, 3, 9]], r"names rank 9, but the job's workers are ranks 0\.\.3.*HINT"),
    ([[0, -1], [2, 3, 1]], r"names rank -1.*HINT"),
])
def test_bad_values_are_refused_with_a_hint(hosts, match):
    with pytest.raises(ClusterConfigError, match=match):
        apply_declared_hosts(hosts, ["m"] * 4)


def test_parameter_servers_are_in_no_declared_host():
    with pytest.raises(ClusterConfigError, match=r"rank 4 is a parameter server \(num_ps=1: "
                                                 r"ranks 4\.\.4\).*HINT: hosts= groups the "
                                                 r"workers \(ranks 0\.\.3\)"):
        apply_declared_hosts([[0, 1], [2, 3, 4]], ["m"] * 5, num_ps=1)
    with pytest.raises(ClusterConfigError, match="does not divide the job's 3 worker processes"):
        apply_declared_hosts(2, ["m"] * 4, num_ps=1)


def test_a_declared_host_that_joins_two_of_the_environments_is_refused():
    with pytest.raises(ClusterConfigError, match=r"hosts=1 puts rank 0 on 'node-a', rank 2 on "
                                                 r"'node-b' on one host \(host 0\).*launcher's "
                                                 r"node rank.*HINT: a declared host may split"):
        apply_declared_hosts(1, ["node-a", "node-a", "node-b", "node-b"])
    with pytest.raises(ClusterConfigError, match="host 1"):
        apply_declared_hosts([[0, 1], [2, 3]], ["a", "a", "a", "b"])


@pytest.mark.parametrize("hosts", [0, "two", [[0, "1"]], 1.5])
def test_topology_and_diloco_refuse_a_bad_form_before_any_process_group(hosts):
    import torch.distributed as dist

    with pytest.raises(ClusterConfigError, match="HINT"):
        rp.Topology(hosts=hosts)
    with pytest.raises(ClusterConfigError, match="HINT"):
        rp.DiLoCoStrategy(inner_steps=4, hosts=hosts)
    with pytest.raises(ClusterConfigError, match="HINT"):
        rp.LocalSGDStrategy(inner_steps=4, hosts=hosts)
    assert not dist.is_initialized()


def test_diloco_mesh_must_be_a_topology():
    with pytest.raises(TypeError, match="mesh must be an rp.Topology.*HINT"):
        rp.DiLoCoStrategy(inner_steps=4, mesh={"hosts": 2})
