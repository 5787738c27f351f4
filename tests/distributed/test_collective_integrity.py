"""Replicas that enter different collectives get CollectiveMismatchError on every rank, naming
each rank's call and line, instead of a silently wrong number or a crash inside gloo; and
Collectives work on a sub-group."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import replicator as rp
from replicator.comm.collective_tracker import CollectiveTracker
from replicator.comm.collectives import FRAME_BYTES, Collectives
from replicator.comm.reduce_op import ReduceOp
from replicator.errors import CollectiveMismatchError
from replicator.testing import run_distributed
from tests.helpers import hang


def _caught(fn) -> dict:
    try:
        value = fn()
    except CollectiveMismatchError as exc:
        return {"kind": type(exc).__name__, "text": str(exc), "calls": exc.calls}
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return {"kind": type(exc).__name__, "text": str(exc), "calls": {}}
    return {"kind": "", "value": value.tolist() if isinstance(value, torch.Tensor) else value}


def _here() -> str:
    """``file:line`` of the caller's next line (where the collective is called)."""
    frame = sys._getframe(1)
    return f"{frame.f_code.co_filename}:{frame.f_lineno + 1}"


def _reduce_against_backward(_: int) -> dict:
    strategy = rp.MirroredStrategy()
    rank = strategy.replica_id
    with strategy.scope():
        tiny = nn.Linear(1, 1, bias=False)          # one gradient element: equal payload sizes
    with strategy.scope():
        big = nn.Linear(64, 32)                     # payload sizes differ: gloo would abort
    out: dict = {}
    for name, model, width in (("tiny", tiny, 1), ("big", big, 64)):
        loss = model(torch.ones(4, width)).sum()
        if rank == 0:
            out[f"{name}_site"] = _here()
            out[name] = _caught(lambda loss=loss: strategy.reduce("mean", loss.detach()))
        else:
            out[f"{name}_site"] = _here()
            out[name] = _caught(lambda loss=loss: loss.backward())
    # both ranks detected the mismatch in the same exchange: the job goes on, aligned
    tiny.weight.grad = None  # rank 1 kept the gradient of its aborted backward
    loss = tiny(torch.full((2, 1), float(rank + 1))).sum()
    loss.backward()
    out["grad_after"] = tiny.weight.grad.item()
    out["reduce_after"] = strategy.reduce("sum", torch.tensor(float(rank + 1))).item()
    # the per-pass check is one extra (small) collective, and check=False removes it
    tracker, sync = strategy.collectives.tracker, strategy._replica_group.synchronizers[0]
    counts = []
    for check in (True, False):
        sync.check = check
        before = tracker.seq
        tiny(torch.ones(2, 1)).sum().backward()
        counts.append(tracker.seq - before)
    out["collectives_per_pass"] = counts
    # two synchronizers in one backward (the same on every rank): both average correctly
    tiny.weight.grad = None
    big.zero_grad(set_to_none=True)
    (tiny(torch.full((1, 1), float(rank))).sum() + big(torch.ones(1, 64)).sum() * rank).backward()
    out["two_models"] = [tiny.weight.grad.item(), big.bias.grad[0].item()]
    return out


@pytest.mark.timeout(120)
def test_reduce_on_one_rank_while_the_other_runs_backward_raises_on_both():
    a, b = run_distributed(_reduce_against_backward, world_size=2, args=(0,),
                           timeout_seconds=20)
    for name in ("tiny", "big"):
        for res in (a[name], b[name]):
            assert res["kind"] == "CollectiveMismatchError", res
            assert set(res["calls"]) == {0, 1}, res
            assert "reduce(mean)" in res["calls"][0] and "shape ()" in res["calls"][0], res
            assert "gradient averaging of synchronizer" in res["calls"][1], res
            assert a[f"{name}_site"] in res["calls"][0], (a[f"{name}_site"], res)
            assert b[f"{name}_site"] in res["calls"][1], (b[f"{name}_site"], res)
            assert "rank 0:" in res["text"] and "rank 1:" in res["text"], res["text"]
            assert "HINT" in res["text"] and "depends on the rank" in res["text"], res["text"]
        assert a[name]["text"] == b[name]["text"]
    # the synchronizer sent nothing before the verdict, so the next pass is correct:
    # d/dw of sum(w * x) over 2 rows of value r + 1, averaged over ranks = (2 + 4) / 2
    assert a["grad_after"] == b["grad_after"] == pytest.approx(3.0)
    assert a["reduce_after"] == b["reduce_after"] == 3.0
    assert a["two_models"] == b["two_models"] == [0.5, 0.5]
    on, off = a["collectives_per_pass"]
    assert on > off >= 1 and b["collectives_per_pass"] == [on, off]


