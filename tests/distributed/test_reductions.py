"""reduce, gather, all_reduce and the replica context on real processes."""

from __future__ import annotations

import pytest
import torch

import replicator as rp
from replicator.testing import run_distributed


def _check_reductions(_: int) -> dict:
    strategy = rp.MirroredStrategy()
    r, n = strategy.replica_id, strategy.num_replicas_in_sync
    values = [float(i + 1) for i in range(n)]          # replica i holds i + 1
    mine = values[r]
    out = {}
    for op in ("sum", "mean", "min", "max"):
        out[f"scalar_{op}"] = float(strategy.reduce(op, mine))
        out[f"tensor_{op}"] = strategy.reduce(rp.ReduceOp.parse(op),
                                              torch.tensor([mine, -mine])).tolist()
        out[f"ctx_{op}"] = float(rp.get_replica_context().all_reduce(op, torch.tensor(mine)))
    out["int_mean"] = float(strategy.reduce("mean", torch.tensor(r)))
    # axis reductions over uneven local batches: replica i holds i + 1 rows of value i + 1
    rows = torch.full((r + 1, 2), mine)
    out["axis_sum"] = strategy.reduce("sum", rows, axis=0).tolist()
    out["axis_mean"] = strategy.reduce("mean", rows, axis=0).tolist()
    out["axis_max"] = strategy.reduce("max", rows, axis=0).tolist()
    out["gather_uneven"] = strategy.gather(rows, axis=0)[:, 0].tolist()
    out["gather_axis1"] = strategy.gather(torch.full((2, r + 1), mine), axis=1)[0].tolist()
    out["gather_scalar"] = strategy.gather(torch.tensor(mine)).tolist()
    out["gather_empty"] = strategy.gather(torch.zeros(0, 3) if r == 0 else torch.ones(2, 3)
                                          ).shape[0]
    out["local_results"] = len(strategy.local_results(mine))
    out["ctx_id"] = strategy.run(lambda: rp.get_replica_context().replica_id_in_sync_group)
    out["ctx_n"] = rp.get_replica_context().num_replicas_in_sync
    return out


def _expected(n: int) -> dict:
    vals = [float(i + 1) for i in range(n)]
    exp = {}
    for op, f in (("sum", sum), ("mean", lambda v: sum(v) / len(v)), ("min", min), ("max", max)):
        exp[f"scalar_{op}"] = f(vals)
        exp[f"ctx_{op}"] = f(vals)
        neg = [-v for v in vals]
        exp[f"tensor_{op}"] = [f(vals), {"sum": sum, "mean": lambda v: sum(v) / len(v),
                                         "min": min, "max": max}[op](neg)]
    exp["int_mean"] = sum(range(n)) / n
    rows = [v for v in vals for _ in range(int(v))]
    exp["axis_sum"] = [sum(rows)] * 2
    exp["axis_mean"] = [sum(rows) / len(rows)] * 2
    exp["axis_max"] = [max(rows)] * 2
    exp["gather_uneven"] = rows
    exp["gather_axis1"] = rows
    exp["gather_scalar"] = vals
    exp["gather_empty"] = 2 * (n - 1)
    exp["local_results"] = 1
    exp["ctx_n"] = n
    return exp


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
def test_reduce_gather_all_reduce_values(world_size):
    results = run_distributed(_check_reductions, world_size=world_size, args=(0,))
    expected = _expected(world_size)
    for rank, got in enumerate(results):
        assert got["ctx_id"] == rank
        for key, value in expected.items():
            assert got[key] == pytest.approx(value), f"rank {rank} {key}"


def test_one_device_reduce_and_gather_are_local():
    s = rp.OneDeviceStrategy("cpu")
    assert s.num_replicas_in_sync == 1
    assert float(s.reduce("sum", 3.0)) == 3.0
    assert s.reduce("mean", torch.tensor([[1.0, 3.0], [3.0, 5.0]]), axis=0).tolist() == [2.0, 4.0]
    assert s.gather(torch.tensor(2.0)).tolist() == [2.0]
    assert s.run(lambda a, b=0: a + b, args=(1,), kwargs={"b": 2}) == 3
    with pytest.raises(ValueError, match="unknown reduce op 'median'"):
        s.reduce("median", 1.0)
    with pytest.raises(TypeError, match="reduce\\(\\) takes a tensor"):
        s.reduce("sum", "three")
    with pytest.raises(TypeError, match="args=\\(batch,\\)"):
        s.run(lambda x: x, args=torch.ones(1))
