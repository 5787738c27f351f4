"""Step time of a many-small-layer model against the gradient bucket size, next to plain DDP.

Two processes train the same model (64 x Linear(256, 256), 16.8 MB of gradients) with
replicator's gradient synchronizer at bucket sizes 0 (one bucket per parameter), 1, 5, 25 and
100 MB, with gloo's all-reduce (``NativeAllReduce``) and with ``SharedMemoryAllReduce`` (whose
buckets live in shared memory), and with plain ``DistributedDataParallel`` (25 MB buckets).
Configurations are interleaved round by round; each figure is the median over rounds of the
slowest rank's mean step time. The first bucket is capped at 1 MB, as in DDP.

Run: ``python benchmarks/bucket_sweep.py [--rounds 9] [--steps 4]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import replicator as rp  # noqa: E402
from benchmarks._report import median, print_table  # noqa: E402

MB = 1024 * 1024
BUCKETS_MB = (0, 1, 5, 25, 100)


def many_small_layers() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(64):
        layers += [nn.Linear(256, 256), nn.Tanh()]
    return nn.Sequential(*layers)


def _worker(rounds: int, steps: int) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from replicator.comm import GradientSynchronizer, NativeAllReduce, SharedMemoryAllReduce

    strategy = rp.MirroredStrategy()
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(64, 256, generator=gen)
    configs = {}
    for algo_name, make in (("gloo", NativeAllReduce), ("shared_memory", SharedMemoryAllReduce)):
        for mb in BUCKETS_MB:
            model = many_small_layers()
            sync = GradientSynchronizer(list(model.parameters()), strategy.collectives, make(),
                                        bucket_bytes=mb * MB)
            configs[f"{algo_name} {mb} MB"] = (model, len(sync.buckets), sync)
    ddp = DDP(many_small_layers())
    configs["DDP 25 MB"] = (ddp, None, None)
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, (m, _, _) in configs.items()}

    def step(name: str) -> None:
        model = configs[name][0]
        model(x).square().mean().backward()
        optimizers[name].step()
        optimizers[name].zero_grad()

    for name in configs:  # warm-up: buffers, first-touch, DDP's bucket rebuild
        for _ in range(2):
            step(name)
    times: dict[str, list[float]] = {k: [] for k in configs}
    for _ in range(rounds):
        for name in configs:
            dist.barrier()
            t = time.perf_counter()
            for _ in range(steps):
                step(name)
            times[name].append((time.perf_counter() - t) / steps)
    out = {}
    for name, mine in times.items():
        slowest = torch.tensor(mine, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out[name] = {"median_ms": median(slowest.tolist()) * 1e3, "buckets": configs[name][1]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    start = time.perf_counter()
    result = rp.launch(_worker, num_replicas=2, args=(args.rounds, args.steps),
                       timeout_seconds=120)[0]
    ddp = result["DDP 25 MB"]["median_ms"]
    rows = [[name, r["buckets"] if r["buckets"] is not None else "-", r["median_ms"],
             ddp / r["median_ms"]] for name, r in result.items()]
    print(f"2 processes, {time.perf_counter() - start:.0f} s; ratio = DDP step time / ours "
          "(> 1: faster than DDP)")
    print_table(["configuration", "buckets", "median step ms", "x DDP"], rows)
    lines = []
    for algo in ("gloo", "shared_memory"):
        best = min((k for k in result if k.startswith(algo)),
                   key=lambda k: result[k]["median_ms"])
        print(f"best {algo}: {best} at {result[best]['median_ms']:.1f} ms/step, "
              f"{ddp / result[best]['median_ms']:.2f}x DDP")
        lines.append({"bench": "bucket_sweep", "algo": algo, "best_bucket": best,
                      "median_ms": round(result[best]["median_ms"], 3),
                      "ddp_median_ms": round(ddp, 3),
                      "ratio_vs_ddp": round(ddp / result[best]["median_ms"], 4)})
    for name, r in result.items():
        lines.append({"bench": "bucket_sweep", "config": name, "buckets": r["buckets"],
                      "median_ms": round(r["median_ms"], 3),
                      "ratio_vs_ddp": round(ddp / r["median_ms"], 4)})
    print()
    for line in lines:
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
