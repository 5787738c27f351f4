"""Step time of a compiled model vs eager under MirroredStrategy on 2 CPU processes.

The models are those of ``mirrored_overhead.py`` (a small CNN on 28x28 images, and a
24-layer MLP of 128-wide layers). In each process one model is trained alternately eager and
through ``torch.compile(model)`` (inductor, C++ on CPU), round by round so machine noise hits
both alike; a round's time is the slower rank's. The figure is compiled / eager of the median
step times (goal <= 0.9 where compilation pays); the one-off compile time is reported beside.

Run: ``python benchmarks/compile.py [--rounds 7] [--steps 20] [--models cnn mlp]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import replicator as rp  # noqa: E402
from benchmarks._report import emit, median, print_table  # noqa: E402
from benchmarks.mirrored_overhead import MODELS, _time_steps  # noqa: E402


def compile_worker(name: str, rounds: int, steps: int, batch: int | None = None
                   ) -> dict[str, list[float]]:
    """Runs in each of the 2 processes: the same model eager and compiled, alternately."""
    torch.set_num_threads(1)
    strategy = rp.MirroredStrategy()
    build, make_x, default_batch = MODELS[name]
    batch = batch or default_batch
    torch.manual_seed(strategy.replica_id)
    x, y = make_x(batch), torch.randint(0, 10, (batch,))
    with strategy.scope():
        model = build()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = torch.compile(model)
    start = time.perf_counter()
    strategy.run(_time_steps, args=(compiled, optimizer, x, y, 2))  # builds the graphs
    compile_seconds = time.perf_counter() - start
    strategy.run(_time_steps, args=(model, optimizer, x, y, 3))
    times: dict[str, list[float]] = {"eager": [], "compiled": [], "compile_s": [compile_seconds]}
    for r in range(rounds):
        order = ("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")
        for variant in order:
            strategy.barrier()
            m = model if variant == "eager" else compiled
            times[variant].append(strategy.run(_time_steps, args=(m, optimizer, x, y, steps)))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--models", nargs="+", default=["cnn", "mlp"], choices=sorted(MODELS))
    parser.add_argument("--batch", type=int, default=None, help="per-replica batch "
                        "(default: mirrored_overhead's)")
    args = parser.parse_args()
    rows, ratios = [], {}
    for name in args.models:
        per_rank = rp.launch(compile_worker, num_replicas=2,
                             args=(name, args.rounds, args.steps, args.batch))
        eager = [max(t) for t in zip(*(r["eager"] for r in per_rank))]
        compiled = [max(t) for t in zip(*(r["compiled"] for r in per_rank))]
        ratio = median(compiled) / median(eager)
        ratios[name] = (ratio, max(r["compile_s"][0] for r in per_rank))
        rows.append([name, median(eager) * 1e3, median(compiled) * 1e3, ratio,
                     ratios[name][1]])
    print("\ntorch.compile(model) vs eager under MirroredStrategy, 2 CPU processes, 1 thread "
          "each (median step time)")
    print_table(["model", "eager ms", "compiled ms", "compiled/eager", "compile s"], rows)
    print()
    for name, (ratio, seconds) in ratios.items():
        emit("compile", f"compiled_vs_eager_{name}", ratio, "<= 0.9",
             compile_seconds=round(seconds, 1))


if __name__ == "__main__":
    main()
