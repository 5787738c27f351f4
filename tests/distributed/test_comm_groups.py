"""All-reduce algorithms on process sub-groups, with real gloo processes.

Every algorithm on a sub-group equals ``torch.distributed.all_reduce`` on it while the other
processes work on their own group; two disjoint groups run at once; the hierarchical algorithm
follows the declared hosts; compression state stays apart for two models under one algorithm.
"""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from replicator.cluster.env_names import HOST_ENV
from replicator.cluster.process_group import initialize
from replicator.comm import (
    BucketLayout,
    Compression,
    CrossDeviceOps,
    HierarchicalAllReduce,
    NativeAllReduce,
    ReductionToOneDevice,
    RingAllReduce,
    SharedMemoryAllReduce,
)
from replicator.comm.comm_thread import lane
from replicator.testing import run_distributed

SIZES = (0, 1, 7, 1000, 1_000_003)


def _algorithms(size: int) -> dict[str, CrossDeviceOps]:
    return {
        "native": NativeAllReduce(),
        "ring": RingAllReduce(segment_bytes=1 << 16),
        "reduce_to_one_last": ReductionToOneDevice(destination=size - 1),
        "shared_memory": SharedMemoryAllReduce(piece_bytes=1 << 16),
        "hierarchical": HierarchicalAllReduce(),
        "hierarchical_1_per_node_ring": HierarchicalAllReduce(ranks_per_node=1,
                                                              inter_node=RingAllReduce()),
    }


def _data(n: int, rank: int, salt: int = 0) -> torch.Tensor:
    """Small integers: every order of summation gives the exact same float32 result."""
    g = torch.Generator().manual_seed(1000 * rank + n + salt)
    return torch.randint(-8, 9, (n,), generator=g).to(torch.float32)


