"""Single-process behaviour of the strategy API: names, ops, losses, buckets, input splits."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import replicator as rp
from replicator.cluster import process_group
from replicator.comm.gradient_sync import make_buckets
from replicator.data.batching import GlobalBatchSplitSampler, slice_bounds


def test_reduce_op_parse():
    assert rp.ReduceOp.parse("SUM") is rp.ReduceOp.SUM
    assert rp.ReduceOp.parse("avg") is rp.ReduceOp.MEAN
    assert rp.ReduceOp.parse(rp.ReduceOp.MAX) is rp.ReduceOp.MAX
    with pytest.raises(ValueError, match="'sum', 'mean', 'min', 'max'"):
        rp.ReduceOp.parse("prod")


def test_get_strategy_by_name_and_suggestion():
    assert isinstance(rp.get_strategy("one_device"), rp.OneDeviceStrategy)
    assert isinstance(rp.get_strategy("OneDeviceStrategy", device="cpu"), rp.OneDeviceStrategy)
    with pytest.raises(ValueError, match="Did you mean 'mirrored'"):
        rp.get_strategy("mirroed")
    available = set(rp.strategies.available_strategies())
    assert {"one_device", "mirrored", "multi_worker_mirrored"} <= available


def test_every_built_in_strategy_is_known_by_name_in_a_fresh_interpreter():
    # the parameter server registers itself from its own room (above strategies): rp's
    # get_strategy must know it before anything else imported that room, as the demo's
    # ``--strategy ps`` check needs
    code = ("import replicator as rp, sys\n"
            "names = rp.available_strategies()\n"
            "from replicator.demo.options import strategy_refusal\n"
            "print(sorted(names), strategy_refusal('ps', 3, num_ps=1))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "'parameter_server'" in out and out.strip().endswith("None"), out


def test_compute_average_loss_on_one_device_is_the_mean():
    per_example = torch.tensor([1.0, 2.0, 3.0, 6.0])
    assert float(rp.compute_average_loss(per_example)) == pytest.approx(3.0)
    assert float(rp.compute_average_loss(per_example, global_batch_size=8)) == pytest.approx(1.5)
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    assert float(rp.compute_average_loss(per_example, 3, sample_weight=mask)) == \
        pytest.approx(2.0)
    assert float(rp.compute_average_loss(per_example, sample_weight=mask)) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="must be positive"):
        rp.compute_average_loss(per_example, global_batch_size=0)


def test_input_context_per_replica_batch():
    ctx = rp.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=2)
    assert ctx.get_per_replica_batch_size(64) == 32
    with pytest.raises(ValueError, match="not divisible by the 2 replicas"):
        ctx.get_per_replica_batch_size(63)


def test_global_batches_are_identical_for_one_and_two_replicas():
    one = list(GlobalBatchSplitSampler(100, 8, 0, 1, shuffle=True, seed=5))
    two = [list(GlobalBatchSplitSampler(100, 8, r, 2, shuffle=True, seed=5)) for r in (0, 1)]
    assert len(one) == len(two[0]) == 13
    for b, batch in enumerate(one):
        assert batch == two[0][b] + two[1][b]
    assert sorted(i for b in one for i in b) == list(range(100))
    with pytest.raises(ValueError, match="not divisible by the 2 replicas"):
        GlobalBatchSplitSampler(100, 7, 0, 2, shuffle=False)


def test_slice_bounds_cover_the_batch_evenly():
    parts = [slice_bounds(10, r, 3) for r in range(3)]
    assert parts == [(0, 4), (4, 7), (7, 10)]


def test_buckets_follow_reverse_order_and_size_limits():
    params = [torch.nn.Parameter(torch.zeros(1000)) for _ in range(10)]  # 4 KB each
    buckets = make_buckets(params, bucket_bytes=10_000, first_bucket_bytes=5_000)
    assert [len(b.params) for b in buckets] == [1, 2, 2, 2, 2, 1]
    assert buckets[0].params[0] is params[-1]
    assert [len(b.params) for b in make_buckets(params, 0)] == [1] * 10


def test_distribute_dataset_rejects_what_it_cannot_split():
    s = rp.OneDeviceStrategy("cpu")
    with pytest.raises(TypeError, match="DataLoader or a Dataset"):
        s.distribute_dataset([1, 2, 3])
    ds = torch.utils.data.TensorDataset(torch.arange(10))
    with pytest.raises(ValueError, match="needs batch_size=GLOBAL_BATCH"):
        s.distribute_dataset(ds)
    batches = [b[0].tolist() for b in s.distribute_dataset(ds, batch_size=4)]
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_register_strategy_refuses_to_replace_a_name_unless_asked():
    from replicator.strategies.registry import _REGISTRY

    class Custom(rp.OneDeviceStrategy):
        name = "mirrored"

    with pytest.raises(ValueError, match="already registered.*override=True"):
        rp.strategies.register_strategy(Custom)
    assert _REGISTRY["mirrored"] is rp.MirroredStrategy
    before = dict(_REGISTRY)
    try:
        rp.strategies.register_strategy(Custom, override=True)
        assert _REGISTRY["mirrored"] is Custom
    finally:
        _REGISTRY.clear()
        _REGISTRY.update(before)
    with pytest.raises(TypeError, match="Strategy subclass"):
        rp.strategies.register_strategy(object)  # type: ignore[arg-type]


def test_multi_worker_mirrored_takes_an_algorithm_as_first_argument():
    strategy = rp.MultiWorkerMirroredStrategy(rp.comm.RingAllReduce())
    try:
        assert isinstance(strategy.cross_device_ops, rp.comm.RingAllReduce)
        with pytest.raises(TypeError, match="two all-reduce algorithms"):
            rp.MultiWorkerMirroredStrategy(rp.comm.RingAllReduce(),
                                           cross_device_ops=rp.comm.NativeAllReduce())
        with pytest.raises(TypeError, match="CommunicationOptions"):
            rp.MultiWorkerMirroredStrategy("ring")  # type: ignore[arg-type]
    finally:
        strategy.close()
        process_group.shutdown()  # the group it started in this process: later tests expect none
