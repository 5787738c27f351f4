"""Is distributing on one CPU host worth it? ``MirroredStrategy()`` with default options.

For a 1M-parameter MLP (4 x Linear(512, 512) + head, global batch 512) and the compute-bound
CNN of ``mirrored_overhead.py`` (global batch 128), samples per second of:

* one process with 1 thread and with 2 threads (the same global batch; alternated round by
  round in one process);
* ``MirroredStrategy()`` with default options on 2 processes x 1 thread (half the batch each);
* the machine's ceiling: the same 2 processes doing the same work without any communication
  (alternated with the Mirrored rounds in the same processes).

Reported per model (medians over 3 interleaved rounds): ``vs_one_process`` = Mirrored / one
process with 2 threads (goal >= 1.1), ``scaling_2v1`` = Mirrored / one process with 1 thread
(goal >= 1.6) and ``vs_ceiling`` = Mirrored / the ceiling (goal >= 0.95). On a shared 2-core
machine two busy processes reach about 1.5x one process, not 2x: the ceiling is printed beside
every figure so the scaling can be read against what the machine allows.

Run: ``python benchmarks/scaling.py [--rounds 3] [--models mlp cnn]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import replicator as rp  # noqa: E402
from benchmarks._report import emit, median, print_table  # noqa: E402
from benchmarks.mirrored_overhead import ComputeBoundCNN  # noqa: E402


def wide_mlp() -> nn.Module:
    """About 1.06M parameters: 4 x Linear(512, 512) and a 10-way head."""
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(512, 512), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(512, 10))


#: name: (builder, input maker, global batch, timed steps per round)
MODELS = {
    "mlp": (wide_mlp, lambda b: torch.randn(b, 512), 512, 30),
    "cnn": (ComputeBoundCNN, lambda b: torch.randn(b, 3, 32, 32), 128, 8),
}


def _seconds_per_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                      y: torch.Tensor, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return (time.perf_counter() - start) / steps


def one_process_worker(name: str, rounds: int) -> dict[str, list[float]]:
    """One process, the whole global batch: 1 and 2 threads alternately (samples/s)."""
    build, make_x, batch, steps = MODELS[name]
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = make_x(batch), torch.randint(0, 10, (batch,))
    out: dict[str, list[float]] = {"1 thread": [], "2 threads": []}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        _seconds_per_step(model, opt, x, y, 3)
    for r in range(rounds):
        order = (1, 2) if r % 2 == 0 else (2, 1)
        for threads in order:
            torch.set_num_threads(threads)
            out[f"{threads} thread{'s' if threads > 1 else ''}"].append(
                batch / _seconds_per_step(model, opt, x, y, steps))
    return out


def two_process_worker(name: str, rounds: int) -> dict[str, Any]:
    """Each of 2 processes: Mirrored with default options, and the same work without any
    communication, alternately; seconds per step of this rank."""
    build, make_x, batch, steps = MODELS[name]
    strategy = rp.MirroredStrategy()
    torch.manual_seed(0)
    with strategy.scope():
        ours = build()
        ours_opt = torch.optim.SGD(ours.parameters(), lr=0.01)
    torch.manual_seed(0)
    alone = build()  # created outside scope(): no gradient averaging at all
    alone_opt = torch.optim.SGD(alone.parameters(), lr=0.01)
    local = batch // strategy.num_replicas_in_sync
    torch.manual_seed(1 + strategy.replica_id)
    x, y = make_x(local), torch.randint(0, 10, (local,))
    _seconds_per_step(ours, ours_opt, x, y, 3)
    _seconds_per_step(alone, alone_opt, x, y, 3)
    out: dict[str, Any] = {"mirrored": [], "ceiling": [],
                           "algorithm": strategy.cross_device_ops.name}
    for r in range(rounds):
        order = ("mirrored", "ceiling") if r % 2 == 0 else ("ceiling", "mirrored")
        for variant in order:
            strategy.barrier()
            model, opt = (ours, ours_opt) if variant == "mirrored" else (alone, alone_opt)
            out[variant].append(_seconds_per_step(model, opt, x, y, steps))
    return out


def measure(name: str, rounds: int) -> dict[str, Any]:
    """Samples/s of every way to run model ``name``, medians over ``rounds``."""
    batch = MODELS[name][2]
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # one thread per worker; the 1-process run sets its own
    samples: dict[str, list[float]] = {"1 thread": [], "2 threads": [], "mirrored": [],
                                       "ceiling": []}
    algorithm = "?"
    try:
        # each launch alternates its two variants round by round (noise hits both alike)
        single = rp.launch(one_process_worker, num_replicas=1, args=(name, rounds))[0]
        for key in ("1 thread", "2 threads"):
            samples[key] += single[key]
        pair = rp.launch(two_process_worker, num_replicas=2, args=(name, rounds))
        algorithm = str(pair[0]["algorithm"])
        for key in ("mirrored", "ceiling"):
            # a synchronous step is as slow as the slower rank
            samples[key] += [batch / max(t) for t in zip(*(p[key] for p in pair))]
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    result: dict[str, Any] = {k: median(v) for k, v in samples.items()}
    result["algorithm"] = algorithm
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    figures = {}
    for name in args.models:
        r = measure(name, args.rounds)
        figures[name] = r
        one, two, ours, ceiling = r["1 thread"], r["2 threads"], r["mirrored"], r["ceiling"]
        print(f"\n{name}: global batch {MODELS[name][2]}, samples/s (medians of "
              f"{args.rounds} interleaved rounds)")
        print_table(["how it runs", "samples/s", "vs 1 process, 1 thread",
                     "vs 1 process, 2 threads"],
                    [["one process, 1 thread", one, 1.0, one / two],
                     ["one process, 2 threads", two, two / one, 1.0],
                     [f"MirroredStrategy() x2 (auto = {r['algorithm']})", ours, ours / one,
                      ours / two],
                     ["x2 without communication (ceiling)", ceiling, ceiling / one,
                      ceiling / two]])
    print()
    for name, r in figures.items():
        ceiling = round(r["ceiling"] / r["1 thread"], 4)
        emit("scaling", f"vs_one_process_{name}", r["mirrored"] / r["2 threads"], ">= 1.1",
             ceiling_vs_one_process=round(r["ceiling"] / r["2 threads"], 4),
             algorithm=r["algorithm"])
        emit("scaling", f"scaling_2v1_{name}", r["mirrored"] / r["1 thread"], ">= 1.6",
             ceiling_2v1=ceiling, algorithm=r["algorithm"])
        emit("scaling", f"vs_ceiling_{name}", r["mirrored"] / r["ceiling"], ">= 0.95",
             ceiling_2v1=ceiling, algorithm=r["algorithm"])


if __name__ == "__main__":
    main()
