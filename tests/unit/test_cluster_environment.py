"""Resolving the cluster (torchrun variables, TF_CONFIG, SLURM, an explicit ClusterSpec, or
nothing) and the multi-node command line."""

from __future__ import annotations

import json

import pytest

from replicator.cli import main as cli_main
from replicator.cluster.environment import (
    ClusterSpec,
    resolve_cluster,
    use_cluster,
)
from replicator.cluster.ports import choose_gloo_interface, interface_towards
from replicator.cluster.resolvers import (
    SlurmResolver,
    TFConfigResolver,
    as_spec,
    expand_nodelist,
)
from replicator.cluster.timeouts import DEFAULT_TIMEOUT_SECONDS, resolve_timeout
from replicator.comm.options import CommunicationOptions
from replicator.errors import ClusterConfigError
from replicator.launch.multi_node import check_multi_node_args, run_multi_node


def test_plain_process_is_one_replica():
    spec = resolve_cluster({})
    assert (spec.rank, spec.world_size, spec.source) == (0, 1, "single-process")


def test_torchrun_variables():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
           "TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_RESTART_COUNT": "2",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    spec = resolve_cluster(env)
    assert (spec.rank, spec.world_size, spec.local_rank, spec.node_rank) == (3, 4, 1, 1)
    assert spec.restart_count == 2 and spec.store_is_hosted and spec.source == "torchrun"
    assert spec.num_nodes == 2


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


def test_resolve_timeout_takes_the_first_that_is_set():
    env = {"REPLICATOR_TIMEOUT_SECONDS": "2.5"}
    options = CommunicationOptions(timeout_seconds=7)
    assert resolve_timeout(env={}) == DEFAULT_TIMEOUT_SECONDS
    assert resolve_timeout(env=env) == 2.5
    assert resolve_timeout(None, options, env=env) == 7
    assert resolve_timeout(4, options, env=env) == 4
    assert resolve_timeout(None, CommunicationOptions(), env=env) == 2.5
    with pytest.raises(ClusterConfigError, match="must be positive"):
        resolve_timeout(env={"REPLICATOR_TIMEOUT_SECONDS": "0"})
    with pytest.raises(ClusterConfigError, match="not a number"):
        resolve_timeout(env={"REPLICATOR_TIMEOUT_SECONDS": "soon"})
    with pytest.raises(ValueError, match="must be positive"):
        resolve_timeout(-1)


# -- resolvers: TF_CONFIG with several processes per host, SLURM, an explicit ClusterSpec -----



def _tf(index: int, role: str = "worker", **cluster) -> dict[str, str]:
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": role, "index": index}})}


def test_tf_config_several_processes_per_host():
    workers = ["10.0.0.1:2222", "10.0.0.1:2223", "10.0.0.2:2222", "10.0.0.2:2223"]
    specs = [resolve_cluster(_tf(i, worker=workers)) for i in range(4)]
    assert [s.rank for s in specs] == [0, 1, 2, 3]
    assert [(s.node_rank, s.local_rank, s.local_world_size) for s in specs] == \
        [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    assert {(s.master_addr, s.master_port, s.world_size) for s in specs} == \
        {("10.0.0.1", 2222, 4)}
    assert specs[0].rank == 0 and specs[0].num_nodes == 2
    assert specs[3].addresses == tuple(workers)


def test_tf_config_chief_is_rank_zero():
    cluster = {"chief": ["a:1"], "worker": ["b:1", "b:2"]}
    chief = resolve_cluster(_tf(0, "chief", **cluster))
    worker1 = resolve_cluster(_tf(1, **cluster))
    assert (chief.rank, chief.role) == (0, "chief")
    assert (worker1.rank, worker1.world_size, worker1.node_rank, worker1.local_rank) == \
        (2, 3, 1, 1)
    assert worker1.master_addr == "a"


@pytest.mark.parametrize("cluster, index, message", [
    ({"worker": ["a:1", "a:1"]}, 0, "more than once"),
    ({"worker": ["a:1"], "ps": ["b:1"]}, 0, "parameter servers"),
    ({"worker": ["a"]}, 0, "is not host:port"),
    ({"chief": ["a:1", "b:1"], "worker": []}, 0, "at most one"),
    ({"worker": ["a:1", "b:1"]}, -1, "index 0..1"),
])
def test_tf_config_mistakes(cluster, index, message):
    with pytest.raises(ClusterConfigError, match=message):
        resolve_cluster(_tf(index, **cluster))


def test_tf_config_resolver_takes_a_dict():
    spec = TFConfigResolver({"cluster": {"worker": ["h:5", "h:6"]},
                             "task": {"type": "worker", "index": 1}}).resolve({})
    assert (spec.rank, spec.local_rank, spec.local_world_size) == (1, 1, 2)


@pytest.mark.parametrize("nodelist, hosts", [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("gpu-a[1-2],cpu[9-10],login", ["gpu-a1", "gpu-a2", "cpu9", "cpu10", "login"]),
    ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
    ("n[008-010]", ["n008", "n009", "n010"]),
])
def test_slurm_nodelist_bracket_ranges(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_slurm_environment():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_NODELIST": "tr[07-08]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    spec = resolve_cluster(env)
    assert (spec.rank, spec.world_size, spec.local_rank, spec.local_world_size,
            spec.node_rank) == (3, 4, 1, 2, 1)
    assert (spec.master_addr, spec.master_port, spec.source) == ("tr07", 29500, "slurm")
    assert SlurmResolver(port=4000).resolve(env).master_port == 4000


@pytest.mark.parametrize("env, message", [
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "SLURM_NODELIST is not set"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "a[1-"}, "unbalanced"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "a[x-2]"}, "not N or N-M"),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "2", "SLURM_NODELIST": "a"}, "outside 0..1"),
])
def test_slurm_mistakes(env, message):
    with pytest.raises(ClusterConfigError, match=message):
        resolve_cluster(env)


