"""Every all-reduce algorithm equals torch.distributed.all_reduce, on real gloo processes.

One launch per world size runs every algorithm over every size and dtype (process start costs
seconds; the collectives themselves are fast).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import replicator as rp
from replicator.comm import (
    Compression,
    HierarchicalAllReduce,
    NativeAllReduce,
    ReductionToOneDevice,
    RingAllReduce,
    SharedMemoryAllReduce,
)
from replicator.testing import run_distributed
from tests.helpers import shm_segments_made_by

SIZES = (0, 1, 7, 1000, 1_000_003)
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _algorithms(world: int) -> dict[str, rp.comm.CrossDeviceOps]:
    return {
        "native": NativeAllReduce(),
        "ring": RingAllReduce(),
        "ring_small_segments": RingAllReduce(segment_bytes=4096, depth=2),
        "hierarchical": HierarchicalAllReduce(),
        "hierarchical_2_per_node": HierarchicalAllReduce(ranks_per_node=2),
        "hierarchical_1_per_node_ring": HierarchicalAllReduce(ranks_per_node=1,
                                                              inter_node=RingAllReduce()),
        "reduce_to_one_last": ReductionToOneDevice(destination=world - 1),
        "shared_memory": SharedMemoryAllReduce(),
        "shared_memory_small_pieces": SharedMemoryAllReduce(piece_bytes=65536),
    }


def _data(n: int, dtype: torch.dtype, rank: int, integers: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    if integers:  # small integers: every dtype sums them exactly, in any order
        return torch.randint(-8, 9, (n,), generator=g).to(dtype)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def _compare(name: str, ours: torch.Tensor, ref: torch.Tensor, exact: bool, world: int
             ) -> str | None:
    if ours.shape != ref.shape or ours.dtype != ref.dtype:
        return f"{name}: got {ours.dtype}{tuple(ours.shape)}, want {ref.dtype}{tuple(ref.shape)}"
    if ours.numel() == 0:
        return None
    diff = float((ours.double() - ref.double()).abs().max())
    tol = 0.0 if exact else world * 8 * torch.finfo(ref.dtype).eps * \
        max(1.0, float(ref.double().abs().max()))
    return None if diff <= tol else f"{name}: max |diff| {diff:.3g} > {tol:.3g}"


def _check_all_algorithms(_: int) -> dict:
    strategy = rp.MirroredStrategy()  # starts the process group the way users do
    world, rank = strategy.num_replicas_in_sync, strategy.replica_id
    failures: list[str] = []
    for name, algo in _algorithms(world).items():
        for dtype in DTYPES:
            for n in SIZES:
                for integers in (True, False) if dtype == torch.float32 else (True,):
                    x = _data(n, dtype, rank, integers)
                    ref_sum, ref_mean = x.clone(), x.clone()
                    if world > 1 and n:
                        dist.all_reduce(ref_sum)
                        dist.all_reduce(ref_mean, op=dist.ReduceOp.AVG)
                    ours = x.clone()
                    algo.all_reduce_sum_async(ours).wait()
                    label = f"{name} {dtype} n={n} {'int' if integers else 'randn'}"
                    for what, got, ref in (("sum", ours, ref_sum),
                                           ("mean", ours / world, ref_mean)):
                        bad = _compare(f"{label} {what}", got, ref,
                                       integers and what == "sum", world)
                        if bad:
                            failures.append(bad)
        # several buckets in flight at once, waited on in order (the synchronizer's pattern)
        xs = [_data(n, torch.float32, rank, True) for n in (1000, 7, 1_000_003, 1)]
        refs = [x.clone() for x in xs]
        for r in refs:
            if world > 1:
                dist.all_reduce(r)
        handles = [algo.all_reduce_sum_async(x) for x in xs]
        for h in handles:
            h.wait()
        for x, r in zip(xs, refs):
            bad = _compare(f"{name} overlapped n={x.numel()}", x, r, True, world)
            if bad:
                failures.append(bad)
        # reduce to one rank (central storage's path): only the destination's result counts
        for n in (7, 1_000_003):
            x = _data(n, torch.float32, rank, True)
            ref = x.clone()
            if world > 1:
                dist.all_reduce(ref)
            dst = world - 1
            algo.reduce_sum_async(x, dst).wait()
            if rank == dst:
                bad = _compare(f"{name} reduce to {dst} n={n}", x, ref, True, world)
                if bad:
                    failures.append(bad)
    return {"rank": rank, "failures": failures, "pid": os.getpid()}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_algorithm_equals_torch_all_reduce(world):
    results = run_distributed(_check_all_algorithms, world_size=world, args=(0,),
                              timeout_seconds=60)
    failures = [f"rank {r['rank']}: {f}" for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures[:30])
    left = shm_segments_made_by([r["pid"] for r in results])
    assert not left, f"shared-memory segments were left in /dev/shm: {left}"


def _compressed_sums(_: int) -> dict:
    strategy = rp.MirroredStrategy()
    world, rank = strategy.num_replicas_in_sync, strategy.replica_id
    out = {}
    for name, compression in (("fp16", Compression.fp16()), ("bf16", Compression.bf16())):
        for algo in (NativeAllReduce(compression=compression),
                     RingAllReduce(compression=compression),
                     SharedMemoryAllReduce(compression=compression)):
            x = _data(1000, torch.float32, rank, False)
            ref = x.clone()
            dist.all_reduce(ref)
            algo.all_reduce_sum(x)
            rel = float((x - ref).abs().max() / ref.abs().max())
            out[f"{name}/{algo.name}"] = rel
    # PowerSGD without shapes sends the tensor as it is (exact); with a layout it approximates
    x = _data(64 * 32, torch.float32, rank, False)
    ref = x.clone()
    dist.all_reduce(ref)
    y = x.clone()
    NativeAllReduce(compression=Compression.powersgd(rank=4)).all_reduce_sum(y)
    out["powersgd/no_layout"] = float((y - ref).abs().max())
    # a rank-2 matrix summed over ranks is rank <= 2 * world: rank 8 captures it exactly
    g = torch.Generator().manual_seed(rank)
    low = (torch.randn(64, 2, generator=g) @ torch.randn(2, 32, generator=g)).reshape(-1)
    ref = low.clone()
    dist.all_reduce(ref)
    layout = rp.comm.BucketLayout.from_shapes(0, [(64, 32)])
    psgd = NativeAllReduce(compression=Compression.powersgd(rank=2 * world))
    y = low.clone()
    psgd.all_reduce_sum(y, layout=layout)
    out["powersgd/low_rank"] = float((y - ref).abs().max() / ref.abs().max())
    return out


@pytest.mark.timeout(90)
def test_compressed_all_reduce_is_close_to_the_exact_sum():
    a, b = run_distributed(_compressed_sums, world_size=2, args=(0,))
    assert a == b
    for key, rel in a.items():
        if key.startswith("fp16"):
            assert rel < 2e-3, (key, rel)     # float16: 11-bit mantissa
        elif key.startswith("bf16"):
            assert rel < 2e-2, (key, rel)     # bfloat16: 8-bit mantissa
    assert a["powersgd/no_layout"] == 0.0
    assert a["powersgd/low_rank"] < 1e-4
