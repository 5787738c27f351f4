"""Processes that would start different backends (NCCL on one, gloo on another), or two NCCL
processes on one GPU, are stopped at the roll call with a clear error on every rank, before
either backend starts: never a hang."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from replicator.cluster.ports import LOOPBACK, listen

_WORKER = textwrap.dedent("""
    import sys
    from replicator.cluster.process_group import initialize
    from replicator.errors import ClusterConfigError
    try:
        initialize(backend=sys.argv[1], timeout_seconds=30)
    except ClusterConfigError as exc:
        print("REFUSED:", exc, flush=True)
        sys.exit(3)
    print("STARTED", flush=True)
""")


@pytest.mark.timeout(120, method="signal")
def test_ranks_that_disagree_on_the_backend_are_refused_by_name(tmp_path):
    with listen(LOOPBACK, 0) as probe:
        port = probe.getsockname()[1]
    procs = []
    for rank, backend in enumerate(["gloo", "nccl"]):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-c", _WORKER, backend], cwd=tmp_path,
                                      env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=90)[0] for p in procs]
    assert [p.returncode for p in procs] == [3, 3], outputs
    for out in outputs:
        assert "the processes disagree on the backend" in out, out
        assert "NCCL for CUDA, gloo for CPU" in out
    # the rank that joined second names itself and both backends
    assert any("rank 1 starts nccl but a process that joined earlier started gloo" in o or
               "rank 0 starts gloo but a process that joined earlier started nccl" in o
               for o in outputs), outputs


_ROLL_CALL = textwrap.dedent("""
    import sys
    from datetime import timedelta
    import torch.distributed as dist
    from replicator.cluster.environment import resolve_cluster
    from replicator.cluster.resolvers import check_membership
    from replicator.errors import ClusterConfigError
    spec = resolve_cluster()
    store = dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, spec.rank == 0,
                          timeout=timedelta(seconds=30), wait_for_workers=False)
    try:
        check_membership(store, spec, 30, backend="nccl", device_key=sys.argv[1])
    except ClusterConfigError as exc:
        print("REFUSED:", exc, flush=True)
        sys.exit(3)
    print("JOINED", flush=True)
""")


def _roll_call(tmp_path, keys: list[str]) -> list[tuple[int, str]]:
    with listen(LOOPBACK, 0) as probe:
        port = probe.getsockname()[1]
    procs = []
    for rank, key in enumerate(keys):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(len(keys)),
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(len(keys)),
               "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-c", _ROLL_CALL, key], cwd=tmp_path,
                                      env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=90)[0] for p in procs]
    return [(p.returncode, out) for p, out in zip(procs, outputs)]


@pytest.mark.timeout(120, method="signal")
def test_two_processes_on_one_gpu_are_refused_and_distinct_gpus_join(tmp_path):
    """The GPU's UUID is the key (the same whatever index each process sees it at)."""
    shared = _roll_call(tmp_path, ["GPU-0a1b", "GPU-0a1b"])
    assert [code for code, _ in shared] == [3, 3], shared
    for _, out in shared:
        assert "two processes of the job would compute on the same GPU (GPU-0a1b" in out
        assert "one process per GPU" in out
    distinct = _roll_call(tmp_path, ["GPU-0a1b", "GPU-9f8e"])
    assert [code for code, _ in distinct] == [0, 0], distinct
