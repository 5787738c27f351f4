"""Resolving the cluster from torchrun's variables, TF_CONFIG, or nothing."""

from __future__ import annotations

import json

import pytest

from replicator.cluster.environment import resolve_cluster, timeout_from_env
from replicator.errors import ClusterConfigError


def test_plain_process_is_one_replica():
    spec = resolve_cluster({})
    assert (spec.rank, spec.world_size, spec.source) == (0, 1, "single-process")
    assert spec.is_chief


def test_torchrun_variables():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
           "TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_RESTART_COUNT": "2",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    spec = resolve_cluster(env)
    assert (spec.rank, spec.world_size, spec.local_rank, spec.node_rank) == (3, 4, 1, 1)
    assert spec.restart_count == 2 and spec.store_is_hosted and spec.source == "torchrun"
    assert spec.num_nodes == 2 and not spec.is_chief


def test_tf_config():
    cfg = {"cluster": {"worker": ["hostA:2222", "hostB:2222", "hostC:2222"]},
           "task": {"type": "worker", "index": 2}}
    spec = resolve_cluster({"TF_CONFIG": json.dumps(cfg)})
    assert (spec.rank, spec.world_size, spec.master_addr, spec.master_port) == \
        (2, 3, "hostA", 2222)


@pytest.mark.parametrize("env, message", [
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "RANK=2 is outside 0..1"),
    ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_PORT is not set"),
    ({"TF_CONFIG": "{not json"}, "TF_CONFIG is not a valid cluster description"),
    ({"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1"]},
                               "task": {"type": "worker", "index": 5}})}, "not among"),
])
def test_bad_environment_is_a_clear_error(env, message):
    with pytest.raises(ClusterConfigError, match=message):
        resolve_cluster(env)


def test_timeout_from_env():
    assert timeout_from_env(300, {}) == 300
    assert timeout_from_env(300, {"REPLICATOR_TIMEOUT_SECONDS": "2.5"}) == 2.5
    with pytest.raises(ClusterConfigError, match="must be positive"):
        timeout_from_env(300, {"REPLICATOR_TIMEOUT_SECONDS": "0"})
