"""Failures of the algorithms end with errors that name the rank and the operation, never a
hang, and leave no shared memory behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import replicator as rp
from replicator.comm import RingAllReduce, SharedMemoryAllReduce
from replicator.comm.shm_segment import check_same_host
from replicator.testing import run_distributed
from tests.helpers import hang, shm_segments_made_by


def _error(fn) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "", "no error", time.monotonic() - start


def _stragglers(folder: str) -> dict:
    strategy = rp.MirroredStrategy()
    rank = strategy.replica_id
    x = torch.ones(1000)
    quick = SharedMemoryAllReduce(timeout_seconds=2)
    patient = SharedMemoryAllReduce(timeout_seconds=60)
    ring = RingAllReduce()
    for algo in (quick, patient, ring):
        algo.all_reduce_sum(x)  # set-up succeeds on both ranks
    out = {}
    gave_up = [Path(folder) / "gave_up_1", Path(folder) / "gave_up_2"]
    # 1. rank 1 is late for a shared-memory all-reduce: rank 0 times out naming rank 1
    if rank == 0:
        out["shm_timeout"] = _error(lambda: quick.all_reduce_sum(x))
        gave_up[0].touch()
    else:
        hang(3, gave_up[0])
    dist.barrier()
    # 2. rank 1 skips a ring all-reduce: the background thread's error reaches wait()
    if rank == 0:
        out["ring_timeout"] = _error(lambda: ring.all_reduce_sum_async(x).wait())
        gave_up[1].touch()
    else:
        hang(5, gave_up[1])
    dist.barrier()
    # 3. rank 1 exits while rank 0 waits in shared memory: noticed long before the timeout
    if rank == 0:
        out["shm_peer_exit"] = _error(lambda: patient.all_reduce_sum(x))
    return out


@pytest.mark.timeout(90)
def test_late_or_missing_ranks_give_errors_that_name_them(tmp_path):
    """Rank 1 stays away (3 s, 5 s, or until rank 0 has its error) where rank 0 waits."""
    a, _ = run_distributed(_stragglers, world_size=2, args=(str(tmp_path),), timeout_seconds=3)
    kind, text, seconds = a["shm_timeout"]
    assert kind == "ReplicaTimeoutError" and "rank 0" in text and "rank(s) 1" in text, text
    assert 1.5 < seconds < 10
    kind, text, seconds = a["ring_timeout"]
    assert kind == "ReplicaTimeoutError", (kind, text)
    assert "ring all-reduce" in text and "rank 0" in text and "timed out waiting" in text, text
    assert seconds < 10
    kind, text, seconds = a["shm_peer_exit"]
    assert kind == "ReplicatorError" and "rank 1 finished its script normally" in text, text
    assert seconds < 20


def _segment_set_up_fails(gave_up: str) -> dict:
    rp.MirroredStrategy()
    rank = dist.get_rank()
    if rank == 1:  # agrees that the ranks share a host, then never maps the segment
        check_same_host(None, "test")
        hang(6, gave_up)  # 6 s, or until rank 0 has its error and has looked for segments
        return {}
    kind, text, _ = _error(lambda: SharedMemoryAllReduce().all_reduce_sum(torch.ones(10)))
    left = shm_segments_made_by([os.getpid()])
    Path(gave_up).touch()
    return {"kind": kind, "text": text, "left": left}


@pytest.mark.timeout(60)
def test_failed_set_up_leaves_no_shared_memory(tmp_path):
    a, _ = run_distributed(_segment_set_up_fails, world_size=2,
                           args=(str(tmp_path / "gave_up"),), timeout_seconds=3)
    assert a["kind"] in ("ReplicaTimeoutError", "ReplicatorError"), a
    assert "rank 0" in a["text"], a["text"]
    assert a["left"] == []