def test_explicit_cluster_spec():
    spec = ClusterSpec(rank=3, world_size=4, local_world_size=2, master_addr="10.0.0.1",
                       master_port=29500)
    assert (spec.node_rank, spec.local_rank, spec.source) == (1, 1, "explicit")
    assert as_spec(spec) is spec
    use_cluster(spec)
    try:
        assert resolve_cluster() is spec
        assert resolve_cluster({}).world_size == 1  # an explicit env still reads the env
    finally:
        use_cluster(None)
    assert resolve_cluster({}).source == "single-process"


@pytest.mark.parametrize("kwargs, message", [
    (dict(rank=4, world_size=4, master_port=1), "outside 0..3"),
    (dict(rank=0, world_size=0), "at least one"),
    (dict(rank=0, world_size=2), "master_port is not set"),
    (dict(rank=0, world_size=2, master_port=1, local_world_size=2, local_rank=2), "local_rank"),
])
def test_explicit_cluster_spec_mistakes(kwargs, message):
    with pytest.raises(ClusterConfigError, match=message):
        ClusterSpec(**kwargs)


def test_resolver_argument_must_resolve():
    with pytest.raises(TypeError, match="cluster_resolver must be"):
        as_spec("worker-0")


# -- multi-node command line --------------------------------------------------------------



@pytest.mark.parametrize("nnodes, node_rank, addr, message", [
    (2, None, "10.0.0.1", "needs --node-rank"),
    (2, 2, "10.0.0.1", r"--node-rank 2 is outside 0..1"),
    (2, 0, None, "needs --master-addr"),
    (0, 0, "10.0.0.1", "--nnodes must be a positive integer"),
])
def test_multi_node_command_line_mistakes(nnodes, node_rank, addr, message):
    with pytest.raises(ClusterConfigError, match=message):
        check_multi_node_args(nnodes, node_rank, addr)


def test_multi_node_missing_script_and_negative_restarts(tmp_path):
    with pytest.raises(ClusterConfigError, match="not found"):
        run_multi_node(str(tmp_path / "nope.py"), nnodes=2, node_rank=0,
                       master_addr="127.0.0.1", nproc_per_node=1)
    script = tmp_path / "s.py"
    script.write_text("")
    with pytest.raises(ClusterConfigError, match="--max-restarts must be an integer >= 0"):
        run_multi_node(str(script), nnodes=2, node_rank=0, master_addr="127.0.0.1",
                       nproc_per_node=1, max_restarts=-1)


def test_cli_multi_node_mistake_is_a_usage_error(tmp_path, capsys):
    script = tmp_path / "s.py"
    script.write_text("")
    code = cli_main(["run", "--nnodes", "2", "--nproc-per-node", "1", "--master-addr",
                     "127.0.0.1", str(script)])
    assert code == 2
    assert "needs --node-rank" in capsys.readouterr().err


def test_interface_towards_loopback():
    assert interface_towards("127.0.0.1") == "lo"


def test_gloo_interface_is_chosen_only_when_unset():
    env: dict[str, str] = {}
    assert choose_gloo_interface("127.0.0.1", env) is None and env == {}  # a local job
    env = {"GLOO_SOCKET_IFNAME": "eth7"}
    assert choose_gloo_interface("10.0.0.1", env) == "eth7"


@pytest.mark.parametrize(("gpus", "local_world", "expected"), [
    (0, 2, ["cpu", "cpu"]),
    (1, 1, ["cuda:0"]),
    (1, 2, ["cpu", "cpu"]),      # never rank 0 on NCCL beside rank 1 on gloo
    (2, 2, ["cuda:0", "cuda:1"]),
    (4, 2, ["cuda:0", "cuda:1"]),
])
def test_default_devices_never_mix_gpus_and_cpus(monkeypatch, capsys, gpus, local_world,
                                                  expected):
    from replicator.cluster import devices

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(devices, "available_accelerators", lambda: gpus)
    chosen = [str(devices.default_device_for(r, local_world)) for r in range(local_world)]
    assert chosen == expected
    said = capsys.readouterr().err
    if 0 < gpus < local_world:
        assert said.count("every replica computes on the CPU") == 1  # local rank 0 only
        assert f"start at most {gpus} process(es) per machine" in said
    else:
        assert said == ""


@pytest.mark.parametrize(("visible", "expected"), [
    ("3", "cuda:0"),            # a scheduler's GPU per task: each process uses the one it sees
    ("GPU-8f1c2d3e", "cuda:0"),
    ("0,1", "cpu"),             # several visible but fewer than the processes: the CPU
    ("", "cpu"),
    ("-1", "cpu"),
])
def test_a_process_given_its_own_gpu_uses_it(monkeypatch, capsys, visible, expected):
    from replicator.cluster import devices

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(devices, "available_accelerators", lambda: 1)
    assert [str(devices.default_device_for(r, 4)) for r in range(4)] == [expected] * 4


def test_the_device_identity_of_a_cpu_is_none():
    import torch

    from replicator.cluster.devices import device_identity

    assert device_identity(torch.device("cpu")) is None and device_identity(None) is None
