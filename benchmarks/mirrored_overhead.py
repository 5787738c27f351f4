"""MirroredStrategy vs hand-written DDP on 2 CPU processes, and 2-vs-1 worker scaling.

The variants run in the same two processes, interleaved round by round so machine noise hits
all alike: hand-written DDP (gloo), ``MirroredStrategy()`` with default options (``"auto"``:
shared memory on one CPU host; the per-pass collective check on, see ``comm/collectives.py``),
the same with the check off (``CommunicationOptions(check_collectives=False)``), and ours on
gloo's all-reduce (``NativeAllReduce``). The figure is the ratio of median step times ours
(default) / DDP (goal <= 1.05); the others are printed beside it. ``scaling_2v1``
is the throughput of 2 workers over 1 worker on a compute-bound model with the same
per-worker batch and one thread per worker (goal >= 1.8 on 2 cores).

Run: ``python benchmarks/mirrored_overhead.py [--rounds 15] [--steps 20] [--overhead-only]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import replicator as rp  # noqa: E402
from benchmarks._report import emit, median, print_table  # noqa: E402


def many_layer_mlp() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(24):
        layers += [nn.Linear(128, 128), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(128, 10))


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 7 * 7, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.fc(x.flatten(1))


class ComputeBoundCNN(nn.Module):
    """Many FLOPs per parameter: convolutions on 32x32 images, ~60k parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 32, 3, padding=1)
        self.c2 = nn.Conv2d(32, 64, 3, padding=1)
        self.c3 = nn.Conv2d(64, 64, 3, padding=1)
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        x = F.relu(self.c3(x))
        return self.fc(x.mean((2, 3)))


MODELS = {
    "mlp": (many_layer_mlp, lambda b: torch.randn(b, 128), 64),
    "cnn": (lambda: (torch.manual_seed(0), SmallCNN())[1], lambda b: torch.randn(b, 1, 28, 28),
            32),
}


def _time_steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                y: torch.Tensor, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return (time.perf_counter() - start) / steps


def overhead_worker(name: str, rounds: int, steps: int) -> dict:
    """Runs in each of the 2 processes: DDP and MirroredStrategy alternately."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    strategy = rp.MirroredStrategy()
    build, make_x, batch = MODELS[name]
    torch.manual_seed(strategy.replica_id)
    x, y = make_x(batch), torch.randint(0, 10, (batch,))
    ddp = DDP(build())
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    variants: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {
        "ddp": (ddp, ddp_opt)}
    unchecked = rp.MirroredStrategy(
        communication_options=rp.CommunicationOptions(check_collectives=False))
    gloo = rp.MirroredStrategy(cross_device_ops=rp.comm.NativeAllReduce())
    for name_, owner in (("ours", strategy), ("ours_unchecked", unchecked),
                         ("ours_gloo", gloo)):
        with owner.scope():
            model = build()
            variants[name_] = (model, torch.optim.SGD(model.parameters(), lr=0.01))
    for model, opt in variants.values():
        _time_steps(model, opt, x, y, 5)
    times: dict[str, list[float]] = {v: [] for v in variants}
    names = list(variants)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for variant in order:
            strategy.barrier()
            model, opt = variants[variant]
            times[variant].append(_time_steps(model, opt, x, y, steps))
    return {**times, "algorithm": type(strategy.cross_device_ops).__name__}


def scaling_worker(steps: int, rounds: int, communicate: bool = True) -> list[float]:
    strategy = rp.MirroredStrategy() if communicate else rp.OneDeviceStrategy("cpu")
    torch.manual_seed(0)
    with strategy.scope():
        model = ComputeBoundCNN()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    _time_steps(model, opt, x, y, 3)
    out = []
    for _ in range(rounds):
        strategy.barrier()
        out.append(64 / _time_steps(model, opt, x, y, steps))
    return out


def _emit_overhead(results: dict[str, tuple[float, float, float]], algorithm: str) -> None:
    for name in MODELS:
        checked, unchecked, gloo = results[name]
        emit("mirrored_overhead", f"overhead_{name}", checked, "<= 1.05",
             note="default configuration: collective check on", algorithm=algorithm,
             gloo_ratio=round(gloo, 4))
        emit("mirrored_overhead", f"overhead_{name}_checked", checked, "<= 1.05")
        emit("mirrored_overhead", f"overhead_{name}_unchecked", unchecked, "<= 1.05")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--overhead-only", action="store_true",
                        help="skip the 2-vs-1 scaling measurement")
    args = parser.parse_args()
    rows: list[list[object]] = []
    results: dict[str, tuple[float, float, float]] = {}
    for name in MODELS:
        per_rank = rp.launch(overhead_worker, num_replicas=2, args=(name, args.rounds, args.steps))
        # a step is as slow as the slower rank: take the max over ranks per round
        ddp = [max(t) for t in zip(*(r["ddp"] for r in per_rank))]
        ours = [max(t) for t in zip(*(r["ours"] for r in per_rank))]
        free = [max(t) for t in zip(*(r["ours_unchecked"] for r in per_rank))]
        gloo = [max(t) for t in zip(*(r["ours_gloo"] for r in per_rank))]
        results[name] = (median(ours) / median(ddp), median(free) / median(ddp),
                         median(gloo) / median(ddp))
        algorithm = str(per_rank[0]["algorithm"])
        rows.append([name, median(ddp) * 1e3, median(ours) * 1e3, median(free) * 1e3,
                     median(gloo) * 1e3, *results[name]])
    print(f"\nMirroredStrategy vs hand-written DDP (gloo), 2 CPU processes (median step time, "
          f"ms); ours = default options (auto = {algorithm})")
    print_table(["model", "DDP ms", "ours ms", "ours ms (check off)", "ours+gloo ms",
                 "ours/DDP", "ours/DDP (check off)", "ours+gloo/DDP"], rows)

    if args.overhead_only:
        print()
        _emit_overhead(results, algorithm)
        return
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # one thread per worker in both runs
    try:
        one = median(rp.launch(scaling_worker, num_replicas=1, args=(5, 5))[0])
        two = sum(median(r) for r in rp.launch(scaling_worker, num_replicas=2, args=(5, 5)))
        # the machine's own ceiling: two processes that never communicate
        free = sum(median(r) for r in rp.launch(scaling_worker, num_replicas=2,
                                                 args=(5, 5, False)))
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    print("\nScaling on a compute-bound CNN (64 images per worker per step, 1 thread each)")
    print_table(["workers", "samples/s"],
                [[1, one], [2, two], ["2 vs 1", two / one],
                 ["2 without communication (the machine's ceiling)", free],
                 ["ceiling 2 vs 1", free / one]])
    print()
    _emit_overhead(results, algorithm)
    emit("mirrored_overhead", "scaling_2v1", two / one, ">= 1.8",
         ceiling_without_communication=round(free / one, 4))


if __name__ == "__main__":
    main()
