"""Across real network hosts: 2 hosts x 2 processes in network namespaces on one bridge.

Every run trains tests/scripts/multi_host_train.py for 20 steps and must equal one process
with OneDeviceStrategy and the same global batch; launched by `replicator run --nnodes`, by
plain torchrun, and by TF_CONFIG. Hosts come from tests/hosts.py (always removed afterwards).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.hosts import Network, namespaces_unavailable, virtual_hosts

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
TRAIN = str(SCRIPTS / "multi_host_train.py")
PY = sys.executable

_WHY = namespaces_unavailable()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"no network namespaces: {_WHY}")


@pytest.fixture
def net2():
    with virtual_hosts(2) as net:
        yield net


def _port() -> int:
    return 29000 + os.getpid() % 500 * 2


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    deadline = time.monotonic() + timeout
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            results.append((-999, out))
            continue
        results.append((proc.returncode, out))
    return results


def _start(net: Network, host: int, argv: list[str], tmp: Path,
           env: dict[str, str | None] | None = None) -> subprocess.Popen:
    return net.hosts[host].popen(argv, env={"TMPDIR": str(tmp), **(env or {})},
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _run_ok(procs: list[subprocess.Popen], timeout: float = 150.0) -> None:
    results = _wait_all(procs, timeout)
    bad = [(code, out[-3000:]) for code, out in results if code != 0]
    assert not bad, f"a host failed: {bad}"


def _one_device(out: Path, batch: int = 32) -> dict[str, torch.Tensor]:
    """The reference: one process, OneDeviceStrategy, the same global batch."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "TF_CONFIG", "SLURM_PROCID")}
    subprocess.run([PY, TRAIN, str(out), "--strategy", "one_device", "--batch", str(batch)],
                   check=True, env=env, timeout=120, capture_output=True)
    return load_file(str(out / "final.safetensors"))


@pytest.fixture(scope="module")
def one_device(tmp_path_factory) -> dict[str, torch.Tensor]:
    return _one_device(tmp_path_factory.mktemp("one_device"))


def _assert_equal(out: Path, reference: dict[str, torch.Tensor]) -> None:
    got = load_file(str(out / "final.safetensors"))
    assert got.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(got[name], value, atol=1e-5, rtol=0, msg=name)


def _infos(out: Path, world: int = 4) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _replicator_run(net: Network, out: Path, tmp: Path, *script_args: str,
                    env: dict[str, str | None] | None = None) -> list[subprocess.Popen]:
    port = _port()
    return [_start(net, h.index, [PY, "-m", "replicator.cli", "run", "--nnodes", "2",
                                  "--node-rank", str(h.index), "--master-addr",
                                  net.hosts[0].address, "--master-port", str(port),
                                  "--nproc-per-node", "2", "--timeout", "60",
                                  "--rdzv-timeout", "60", TRAIN, str(out), *script_args],
                   tmp, env)
            for h in net.hosts]


#: A process that names neither its host nor its interface: replicator finds both.
UNNAMED: dict[str, str | None] = {"REPLICATOR_HOST": None, "GLOO_SOCKET_IFNAME": None}


@pytest.mark.timeout(180, method="signal")
def test_replicator_run_on_two_hosts_equals_one_device(net2, tmp_path, one_device):
    out = tmp_path / "out"
    out.mkdir()
    _run_ok(_replicator_run(net2, out, tmp_path, "--algorithm", "hierarchical", env=UNNAMED))
    _assert_equal(out, one_device)
    infos = _infos(out)
    # hosts told apart by hostname and node rank; gloo went over the interface to the master
    assert [i["host"] for i in infos] == ["host0/node0", "host0/node0", "host1/node1",
                                          "host1/node1"]
    assert all(i["hosts"] == [[0, 1], [2, 3]] and i["leaders"] == [0, 2] for i in infos)


@pytest.mark.timeout(180, method="signal")
def test_torchrun_on_two_hosts_equals_one_device(net2, tmp_path, one_device):
    out = tmp_path / "out"
    out.mkdir()
    port = _port() + 1
    procs = [_start(net2, h.index, [PY, "-m", "torch.distributed.run", "--nnodes", "2",
                                    "--node-rank", str(h.index), "--master-addr",
                                    net2.hosts[0].address, "--master-port", str(port),
                                    "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
                                    TRAIN, str(out), "--algorithm", "hierarchical"],
                    tmp_path, {"REPLICATOR_TIMEOUT_SECONDS": "60"})
             for h in net2.hosts]
    _run_ok(procs)
    _assert_equal(out, one_device)
    assert [i["world"] for i in _infos(out)] == [4] * 4