def _groups(world: int, first: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """The groups of ranks ``[0, first)`` and ``[first, world)`` (every rank creates both)."""
    inside = dist.new_group(list(range(first)))
    outside = dist.new_group(list(range(first, world))) if first < world else None
    return inside, outside


def _sub_group_sums(first: int) -> dict:
    initialize()
    rank, world = dist.get_rank(), dist.get_world_size()
    inside, outside = _groups(world, first)
    failures: list[str] = []
    if rank >= first:  # not a member: busy with its own group, never pairs with the others
        busy = 0
        for busy in range(1, 16):  # a fixed count: the outsiders agree on their own calls
            x = _data(50_000, rank, busy)
            ref = x.clone()
            if outside is not None and world - first > 1:
                dist.all_reduce(ref, group=outside)
            RingAllReduce().all_reduce_sum(x, outside)
            if not torch.equal(x, ref):
                failures.append(f"outsider ring step {busy} differs")
        return {"rank": rank, "failures": failures, "busy": busy}
    for name, algo in _algorithms(first).items():
        for n in SIZES:
            x = _data(n, rank)
            ref = x.clone()
            if n:
                dist.all_reduce(ref, group=inside)
            algo.all_reduce_sum_async(x, inside).wait()
            if not torch.equal(x, ref):
                failures.append(f"{name} n={n}: max diff {(x - ref).abs().max()}")
        # several in flight, waited on in order (the synchronizer's pattern)
        xs = [_data(n, rank, 7) for n in (1000, 7, 1_000_003)]
        refs = [x.clone() for x in xs]
        for r in refs:
            dist.all_reduce(r, group=inside)
        for h in [algo.all_reduce_sum_async(x, inside) for x in xs]:
            h.wait()
        failures += [f"{name} overlapped n={x.numel()}" for x, r in zip(xs, refs)
                     if not torch.equal(x, r)]
        # reduce onto the group's last replica: dst is a group rank
        x = _data(1000, rank, 3)
        ref = x.clone()
        dist.all_reduce(ref, group=inside)
        algo.reduce_sum_async(x, first - 1, inside).wait()
        if rank == first - 1 and not torch.equal(x, ref):
            failures.append(f"{name} reduce to group rank {first - 1}")
    # every algorithm with every compression on the sub-group, close to the exact sum
    kinds = {"native": NativeAllReduce, "ring": RingAllReduce,
             "reduce_to_one": ReductionToOneDevice, "shared_memory": SharedMemoryAllReduce,
             "hierarchical": HierarchicalAllReduce}
    g = torch.Generator().manual_seed(rank)
    low_rank = torch.randn(64, 2, generator=g) @ torch.randn(2, 32, generator=g)
    plain = torch.randn(10_007, generator=g)
    layout = BucketLayout.from_shapes(0, [(64, 32)])
    for kind, cls in kinds.items():
        for comp, x, lay, tol in ((Compression.fp16(), plain, None, 2e-3),
                                  (Compression.bf16(), plain, None, 2e-2),
                                  (Compression.powersgd(rank=2 * first), low_rank.reshape(-1),
                                   layout, 1e-4)):
            y, ref = x.clone(), x.clone()
            dist.all_reduce(ref, group=inside)
            cls(compression=comp).all_reduce_sum(y, inside, layout=lay)
            rel = float((y - ref).abs().max() / ref.abs().max())
            if rel > tol:
                failures.append(f"{kind} {comp!r}: relative error {rel:.3g} > {tol}")
    try:  # a global rank outside the group is a clear error
        NativeAllReduce().reduce_sum_async(torch.ones(3), first, inside)
        failures.append("dst outside the group was accepted")
    except ValueError as exc:
        if "group rank" not in str(exc):
            failures.append(f"unclear dst error: {exc}")
    return {"rank": rank, "failures": failures}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("first", [2, 3])
def test_every_algorithm_on_a_sub_group_equals_torch(first):
    results = run_distributed(_sub_group_sums, world_size=4, args=(first,), timeout_seconds=60)
    failures = [f"rank {r['rank']}: {f}" for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures[:30])
    assert all(r["busy"] > 0 for r in results[first:])


def _lane_threads() -> int:
    return sum(t.name.startswith("replicator-comm") for t in threading.enumerate())


def _disjoint_pairs(_: int) -> dict:
    initialize()
    rank = dist.get_rank()
    # first a hierarchical all-reduce over the world with two declared nodes: ranks 0 and 2
    # lead, so they now hold one process group more than ranks 1 and 3
    h = HierarchicalAllReduce(ranks_per_node=2)
    x = _data(1001, rank)
    ref = x.clone()
    dist.all_reduce(ref)
    h.all_reduce_sum(x)
    failures = [] if torch.equal(x, ref) else ["world hierarchical"]
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    if rank >= 2:
        time.sleep(1.5)  # {0, 1} start (and create their lanes) while {2, 3} are away
    algos = [RingAllReduce(segment_bytes=1 << 14), ReductionToOneDevice(destination=1),
             NativeAllReduce(compression=Compression.fp16()), HierarchicalAllReduce(),
             SharedMemoryAllReduce(), NativeAllReduce()]
    for step in range(4):
        xs = [_data(200_003, rank, 10 * step + i) for i in range(len(algos))]
        refs = [x.clone() for x in xs]
        for r in refs:
            dist.all_reduce(r, group=pair)
        handles = [a.all_reduce_sum_async(x, pair) for a, x in zip(algos, xs)]
        for h_ in handles:
            h_.wait()
        for a, x, r in zip(algos, xs, refs):
            tol = 0.05 if a.compression is not None else 0.0
            if float((x - r).abs().max()) > tol:
                failures.append(f"step {step} {a!r}: max diff {(x - r).abs().max()}")
    # one lane per group object, over a private copy of the group
    mine = lane(pair)
    if mine is not lane(pair) or mine is lane(None) or mine.group is pair:
        failures.append("lanes are not one per group")
    if dist.get_process_group_ranks(mine.group) != dist.get_process_group_ranks(pair):
        failures.append("the lane's group has other ranks than its group")
    # a group that goes away ends its lane's thread
    temp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    RingAllReduce().all_reduce_sum(torch.ones(3), temp)
    before = _lane_threads()
    dist.destroy_process_group(temp)
    del temp
    gc.collect()
    deadline = time.monotonic() + 10
    while _lane_threads() >= before and time.monotonic() < deadline:
        time.sleep(0.05)
    if _lane_threads() != before - 1:
        failures.append(f"lane threads {before} -> {_lane_threads()} after the group went away")
    y = torch.full((5,), float(rank))
    RingAllReduce().all_reduce_sum(y)  # the world still works afterwards
    if not torch.equal(y, torch.full((5,), 6.0)):
        failures.append("world ring after the pairs")
    return {"rank": rank, "failures": failures}


@pytest.mark.timeout(120)
def test_two_disjoint_groups_run_at_once_and_start_their_lanes_at_different_times():
    results = run_distributed(_disjoint_pairs, world_size=4, args=(0,), timeout_seconds=60)
    failures = [f"rank {r['rank']}: {f}" for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures[:30])


def _ranks_of(group: dist.ProcessGroup | None) -> list[int] | None:
    return None if group is None else list(dist.get_process_group_ranks(group))


def _declared_hosts(hosts: str) -> dict:
    os.environ[HOST_ENV] = f"host{hosts[int(os.environ['RANK'])]}"
    initialize()
    rank = dist.get_rank()
    out: dict = {"rank": rank, "failures": []}
    for intra in ("auto", "native", "shared_memory"):
        algo = HierarchicalAllReduce(intra_host=intra)
        for n in (0, 1, 7, 1000, 1_000_003):
            x = _data(n, rank)
            ref = x.clone()
            if n:
                dist.all_reduce(ref)
            algo.all_reduce_sum(x)
            if not torch.equal(x, ref):
                out["failures"].append(f"{intra} n={n}: max diff {(x - ref).abs().max()}")
        topo = algo.topology_for(None)
        out[intra] = {"hosts": topo.hosts, "leaders": topo.leaders, "host": topo.host,
                      "intra": _ranks_of(topo.intra), "leader_group": _ranks_of(topo.leader_group),
                      "shared_memory": topo.shared_memory}
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("hosts", ["AABB", "ABAB", "AAB"])
def test_hierarchical_follows_declared_hosts(hosts):
    results = run_distributed(_declared_hosts, world_size=len(hosts), args=(hosts,),
                              timeout_seconds=60)
    failures = [f"rank {r['rank']}: {f}" for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures)
    expected: dict[str, list[int]] = {}
    for rank, h in enumerate(hosts):
        expected.setdefault(h, []).append(rank)
    want_hosts = list(expected.values())
    leaders = [h[0] for h in want_hosts]
    for r in results:
        rank = r["rank"]
        host = expected[hosts[rank]]
        for intra in ("auto", "native", "shared_memory"):
            topo = r[intra]
            assert topo["hosts"] == want_hosts
            assert topo["leaders"] == leaders
            assert topo["host"] == host
            assert topo["intra"] == (host if len(host) > 1 else None)
            # the inter-host step's group holds the host leaders only, and only they have it
            assert topo["leader_group"] == (leaders if rank in leaders else None)
            assert topo["shared_memory"] == (intra != "native" and len(host) > 1)


def _train_two_models(shared: bool, same_owner: bool) -> list[list[float]]:
    """Two models, one step after the other, gradients summed with PowerSGD; the parameters."""
    rank, world = dist.get_rank(), dist.get_world_size()
    models = []
    for k in range(2):
        torch.manual_seed(100 + k)
        models.append(torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Tanh(),
                                          torch.nn.Linear(12, 4)))
    one = NativeAllReduce(compression=Compression.powersgd(rank=1))
    algos = [one, one] if shared else \
        [NativeAllReduce(compression=Compression.powersgd(rank=1)) for _ in models]
    g = torch.Generator().manual_seed(rank)
    for _step in range(6):
        for k, (model, algo) in enumerate(zip(models, algos)):
            x = torch.randn(8, 16, generator=g)
            model.zero_grad()
            model(x).pow(2).mean().backward()
            params = list(model.parameters())
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            layout = BucketLayout.from_shapes(0, [p.shape for p in params],
                                              owner=0 if same_owner else k)
            algo.all_reduce_sum(flat, layout=layout)
            with torch.no_grad():
                for p, v in zip(params, layout.views(flat)):
                    p -= 0.1 * v / world
    return [torch.cat([p.detach().reshape(-1) for p in m.parameters()]).tolist()
            for m in models]


