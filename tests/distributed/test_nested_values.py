"""Nests everywhere a value is taken, ``axis`` as an int or a tuple, and tf.distribute's
ReplicaContext / ValueContext calls, on real processes against the one-device answer."""

from __future__ import annotations

import dataclasses
from collections import namedtuple

import pytest
import torch

import replicator as rp
from replicator.errors import CollectiveMismatchError
from replicator.testing import run_distributed

Pair = namedtuple("Pair", "scalar vector")


@dataclasses.dataclass(frozen=True)
class Stats:
    loss: torch.Tensor
    count: torch.Tensor
    scale: float = 2.0


OPS = ("sum", "mean", "min", "max")
#: axes that include the batch dimension (rows differ per replica) and axes that do not
BATCH_AXES = (0, -3, (0, 1), (0, -1), (0, 1, 2))
OTHER_AXES = (None, 1, -1, (1, 2), (-2, -1))


def _uneven(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(3 + 2 * rank, 4, 2, generator=g, dtype=torch.float64)


def _even(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(20 + rank)
    return torch.randn(3, 4, 2, generator=g, dtype=torch.float64)


def _key(op: str, axis: object) -> str:
    return f"{op} axis={axis!r}"


def _axis_results(_: int) -> dict:
    strategy = rp.MirroredStrategy()
    r = strategy.replica_id
    out = {}
    for op in OPS:
        for axis in BATCH_AXES:
            out["batch " + _key(op, axis)] = strategy.reduce(op, _uneven(r), axis=axis)
        for axis in OTHER_AXES:
            out["other " + _key(op, axis)] = strategy.reduce(op, _even(r), axis=axis)
        # a replica with no rows: min/max/mean over the others' rows
        empty = torch.zeros(0, 4, 2, dtype=torch.float64) if r == 1 else _uneven(r)
        out["empty " + _key(op, 0)] = strategy.reduce(op, empty, axis=0)
    # integer input: exact sums, a float mean
    ints = torch.arange(6, dtype=torch.int64).reshape(3, 2) + 10 * r
    out["int mean (0, 1)"] = strategy.reduce("mean", ints, axis=(0, 1))
    out["int max -1"] = strategy.reduce("max", ints, axis=-1)
    return out


@pytest.mark.timeout(120)
def test_every_op_and_axis_equals_one_device():
    n = 2
    results = run_distributed(_axis_results, world_size=n, args=(0,))
    one = rp.OneDeviceStrategy("cpu")
    for op in OPS:
        whole = torch.cat([_uneven(r) for r in range(n)])
        for axis in BATCH_AXES:  # the one-device answer over the global batch
            expected = one.reduce(op, whole, axis=axis)
            for rank, got in enumerate(results):
                torch.testing.assert_close(got["batch " + _key(op, axis)], expected,
                                           msg=f"rank {rank} {op} axis={axis}")
        stacked = torch.stack([_even(r) for r in range(n)])  # replicas as a new first axis
        for axis in OTHER_AXES:
            dims = (0,) if axis is None else (0, *(
                (a % 3) + 1 for a in ((axis,) if isinstance(axis, int) else axis)))
            expected = one.reduce(op, stacked, axis=dims)
            for rank, got in enumerate(results):
                torch.testing.assert_close(got["other " + _key(op, axis)], expected,
                                           msg=f"rank {rank} {op} axis={axis}")
        expected = one.reduce(op, _uneven(0), axis=0)  # rank 1 had no rows
        for got in results:
            torch.testing.assert_close(got["empty " + _key(op, 0)], expected)
    ints = torch.cat([torch.arange(6).reshape(3, 2) + 10 * r for r in range(n)])
    for got in results:
        assert got["int mean (0, 1)"].item() == pytest.approx(ints.double().mean().item())
        assert got["int mean (0, 1)"].dtype == torch.get_default_dtype()
        assert got["int max -1"].tolist() == [11, 13, 15]


def _nest_results(_: int) -> dict:
    strategy = rp.MirroredStrategy()
    r = strategy.replica_id
    x = torch.tensor([1.0, 2.0]) * (r + 1)
    out: dict = {}
    out["tuple"] = strategy.reduce("sum", (x + 1, x - 1))
    big = torch.tensor([2**60 + r], dtype=torch.int64)  # exact beyond float64's 2**53
    out["dict"] = strategy.reduce("sum", {"f": x, "i": big, "b": torch.tensor([r == 0])})
    out["dict_max"] = strategy.reduce("max", {"f": x, "i": big})
    out["mean_int"] = strategy.reduce("mean", [torch.tensor(r), x])
    out["namedtuple"] = strategy.reduce("mean", Pair(torch.tensor(float(r)), x))
    out["dataclass"] = strategy.reduce("sum", Stats(x, torch.tensor(r + 1)))
    out["none_leaf"] = strategy.reduce("sum", {"a": x, "b": None})
    out["python_numbers"] = strategy.reduce("max", (r, float(r) / 2))
    out["axis_nest"] = strategy.reduce("mean", {"rows": torch.ones(2 + r, 3) * r,
                                                "cols": torch.ones(1 + r, 2) * r}, axis=0)

    def step() -> dict:
        ctx = rp.get_replica_context()
        pair = ctx.all_reduce("sum", (torch.tensor(1.0), torch.arange(3.0) * r))
        gathered = ctx.all_gather({"id": torch.tensor([r]), "rows": torch.ones(r + 1, 2)})
        merged = ctx.merge_call(lambda s, a, b=0: (type(s).__name__, a + b), args=(r,),
                                kwargs={"b": 10})
        return {"loss": x.sum(), "acc": torch.tensor(0.5 * r), "pair": pair,
                "gathered": gathered, "merged": merged}

    per_replica = strategy.run(step)
    out["ctx_pair"] = per_replica["pair"]
    out["ctx_gathered"] = per_replica["gathered"]
    out["merged"] = per_replica["merged"]
    out["run_dict"] = strategy.reduce("mean", {"loss": per_replica["loss"],
                                               "acc": per_replica["acc"]})
    out["gather_list"] = strategy.gather([torch.full((r + 1, 2), float(r)),
                                          torch.tensor(r), torch.tensor([r == 1])])
    out["gather_dict"] = strategy.gather({"x": torch.full((2, r + 1), r, dtype=torch.int16),
                                          "big": big}, axis=-1)
    # one fused collective per call: a nest costs what one tensor costs
    tracker = strategy.collectives.tracker
    before = tracker.seq
    strategy.reduce("sum", x)
    one = tracker.seq - before
    before = tracker.seq
    strategy.reduce("sum", {"a": x, "b": (x, x * 2), "c": torch.tensor(r, dtype=torch.int32)})
    out["fused"] = (one, tracker.seq - before)
    before = tracker.seq
    strategy.gather(x)
    one = tracker.seq - before
    before = tracker.seq
    strategy.gather([x, torch.tensor([r]), torch.ones(r, 3, dtype=torch.bool)])
    out["fused_gather"] = (one, tracker.seq - before)
    # tf's local results and values from a function
    out["local"] = strategy.experimental_local_results(x)
    out["values"] = strategy.experimental_distribute_values_from_function(
        lambda ctx: (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync))
    out["values2"] = strategy.distribute_values_from_function(
        lambda ctx: torch.tensor(float(ctx.replica_id_in_sync_group)))
    # replicas passing different nests: an error on every replica, not a wrong pairing
    swapped = {"a": x, "b": x * 2} if r == 0 else {"b": x, "a": x * 2}
    try:
        strategy.reduce("sum", swapped)
        out["mismatch"] = "no error"
    except CollectiveMismatchError as exc:
        out["mismatch"] = str(exc)
    return out


@pytest.mark.timeout(120)
def test_nests_reduce_gather_and_context_calls():
    results = run_distributed(_nest_results, world_size=2, args=(0,))
    x = [torch.tensor([1.0, 2.0]) * (r + 1) for r in range(2)]
    for rank, got in enumerate(results):
        a, b = got["tuple"]
        assert isinstance(got["tuple"], tuple)
        assert a.tolist() == [5.0, 8.0] and b.tolist() == [1.0, 4.0]
        assert got["dict"]["f"].tolist() == [3.0, 6.0]
        assert got["dict"]["i"].tolist() == [2**61 + 1] and got["dict"]["i"].dtype == torch.int64
        assert got["dict"]["b"].dtype == torch.bool and got["dict"]["b"].tolist() == [True]
        assert got["dict_max"]["i"].tolist() == [2**60 + 1]
        assert got["mean_int"][0].item() == 0.5 and got["mean_int"][1].tolist() == [1.5, 3.0]
        assert type(got["namedtuple"]) is Pair and got["namedtuple"].scalar.item() == 0.5
        assert isinstance(got["dataclass"], Stats) and got["dataclass"].scale.item() == 4.0
        assert got["dataclass"].count.item() == 3
        assert got["dataclass"].loss.tolist() == [3.0, 6.0]
        assert got["none_leaf"]["b"] is None
        assert [float(v) for v in got["python_numbers"]] == [1.0, 0.5]
        assert got["axis_nest"]["rows"].tolist() == pytest.approx([3 / 5] * 3)
        assert got["axis_nest"]["cols"].tolist() == pytest.approx([2 / 3] * 2)
        scalar, vector = got["ctx_pair"]
        assert scalar.item() == 2.0 and vector.tolist() == [0.0, 1.0, 2.0]
        assert got["ctx_gathered"]["id"].tolist() == [0, 1]
        assert got["ctx_gathered"]["rows"].shape == (3, 2)
        assert got["merged"] == ("MirroredStrategy", rank + 10)
        assert got["run_dict"]["loss"].item() == pytest.approx((x[0].sum() + x[1].sum()) / 2)
        assert got["run_dict"]["acc"].item() == pytest.approx(0.25)
        rows, ids, flags = got["gather_list"]
        assert rows[:, 0].tolist() == [0.0, 1.0, 1.0] and ids.tolist() == [0, 1]
        assert flags.tolist() == [False, True]
        assert got["gather_dict"]["x"].dtype == torch.int16
        assert got["gather_dict"]["x"][0].tolist() == [0, 1, 1]
        assert got["gather_dict"]["big"].tolist() == [2**60, 2**60 + 1]
        assert got["fused"][1] == got["fused"][0], got["fused"]
        assert got["fused_gather"][1] == got["fused_gather"][0], got["fused_gather"]
        assert got["local"][0].tolist() == x[rank].tolist() and len(got["local"]) == 1
        assert got["values"] == (rank, 2)
        assert got["values2"].item() == float(rank)
        assert "'a'" in got["mismatch"] and "'b'" in got["mismatch"], got["mismatch"]


def test_one_device_nests_and_context():
    s = rp.OneDeviceStrategy("cpu")
    value = {"a": (torch.tensor(1.0), [torch.tensor([2, 3])]), "b": Pair(1, 2.5)}
    out = s.reduce("sum", value)
    assert out["a"][1][0].tolist() == [2, 3] and isinstance(out["b"], Pair)
    assert s.reduce("mean", torch.ones(2, 3), axis=(0, 1)).item() == 1.0
    assert s.gather({"k": torch.tensor(3)})["k"].tolist() == [3]
    ctx = rp.get_replica_context()
    assert ctx.merge_call(lambda strategy, v: v * 2, args=(4,)) == 8
    assert s.distribute_values_from_function(lambda c: c.num_replicas_in_sync) == 1
    with pytest.raises(TypeError, match="nest"):
        s.reduce("sum", {"a": "text"})
    with pytest.raises(ValueError, match="twice"):
        s.reduce("sum", torch.ones(2, 2), axis=(0, -2))
    with pytest.raises(ValueError, match="out of range"):
        s.reduce("mean", torch.ones(2, 2), axis=(0, 2))