@pytest.mark.timeout(180, method="signal")
def test_slurm_on_three_hosts_equals_one_device(tmp_path):
    """3 hosts x 1 process started as srun would (SLURM_* variables, a bracket node list of
    the hosts' addresses): hierarchical with a leader per host, equal to one device."""
    reference = _one_device(tmp_path, batch=48)
    out = tmp_path / "out"
    out.mkdir()
    with virtual_hosts(3) as net:
        prefix = net.hosts[0].address.rsplit(".", 1)[0]
        procs = [_start(net, i, [PY, TRAIN, str(out), "--algorithm", "hierarchical",
                                 "--resolver", "slurm", "--batch", "48"], tmp_path,
                        {"SLURM_PROCID": str(i), "SLURM_NTASKS": "3", "SLURM_LOCALID": "0",
                         "SLURM_NODEID": str(i), "SLURM_NODELIST": f"{prefix}.[1-3]",
                         "SLURM_TASKS_PER_NODE": "1(x3)", "MASTER_PORT": str(_port()),
                         "REPLICATOR_TIMEOUT_SECONDS": "60"})
                 for i in range(3)]
        _run_ok(procs)
    _assert_equal(out, reference)
    infos = _infos(out, world=3)
    assert [i["host"] for i in infos] == ["host0", "host1", "host2"]
    assert infos[0]["hosts"] == [[0], [1], [2]] and infos[0]["leaders"] == [0, 1, 2]


def _tf_config(net: Network, port: int, workers_per_host: int = 2,
               hosts: int | None = None) -> list[str]:
    hosts_used = net.hosts if hosts is None else net.hosts[:hosts]
    return [f"{h.address}:{port + i}" for h in hosts_used for i in range(workers_per_host)]


def _tf_env(workers: list[str], index: int, timeout: float = 60) -> dict[str, str | None]:
    return {"TF_CONFIG": json.dumps({"cluster": {"worker": workers},
                                     "task": {"type": "worker", "index": index}}),
            "REPLICATOR_TIMEOUT_SECONDS": str(timeout)}


@pytest.mark.timeout(180, method="signal")
def test_tf_config_on_two_hosts_equals_one_device(net2, tmp_path, one_device):
    out = tmp_path / "out"
    out.mkdir()
    workers = _tf_config(net2, _port())
    procs = [_start(net2, i // 2, [PY, TRAIN, str(out), "--algorithm", "hierarchical",
                                   "--resolver", "tf_config"], tmp_path,
                    {**_tf_env(workers, i), **UNNAMED})
             for i in range(4)]
    _run_ok(procs)
    _assert_equal(out, one_device)
    infos = _infos(out)
    # TF_CONFIG names the hosts by address: processes of one address are one host, and gloo
    # finds the interface towards the chief by itself
    a, b = net2.hosts[0].address, net2.hosts[1].address
    assert [i["host"] for i in infos] == [a, a, b, b]
    assert infos[2]["hosts"] == [[0, 1], [2, 3]]


@pytest.mark.timeout(180, method="signal")
def test_auto_chooses_hierarchical_across_hosts(net2, tmp_path, one_device):
    """With more than one host, "auto" picks HierarchicalAllReduce (and still equals one
    device); the hosts are told apart by their keys, never sharing memory across them."""
    out = tmp_path / "out"
    out.mkdir()
    _run_ok(_replicator_run(net2, out, tmp_path))
    _assert_equal(out, one_device)
    infos = _infos(out)
    assert {i["algorithm"] for i in infos} == {"HierarchicalAllReduce"}
    assert infos[0]["hosts"] == [[0, 1], [2, 3]]


def _traffic_run(net: Network, tmp: Path, algorithm: str, port: int,
                 width: int) -> tuple[dict[str, int], list[dict]]:
    """One 2-host run; returns the bytes each host sent on its link, and the rank reports."""
    out = tmp / algorithm
    out.mkdir()
    before = net.link_bytes()
    procs = [_start(net, h.index, [PY, "-m", "replicator.cli", "run", "--nnodes", "2",
                                   "--node-rank", str(h.index), "--master-addr",
                                   net.hosts[0].address, "--master-port", str(port),
                                   "--nproc-per-node", "2", "--timeout", "60", TRAIN, str(out),
                                   "--algorithm", algorithm, "--width", str(width)], tmp)
             for h in net.hosts]
    _run_ok(procs)
    after = net.link_bytes()
    sent = {name: after[name]["tx"] - before[name]["tx"] for name in after}
    return sent, _infos(out)