def _powersgd_owners(_: int) -> dict:
    initialize()
    return {"alone": _train_two_models(shared=False, same_owner=False),
            "shared": _train_two_models(shared=True, same_owner=False),
            "shared_one_owner": _train_two_models(shared=True, same_owner=True)}


@pytest.mark.timeout(90)
def test_two_models_under_one_powersgd_algorithm_train_as_if_alone():
    a, b = run_distributed(_powersgd_owners, world_size=2, args=(0,))
    assert a["shared"] == b["shared"]                  # replicas agree
    assert a["shared"] == a["alone"]                   # sharing the algorithm changes nothing
    assert a["shared_one_owner"] != a["alone"]         # ...which the owner in the key ensures


def _reduce_onto_a_sub_groups_first_rank(_: int) -> list[float] | None:
    """Ranks 1 and 2 of 3 average a gradient onto their group's rank 0 (global rank 1)."""
    from replicator.comm.collectives import Collectives
    from replicator.comm.gradient_sync import GradientSynchronizer

    initialize()
    sub = dist.new_group([1, 2])
    dist.barrier()  # gloo: rank 0 must not end while 1 and 2 still connect their group
    if dist.get_rank() == 0:
        return None
    weight = torch.nn.Parameter(torch.zeros(4))
    coll = Collectives.for_group(sub, torch.device("cpu"), 30.0)
    sync = GradientSynchronizer([weight], coll, destination=0, automatic=False)
    (weight * float(dist.get_rank())).sum().backward()  # gradient: the global rank
    sync.synchronize()
    return weight.grad.tolist() if coll.rank == 0 else None


@pytest.mark.timeout(120)
def test_a_reduce_onto_one_rank_of_a_sub_group_lands_on_that_group_rank():
    # destination is a group rank: on [1, 2] group rank 0 is global rank 1 (given as the global
    # rank of group rank 0, the sum landed on group rank 1)
    out = run_distributed(_reduce_onto_a_sub_groups_first_rank, 3, args=(0,))
    assert out == [None, [1.5] * 4, None]
