"""Compression arithmetic in one process: the sum over replicas is simulated by ``sum_fn``."""

from __future__ import annotations

import pytest
import torch

from replicator.comm import BucketLayout, Compression, NativeAllReduce, PowerSGD


def _times(world: int):
    """``sum_fn`` for ``world`` replicas that all hold the same tensor."""
    return lambda t: t.mul_(world)


def test_fp16_sum_survives_values_whose_sum_overflows_float16():
    x = torch.full((10,), 40000.0)           # x * 4 = 160000 > float16's 65504
    y = x.clone()
    Compression.fp16().all_reduce_sum(y, None, _times(4), 4)
    assert torch.allclose(y, x * 4, rtol=1e-3)


def test_cast_sends_the_narrow_dtype():
    seen = []
    for comp, dtype in ((Compression.fp16(), torch.float16), (Compression.bf16(), torch.bfloat16)):
        comp.all_reduce_sum(torch.randn(5), None, lambda t: seen.append(t.dtype), 2)
        assert seen[-1] == dtype


def test_error_feedback_keeps_the_long_run_sum_exact():
    g = torch.full((3,), 1.0 + 2 ** -10)       # not representable in bfloat16
    layout = BucketLayout.from_shapes(0, [(3,)])
    totals = {}
    for ef in (False, True):
        comp = Compression.bf16(error_feedback=ef)
        total = torch.zeros(3, dtype=torch.float64)
        for _ in range(512):
            y = g.clone()
            comp.all_reduce_sum(y, layout, _times(1), 1)
            total += y.double()
        totals[ef] = float((total - 512 * g.double()).abs().max())
    assert totals[False] > 0.4                 # the rounding error adds up without feedback
    assert totals[True] < 0.01                 # with it, at most one step's rounding remains


def test_cast_compression_rejects_integer_tensors():
    with pytest.raises(TypeError, match="floating-point"):
        Compression.fp16().all_reduce_sum(torch.ones(3, dtype=torch.int64), None, _times(1), 1)


def test_powersgd_is_exact_for_low_rank_matrices_and_sends_less():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(40, 2, generator=g) @ torch.randn(2, 30, generator=g)
    bias = torch.randn(30, generator=g)
    layout = BucketLayout.from_shapes(3, [m.shape, bias.shape])
    flat = torch.cat([m.reshape(-1), bias])
    sent = []

    def sum_fn(t):
        sent.append(t.numel())

    psgd = Compression.powersgd(rank=2)
    out = flat.clone()
    psgd.all_reduce_sum(out, layout, sum_fn, 1)
    assert torch.allclose(out[:1200].view(40, 30), m, atol=1e-4)
    assert torch.equal(out[1200:], bias)       # vectors travel uncompressed
    assert sum(sent) == 30 + 40 * 2 + 30 * 2   # bias + P + Q instead of 1230 numbers
    assert psgd.error_bytes() > 0


def test_powersgd_error_feedback_recovers_what_rank_one_misses():
    g = torch.Generator().manual_seed(1)
    m = torch.randn(16, 16, generator=g)       # full rank: rank 1 loses most of it per step
    layout = BucketLayout.from_shapes(0, [m.shape])
    for ef, bound in ((True, 0.25), (False, None)):
        psgd = PowerSGD(rank=1, error_feedback=ef)
        total = torch.zeros(16, 16)
        steps = 200
        for _ in range(steps):
            y = m.reshape(-1).clone()
            psgd.all_reduce_sum(y, layout, _times(1), 1)
            total += y.view(16, 16)
        rel = float((total / steps - m).norm() / m.norm())
        if bound is not None:
            assert rel < bound, rel
        else:
            assert rel > 0.5, rel               # without feedback the average stays rank 1


def test_powersgd_warm_up_steps_travel_uncompressed():
    layout = BucketLayout.from_shapes(0, [(8, 8)])
    psgd = PowerSGD(rank=1, warm_up_steps=2)
    sizes = []
    for _ in range(3):
        psgd.all_reduce_sum(torch.randn(64), layout, lambda t: sizes.append(t.numel()), 1)
    assert sizes == [64, 64, 8, 8]


def test_powersgd_compresses_only_where_it_saves():
    p = PowerSGD(rank=1)
    assert not p.compressible(torch.Size([100]))
    assert not p.compressible(torch.Size([2, 2]))        # (2 + 2) * 1 == 4: no saving
    assert p.compressible(torch.Size([4, 4]))
    assert p.compressible(torch.Size([8, 3, 3, 3]))      # conv kernel: 8 x 27
    assert not PowerSGD(rank=8).compressible(torch.Size([8, 8]))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_powersgd_rank_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="rank"):
        Compression.powersgd(rank=bad)


def test_algorithms_take_only_compression_objects():
    with pytest.raises(TypeError, match="Compression"):
        NativeAllReduce(compression="fp16")  # type: ignore[arg-type]
    assert "fp16" in repr(NativeAllReduce(compression=Compression.fp16()))


@pytest.mark.parametrize("make", [lambda: Compression.bf16(error_feedback=True),
                                  lambda: Compression.powersgd(rank=1)])
def test_bucket_state_is_keyed_by_owner_and_index(make):
    """Two synchronizers' bucket 0 keep separate state; sharing one key would mix them."""
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(12, 10, generator=g) for _ in range(2)]

    def run(comp, pairs):
        outs = []
        for _ in range(3):
            for owner, m in pairs:
                y = m.reshape(-1).clone()
                comp.all_reduce_sum(y, BucketLayout.from_shapes(0, [m.shape], owner=owner),
                                    _times(1), 1)
                outs.append(y)
        return outs

    alone = [run(make(), [(k, grads[k])]) for k in range(2)]
    shared = run(make(), [(0, grads[0]), (1, grads[1])])
    assert all(torch.equal(shared[2 * s + k], alone[k][s]) for s in range(3) for k in range(2))
    mixed = run(make(), [(0, grads[0]), (0, grads[1])])
    assert not all(torch.equal(a, b) for a, b in zip(mixed, shared))


def test_bucket_state_is_bounded_and_released_per_owner():
    psgd = PowerSGD(rank=1, max_buckets=3)
    for owner in range(2):
        for index in range(2):
            layout = BucketLayout.from_shapes(index, [(4, 4)], owner=owner)
            psgd.all_reduce_sum(torch.randn(16), layout, _times(1), 1)
    assert psgd._buckets.keys() == [(0, 1), (1, 0), (1, 1)]   # least recently used went first
    psgd.release(1)
    assert psgd._buckets.keys() == [(0, 1)]
    cast = Compression.fp16(error_feedback=True)
    cast.all_reduce_sum(torch.randn(4), BucketLayout.from_shapes(0, [(4,)], owner=7),
                        _times(1), 1)
    NativeAllReduce(compression=cast).release_buckets(7)
    assert len(cast._buckets) == 0
    with pytest.raises(ValueError, match="max_buckets"):
        PowerSGD(max_buckets=0)