def _plain_mismatches(_: int) -> dict:
    strategy = rp.MirroredStrategy()
    rank = strategy.replica_id
    coll = strategy.collectives
    out: dict = {}
    # the same reduce with different shapes
    out["shapes"] = _caught(lambda: strategy.reduce("sum", torch.ones(3 if rank == 0 else 4)))
    # gather along an uneven first axis is fine (only that axis may differ) ...
    out["gather"] = _caught(lambda: strategy.gather(torch.full((rank + 1, 2), float(rank))))
    # ... but not a difference in another axis
    out["gather_bad"] = _caught(lambda: strategy.gather(torch.ones(2, 2 + rank)))
    # broadcast against all_reduce, same element count
    t = torch.ones(4)
    if rank == 0:
        out["bcast"] = _caught(lambda: coll.broadcast_([t], src=0))
    else:
        out["bcast"] = _caught(lambda: coll.all_reduce(t, ReduceOp.SUM))
    # a barrier against a byte exchange (different sizes on the wire)
    if rank == 0:
        out["barrier"] = _caught(lambda: coll.barrier())
    else:
        out["barrier"] = _caught(lambda: coll.all_gather_bytes(b"x" * 1000))
    out["bytes"] = [x.decode() for x in coll.all_gather_bytes(f"r{rank}".encode() * (rank + 1))]
    out["long_bytes"] = _long_exchanges(coll)
    out["after"] = strategy.reduce("sum", torch.tensor([1.0, 2.0])).tolist()
    return out


def _long_exchanges(coll: Collectives) -> bool:
    """Byte strings and uneven tensors around the one-collective frame (FRAME_BYTES) arrive
    whole: one rank's longer, both longer, both within."""
    rank = coll.rank
    for lengths in ((FRAME_BYTES + 904, 7), (FRAME_BYTES, FRAME_BYTES + 1), (3, 0)):
        mine = bytes([65 + rank]) * lengths[rank % 2]
        got = coll.all_gather_bytes(mine)
        if got != [bytes([65 + r]) * lengths[r % 2] for r in range(coll.world_size)]:
            return False
    rows = 1500 * (rank % 2)  # 6000 bytes of float32 on odd ranks, none on even ones
    gathered = coll.all_gather_uneven(torch.full((rows,), float(rank)))
    expected = [float(r) for r in range(coll.world_size) for _ in range(1500 * (r % 2))]
    return gathered.tolist() == expected


@pytest.mark.timeout(120)
def test_mismatched_plain_collectives_raise_and_matched_ones_work():
    a, b = run_distributed(_plain_mismatches, world_size=2, args=(0,), timeout_seconds=20)
    for res in (a, b):
        assert res["shapes"]["kind"] == "CollectiveMismatchError"
        assert "shape (3,)" in res["shapes"]["calls"][0]
        assert "shape (4,)" in res["shapes"]["calls"][1]
        assert res["gather"] == {"kind": "", "value": [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]}
        assert res["gather_bad"]["kind"] == "CollectiveMismatchError"
        assert "shape (*, 2)" in res["gather_bad"]["calls"][0]
        assert "shape (*, 3)" in res["gather_bad"]["calls"][1]
        assert res["bcast"]["kind"] == "CollectiveMismatchError", res["bcast"]
        assert "broadcast" in res["bcast"]["calls"][0]
        assert "all_reduce sum" in res["bcast"]["calls"][1]
        assert res["barrier"]["kind"] == "CollectiveMismatchError", res["barrier"]
        assert "barrier" in res["barrier"]["calls"][0]
        assert "bytes" in res["barrier"]["calls"][1]
        assert res["bytes"] == ["r0", "r1r1"]
        assert res["long_bytes"]
        assert res["after"] == [2.0, 4.0]


def _sub_group(_: int) -> dict:
    strategy = rp.MirroredStrategy()
    rank = strategy.replica_id
    group = dist.new_group([1, 2], timeout=timedelta(seconds=20))
    dist.barrier()  # gloo: rank 0 must not end while 1 and 2 still connect their group
    out: dict = {}
    if rank == 0:  # not a member: cannot build collectives over the group
        out["outsider"] = _caught(lambda: Collectives.for_group(group, torch.device("cpu"), 5))
        return out
    coll = Collectives.for_group(group, torch.device("cpu"), 5)
    out["position"] = [coll.rank, coll.world_size, coll.global_rank]
    t = torch.tensor([float(rank)])
    coll.broadcast_([t], src=1)  # group rank 1 = global rank 2
    out["broadcast"] = t.item()
    out["sum"] = coll.all_reduce(torch.tensor(float(rank)), ReduceOp.SUM).item()
    out["gather"] = coll.all_gather_uneven(torch.full((rank,), float(rank))).tolist()
    out["long_bytes"] = _long_exchanges(coll)
    if rank == 1:
        out["mismatch"] = _caught(lambda: coll.barrier())
    else:
        out["mismatch"] = _caught(lambda: coll.all_reduce(torch.ones(1), ReduceOp.MAX))
    return out