@pytest.mark.timeout(240, method="signal")
def test_hierarchical_crosses_hosts_only_between_leaders(net2, tmp_path):
    """Count bytes on the veth links and on each process's own TCP connections: with
    hierarchical, the gradients cross between the two leaders only (about one model per step
    per host), and a flat ring moves about 1.5x as many bytes over the same links."""
    width = 8192  # 10*w + w + 2*w + 2 parameters: 106,498 floats = 426 KB per all-reduce
    grad_bytes = (13 * width + 2) * 4
    hier_sent, hier = _traffic_run(net2, tmp_path, "hierarchical", _port() + 3, width)
    leaders, others = [hier[0], hier[2]], [hier[1], hier[3]]
    for leader in leaders:  # (a report names every socket each count saw: once, beside four
        # hogs, rank 2 counted 9.6 kB while rank 0 counted 8.5 MB to it)
        assert leader["inter_host_sent"] > 18 * grad_bytes, json.dumps(leader, indent=1)
    for other in others:
        # no gradient bytes during the steps: only a few small control messages
        assert other["inter_host_sent"] < 0.02 * leaders[0]["inter_host_sent"], \
            json.dumps(other, indent=1)
    for host, leader in zip(("host0", "host1"), leaders):
        # the link carries the leader's bytes plus headers, and nothing like a second stream
        assert leader["inter_host_sent"] <= hier_sent[host] < 1.25 * leader["inter_host_sent"], \
            (host, hier_sent, leader)
    ring_sent, _ = _traffic_run(net2, tmp_path, "ring", _port() + 5, width)
    ratio = sum(ring_sent.values()) / sum(hier_sent.values())
    assert 1.3 < ratio < 1.7, (ring_sent, hier_sent)


BACKUP_TRAIN = str(SCRIPTS / "backup_train.py")
LOSS_STEPS, KILL_AT = 60, 30


def _backup_run(net: Network, tmp: Path, name: str, port: int,
                kill_host_at: int | None = None) -> dict[str, torch.Tensor]:
    """2 hosts x 2 processes of backup_train.py with --max-restarts 1; optionally every worker
    of host 1 is killed (SIGKILL) once rank 2 has logged step ``kill_host_at`` (the steps of
    that run are slowed, so that the kill lands near that step)."""
    out, backup = tmp / name, tmp / f"{name}-backup"  # one directory every host reads
    out.mkdir()
    slow = ["--step-sleep", "0.03"] if kill_host_at is not None else []
    procs = [_start(net, h.index, [PY, "-m", "replicator.cli", "run", "--nnodes", "2",
                                   "--node-rank", str(h.index), "--master-addr",
                                   net.hosts[0].address, "--master-port", str(port),
                                   "--nproc-per-node", "2", "--max-restarts", "1",
                                   "--timeout", "30", BACKUP_TRAIN, str(out), str(backup),
                                   "--steps", str(LOSS_STEPS), "--save-freq", "10", *slow], tmp)
             for h in net.hosts]
    if kill_host_at is not None:
        log = out / "log-a0-r2.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            lines = log.read_text().splitlines() if log.exists() else []
            if lines and json.loads(lines[-1])["step"] >= kill_host_at:
                break
            time.sleep(0.02)
        else:
            pytest.fail("rank 2 never reached the step to kill its host at")
        agent = procs[1].pid  # the node's agent stays (the machine's supervisor)
        workers = [pid for pid in net.hosts[1].pids() if pid != agent]
        assert workers, "host 1 has no worker processes to kill"
        for pid in workers:
            os.kill(pid, 9)
    _run_ok(procs, timeout=180)
    return load_file(str(out / "final-r0.safetensors"))


@pytest.mark.timeout(300, method="signal")
def test_node_loss_resumes_from_backup_with_the_same_parameters(net2, tmp_path):
    """Every worker process of host 1 is killed at step 30: the elastic agents restart the
    whole group (--max-restarts 1), it resumes from the last BackupAndRestore backup, and the
    final parameters equal an uninterrupted run's."""
    reference = _backup_run(net2, tmp_path, "uninterrupted", _port() + 7)
    resumed = _backup_run(net2, tmp_path, "killed", _port() + 9, kill_host_at=KILL_AT)
    assert (tmp_path / "killed" / "log-a1-r2.jsonl").exists(), "the group was not restarted"
    def steps(name: str, attempt: int) -> list[int]:
        log = tmp_path / name / f"log-a{attempt}-r0.jsonl"
        return [json.loads(line)["step"] for line in log.read_text().splitlines()]

    restarted, full = steps("killed", 1), steps("uninterrupted", 0)
    # resumed from a backup at or before the kill, and ran to the end
    assert KILL_AT - 10 < restarted[0] <= KILL_AT + 1 and restarted[-1] == full[-1], restarted
    assert reference.keys() == resumed.keys()
    for name in reference:
        assert torch.equal(reference[name], resumed[name]), name
