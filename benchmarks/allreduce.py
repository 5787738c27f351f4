"""All-reduce algorithms against gloo's own all_reduce, and against memcpy as the physical limit.

For each world size (2 processes, and 4 to show the trend) and float32 sizes from 4 KB to
128 MB, every algorithm runs on the same tensor in the same processes, interleaved round by
round so that machine noise hits all alike; small sizes are timed over several back-to-back
calls per round. Reported: median time per call (the slowest rank's, per round), bus bandwidth
``2 (n - 1) / n x bytes / time`` (as nccl-tests define it), the ratio to gloo's
``all_reduce`` and to one-thread ``memcpy`` bandwidth of the same size.

``shared_memory`` sums an ordinary tensor (copied in and out of the segment);
``shared_memory_resident`` sums a buffer made by ``make_buffers``, as the gradient buckets of
``MirroredStrategy`` are: it already lives in shared memory.

``--hosts-of k`` declares hosts of ``k`` processes each (``REPLICATOR_HOST``), so that
``hierarchical`` has a real leader step, and adds ``hierarchical_native_intra`` (the same with
the backend's reduce and broadcast inside each host instead of shared memory).

Run: ``python benchmarks/allreduce.py [--worlds 2 4] [--max-mb 128] [--quick] [--hosts-of k]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import replicator as rp  # noqa: E402
from benchmarks._report import median, print_table  # noqa: E402

KB, MB = 1024, 1024 * 1024
ALGOS = ("gloo", "ring", "hierarchical", "reduce_to_one", "shared_memory",
         "shared_memory_resident")


def _rounds(nbytes: int, quick: bool) -> int:
    n = 11 if nbytes <= 16 * MB else 5
    return max(3, n // 3) if quick else n


def _iterations(nbytes: int) -> int:
    """Back-to-back calls timed together, so small sizes are not just wake-up latency."""
    return max(1, min(50, (8 * MB) // nbytes))


def memcpy_seconds(nbytes: int, rounds: int) -> float:
    """Median time of a one-thread copy of ``nbytes`` (the physical reference)."""
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return median(times)


def _runs(x: torch.Tensor, res: torch.Tensor, ring, hier, r2o, shm, resident,
          hier_native=None) -> dict:
    """One call of each algorithm on ``x`` (``res``: the same size, in shared memory)."""
    import torch.distributed as dist

    extra = {} if hier_native is None else \
        {"hierarchical_native_intra": lambda: hier_native.all_reduce_sum(x)}
    return extra | {
        "gloo": lambda: dist.all_reduce(x),
        "ring": lambda: ring.all_reduce_sum(x),
        "hierarchical": lambda: hier.all_reduce_sum(x),
        "reduce_to_one": lambda: r2o.all_reduce_sum(x),
        "shared_memory": lambda: shm.all_reduce_sum(x),
        "shared_memory_resident": lambda: resident.all_reduce_sum(res),
    }


def _worker(sizes: list[int], quick: bool, hosts_of: int = 0) -> dict:
    import torch.distributed as dist

    from replicator.comm import (
        HierarchicalAllReduce,
        ReductionToOneDevice,
        RingAllReduce,
        SharedMemoryAllReduce,
    )

    if hosts_of:
        os.environ["REPLICATOR_HOST"] = f"host{int(os.environ['RANK']) // hosts_of}"
    rp.MirroredStrategy()  # the process group, one thread per process
    rank = dist.get_rank()
    ring, hier, r2o = RingAllReduce(), HierarchicalAllReduce(), ReductionToOneDevice()
    hier_native = HierarchicalAllReduce(intra_host="native") if hosts_of else None
    shm = SharedMemoryAllReduce()
    out: dict[str, dict[int, list[float]]] = {a: {} for a in _algos(hosts_of)}
    for nbytes in sizes:
        n = nbytes // 4
        x = torch.randn(n)
        resident = SharedMemoryAllReduce()  # a fresh one per size: its segment goes with it
        (res,) = resident.make_buffers([(n, torch.float32, torch.device("cpu"))])
        res.copy_(x)
        runs = _runs(x, res, ring, hier, r2o, shm, resident, hier_native)
        for fn in runs.values():  # warm-up: set-up, first-touch of buffers
            fn()
        times: dict[str, list[float]] = {a: [] for a in runs}
        iters = _iterations(nbytes)
        for _ in range(_rounds(nbytes, quick)):
            for name, fn in runs.items():
                x.normal_()  # keep the values finite: sums of sums grow
                res.normal_()
                dist.barrier()
                t = time.perf_counter()
                for _ in range(iters):
                    fn()
                times[name].append((time.perf_counter() - t) / iters)
        for name, mine in times.items():
            slowest = torch.tensor(mine, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            out[name][nbytes] = slowest.tolist()
        del res, resident, runs
    return out if rank == 0 else {}


def _algos(hosts_of: int) -> tuple[str, ...]:
    return (("hierarchical_native_intra",) if hosts_of else ()) + ALGOS


def _label(nbytes: int) -> str:
    return f"{nbytes // MB} MB" if nbytes >= MB else f"{nbytes // KB} KB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-mb", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--hosts-of", type=int, default=0,
                        help="declare hosts of this many processes each (REPLICATOR_HOST)")
    args = parser.parse_args()
    sizes = [s for s in (4 * KB, 16 * KB, 64 * KB, 256 * KB, MB, 4 * MB, 16 * MB, 64 * MB,
                         128 * MB) if s <= args.max_mb * MB]
    torch.set_num_threads(1)
    memcpy = {s: memcpy_seconds(s, 7 if s >= 16 * MB else 21) for s in sizes}
    lines = []
    for world in args.worlds:
        start = time.perf_counter()
        result = rp.launch(_worker, num_replicas=world,
                           args=(sizes, args.quick, args.hosts_of), timeout_seconds=120)[0]
        rows = []
        for nbytes in sizes:
            factor = 2 * (world - 1) / world
            gloo_t = median(result["gloo"][nbytes])
            for algo in _algos(args.hosts_of):
                t = median(result[algo][nbytes])
                busbw = factor * nbytes / t / 1e9
                vs_memcpy = (factor * nbytes / t) / (nbytes / memcpy[nbytes])
                rows.append([world, _label(nbytes), algo, t * 1e3, busbw, gloo_t / t,
                             vs_memcpy])
                lines.append({"bench": "allreduce", "world": world, "algo": algo,
                              "bytes": nbytes, "median_ms": round(t * 1e3, 4),
                              "busbw_gbs": round(busbw, 4),
                              "ratio_vs_gloo": round(gloo_t / t, 4),
                              "ratio_vs_memcpy": round(vs_memcpy, 4)})
        print(f"\nworld size {world} ({time.perf_counter() - start:.0f} s); memcpy of the same "
              "size in one thread is the physical reference")
        print_table(["world", "size", "algorithm", "median ms", "busbw GB/s", "x gloo",
                     "x memcpy"], rows)
    two = [line for line in lines if line["world"] == 2]
    if two:
        ring = [f"{_label(x['bytes'])} {x['ratio_vs_gloo']:.2f}x" for x in two
                if x["algo"] == "ring" and x["bytes"] >= MB]
        best = []
        for nbytes in sorted({x["bytes"] for x in two if x["bytes"] >= 16 * MB}):
            top = max((x for x in two if x["bytes"] == nbytes and x["algo"] != "gloo"),
                      key=lambda x: x["ratio_vs_gloo"])
            best.append(f"{_label(nbytes)} {top['algo']} {top['ratio_vs_gloo']:.2f}x")
        print("\ntargets, 2 processes: ring >= 0.9x gloo from 1 MB: " + ", ".join(ring))
        print("                      best path >= 2x gloo from 16 MB: " + ", ".join(best))
    print("\nmemcpy (one thread): " + ", ".join(
        f"{_label(s)} {s / memcpy[s] / 1e9:.2f} GB/s" for s in sizes))
    print()
    for line in lines:
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