@pytest.mark.timeout(120)
def test_collectives_on_a_sub_group_use_group_ranks_and_name_global_ones():
    r0, r1, r2 = run_distributed(_sub_group, world_size=3, args=(0,), timeout_seconds=20)
    assert r0["outsider"]["kind"] == "ValueError" and "not a member" in r0["outsider"]["text"]
    assert r1["position"] == [0, 2, 1] and r2["position"] == [1, 2, 2]
    assert r1["broadcast"] == r2["broadcast"] == 2.0
    assert r1["sum"] == r2["sum"] == 3.0
    assert r1["gather"] == r2["gather"] == [1.0, 2.0, 2.0]
    assert r1["long_bytes"] and r2["long_bytes"]  # over gloo (no shared memory on this group)
    for res in (r1, r2):
        calls = res["mismatch"]["calls"]
        assert set(calls) == {1, 2}, res  # keyed by global rank
        assert "barrier" in calls[1] and "all_reduce max" in calls[2]


def _tracker_roles(gave_up: str) -> dict:
    from replicator.cluster.process_group import current_group, open_store_client

    rp.MirroredStrategy()
    rank = dist.get_rank()
    group = dist.new_group([0, 2], timeout=timedelta(seconds=3))
    dist.barrier()  # gloo: rank 1 must not end while 0 and 2 still connect their group
    if rank == 1:
        return {}
    store = open_store_client(current_group())
    tracker = CollectiveTracker.for_group(group, store, roles={0: "worker", 2: "ps"})
    coll = Collectives.for_group(group, torch.device("cpu"), 3, tracker)
    coll.barrier()
    if rank == 2:  # the parameter server stays behind: rank 0 times out naming it
        hang(6, gave_up)  # 6 s, or until rank 0 has its error
        tracker.close()
        return {"tag": tracker.tag}
    res = _caught(lambda: coll.all_reduce(torch.ones(1), ReduceOp.SUM))
    Path(gave_up).touch()
    tracker.close()
    return {"tag": tracker.tag, **res}


@pytest.mark.timeout(120)
def test_tracker_names_missing_ranks_by_global_rank_and_role(tmp_path):
    r0, _, r2 = run_distributed(_tracker_roles, world_size=3,
                                args=(str(tmp_path / "gave_up"),), timeout_seconds=20)
    assert r0["tag"] == r2["tag"] == "r0-2"
    assert r0["kind"] == "ReplicaTimeoutError", r0
    assert "rank 2 (ps)" in r0["text"], r0["text"]


def _large_payloads(implementation: str) -> dict:
    options = rp.CommunicationOptions(implementation=implementation)
    strategy = rp.MirroredStrategy(communication_options=options)
    rank = strategy.replica_id
    coll = strategy.collectives
    big = torch.arange(40_000, dtype=torch.float32) * (rank + 1)        # 160 KB: pays
    out: dict = {"shm": coll.uses_shared_memory}
    out["sum"] = strategy.reduce("sum", big)[-3:].tolist()
    out["mean"] = strategy.reduce("mean", big.double())[:2].tolist()
    out["max"] = strategy.reduce("max", big)[-1].item()
    out["min"] = strategy.reduce("min", torch.tensor([float(rank), -float(rank)])).tolist()
    rows = torch.full((rank + 1, 30_000), float(rank))                  # uneven, 120-240 KB
    gathered = strategy.gather(rows)
    out["gather"] = [list(gathered.shape), gathered[:, 0].tolist()]
    params = [torch.full((50_000,), float(rank)), torch.full((7,), float(rank) + 0.5),
              torch.full((3, 4), float(rank)).t()]                      # one not contiguous
    coll.broadcast_(params, src=1)
    out["bcast"] = [p.flatten()[0].item() for p in params]
    if rank == 0:  # a large reduce against a large gather: caught before any payload moves
        out["mismatch"] = _caught(lambda: strategy.reduce("sum", big))
    else:
        out["mismatch"] = _caught(lambda: strategy.gather(rows))
    out["after"] = strategy.reduce("sum", big)[1].item()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("implementation", ["shared_memory", "gloo"])
def test_large_payloads_and_fingerprints_through_either_path(implementation):
    a, b = run_distributed(_large_payloads, world_size=2, args=(implementation,),
                           timeout_seconds=20)
    assert a["shm"] is b["shm"] is (implementation == "shared_memory")
    for res in (a, b):
        assert res["sum"] == [39_997.0 * 3, 39_998.0 * 3, 39_999.0 * 3]
        assert res["mean"] == [0.0, 1.5]
        assert res["max"] == 39_999.0 * 2
        assert res["min"] == [0.0, -1.0]
        assert res["gather"] == [[3, 30_000], [0.0, 1.0, 1.0]]
        assert res["bcast"] == [1.0, 1.5, 1.0]
        assert res["mismatch"]["kind"] == "CollectiveMismatchError", res["mismatch"]
        assert res["after"] == 3.0
