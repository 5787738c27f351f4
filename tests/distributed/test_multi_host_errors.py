"""A cluster description that disagrees with the running processes is a clear error within the
rendezvous timeout, never a hang: wrong world size, a missing host, a duplicate task index."""

from __future__ import annotations

import sys
import time

import pytest

from tests.distributed.test_multi_host import TRAIN, _start, _tf_config, _tf_env, _wait_all
from tests.hosts import namespaces_unavailable, virtual_hosts

PY = sys.executable
TIMEOUT = 8  # the rendezvous timeout where a process is missing (the wait being tested)
#: Where every process starts, the timeout only bounds a start on a loaded machine: the
#: mistake is found as soon as the processes meet.
START_TIMEOUT = 30
#: The error must come within this many seconds of starting the processes: far below the
#: 300 s a wait without the tested timeout would take, and above a start on a busy machine
#: (a fresh interpreter importing torch took up to 25 s beside four CPU hogs).
WITHIN = 90

_WHY = namespaces_unavailable()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"no network namespaces: {_WHY}")


@pytest.fixture
def net2():
    with virtual_hosts(2) as net:
        yield net


def _expect_failures(procs, message: str, within: float) -> list[str]:
    start = time.monotonic()
    results = _wait_all(procs, within + 30)
    elapsed = time.monotonic() - start
    outputs = [out for _, out in results]
    assert all(code not in (0, -999) for code, _ in results), outputs
    assert all(message in out for out in outputs), outputs
    assert elapsed < within, f"took {elapsed:.1f} s"
    return outputs


@pytest.mark.timeout(180, method="signal")
def test_wrong_world_size(net2, tmp_path):
    """Host 0's processes list 4 workers, host 1's process a list of 3."""
    workers = _tf_config(net2, 23456)
    short = workers[:2] + workers[2:3]
    procs = [_start(net2, 0, [PY, TRAIN, str(tmp_path), "--resolver", "tf_config"], tmp_path,
                    _tf_env(workers, i, START_TIMEOUT)) for i in range(2)]
    procs.append(_start(net2, 1, [PY, TRAIN, str(tmp_path), "--resolver", "tf_config"],
                        tmp_path, _tf_env(short, 2, START_TIMEOUT)))
    outputs = _expect_failures(procs, "the processes disagree on the size of the job", WITHIN)
    assert all("expects 3" in o and "expects 4" in o for o in outputs)


@pytest.mark.timeout(180, method="signal")
def test_missing_host(net2, tmp_path):
    """TF_CONFIG names 2 hosts x 2 processes; host 1 never starts."""
    workers = _tf_config(net2, 23456)
    procs = [_start(net2, 0, [PY, TRAIN, str(tmp_path), "--resolver", "tf_config"], tmp_path,
                    _tf_env(workers, i, TIMEOUT)) for i in range(2)]
    outputs = _expect_failures(procs, f"2 of 4 processes did not join within {TIMEOUT} s", WITHIN)
    assert all(f"rank 2 ({workers[2]})" in o and f"rank 3 ({workers[3]})" in o
               for o in outputs)


@pytest.mark.timeout(180, method="signal")
def test_missing_node_with_replicator_run(net2, tmp_path):
    """`replicator run --nnodes 2` on node 0 alone: the rendezvous gives up with a hint."""
    proc = _start(net2, 0, [PY, "-m", "replicator.cli", "run", "--nnodes", "2", "--node-rank",
                            "0", "--master-addr", net2.hosts[0].address, "--master-port",
                            "23470", "--nproc-per-node", "2", "--rdzv-timeout", str(TIMEOUT),
                            TRAIN, str(tmp_path)], tmp_path)
    outputs = _expect_failures([proc], "is a node missing", WITHIN)
    assert "for the other 1 node(s) of --nnodes 2" in outputs[0]
    assert "replicator run: error:" in outputs[0]


@pytest.mark.timeout(180, method="signal")
def test_duplicate_task_index(net2, tmp_path):
    """Two processes on host 1 both say task index 2 (index 3 is never started)."""
    workers = _tf_config(net2, 23456)
    procs = [_start(net2, i // 2, [PY, TRAIN, str(tmp_path), "--resolver", "tf_config"],
                    tmp_path, _tf_env(workers, index, START_TIMEOUT))
             for i, index in enumerate([0, 1, 2, 2])]
    outputs = _expect_failures(procs, f"two processes claim rank 2 ({workers[2]})", WITHIN)
    assert all("duplicate task index" in o for o in outputs)
