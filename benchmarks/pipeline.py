"""Pipeline bubble and activation memory: GPipe vs 1F1B on 2 stages of fixed compute.

Each stage is a block whose forward takes ``--forward-ms`` and backward twice that, simulated
by sleeping (so the measured idle time shows the schedule, not the contention of a shared
2-core machine), and which saves a ``--width``-float activation per row for backward. For
1, 2, 4, 8 and 16 microbatches the schedule phase of a step (torch's schedule, driven by the
loss gradient) is timed on both ranks; idle fraction = 1 - busy / wall, averaged over ranks
and steps, against the theoretical bubble (p-1)/(m+p-1). Peak activation memory (bytes saved
for backward alive at once, rank 0) is compared between 1F1B and GPipe at 8 microbatches.

JSON lines: ``bubble_<schedule>_m<m>`` (ratio measured / theoretical, goal <= 1.1) and
``activation_1f1b_vs_gpipe_m8`` (goal <= 0.6).

Run: ``python benchmarks/pipeline.py [--steps 3] [--forward-ms 20]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import replicator as rp  # noqa: E402
from benchmarks._report import emit, print_table  # noqa: E402
from replicator.testing import run_distributed  # noqa: E402

BENCH = "pipeline"
MICROBATCHES = (1, 2, 4, 8, 16)
BUSY = [0.0]  # seconds of stage compute on this rank (forward + backward)


class _FixedCompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        ctx.save_for_backward(x)
        start = time.perf_counter()
        time.sleep(seconds)
        BUSY[0] += time.perf_counter() - start
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        start = time.perf_counter()
        time.sleep(2 * ctx.seconds)
        BUSY[0] += time.perf_counter() - start
        return grad * 1.0 + 0 * x, None


class FixedBlock(torch.nn.Module):
    """A block of fixed cost: forward ``seconds``, backward ``2 * seconds``."""

    def __init__(self, width: int, seconds: float) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(width))
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FixedCompute.apply(x * self.scale, self.seconds)


def _worker(steps: int, forward_ms: float, width: int) -> dict:
    torch.manual_seed(0)
    out: dict[str, Any] = {}
    for schedule in ("gpipe", "1f1b"):
        for m in MICROBATCHES:
            if schedule == "1f1b" and m < 2:
                continue  # 1F1B needs m >= p; with one microbatch it is GPipe
            strategy = rp.PipelineStrategy(num_stages=2, num_microbatches=m, schedule=schedule)
            with strategy.scope():
                model = torch.nn.Sequential(FixedBlock(width, forward_ms / 1000 / m),
                                            FixedBlock(width, forward_ms / 1000 / m))
            runner = strategy._pipelines[0]
            timed = {"wall": 0.0, "busy": 0.0}
            original = runner._run_schedule

            def run_schedule(x: torch.Tensor, grad: torch.Tensor, _orig: Any = original,
                             _t: dict = timed, _group: Any = runner.group) -> None:
                torch.distributed.barrier(group=_group)
                BUSY[0] = 0.0
                start = time.perf_counter()
                _orig(x, grad)
                torch.distributed.barrier(group=_group)  # the step ends for both
                _t["wall"] += time.perf_counter() - start
                _t["busy"] += BUSY[0]

            runner._run_schedule = run_schedule  # type: ignore[method-assign]
            x = torch.randn(16 * m, width)
            for i in range(steps + 1):
                if i == 1:  # the first step builds the stages and infers shapes
                    timed["wall"] = timed["busy"] = 0.0
                    strategy._activation_peak = 0
                strategy.run(lambda m=model, b=x: m(b).sum().backward())
            out[f"{schedule}_m{m}"] = {
                "idle": 1.0 - timed["busy"] / timed["wall"],
                "activation": strategy.memory_report().peak_activation_bytes}
            strategy.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--forward-ms", type=float, default=80.0,
                        help="forward time of one stage for the whole batch")
    parser.add_argument("--width", type=int, default=4096)
    args = parser.parse_args()
    ranks = run_distributed(_worker, 2, args=(args.steps, args.forward_ms, args.width),
                            timeout_seconds=600)
    rows = []
    p = 2
    for schedule in ("gpipe", "1f1b"):
        for m in MICROBATCHES:
            key = f"{schedule}_m{m}"
            if key not in ranks[0]:
                continue
            idle = sum(r[key]["idle"] for r in ranks) / len(ranks)
            theory = (p - 1) / (m + p - 1)
            rows.append((key, idle, theory, idle / theory, ranks[0][key]["activation"]))
    print_table(["run", "idle fraction", "theoretical bubble", "ratio",
                 "peak activation bytes (rank 0)"], rows)
    for key, idle, theory, ratio, _ in rows:
        emit(BENCH, f"bubble_{key}", ratio, "<= 1.1", measured=round(idle, 4),
             theoretical=round(theory, 4))
    act = ranks[0]["1f1b_m8"]["activation"] / ranks[0]["gpipe_m8"]["activation"]
    emit(BENCH, "activation_1f1b_vs_gpipe_m8", act, "<= 0.6",
         gpipe_bytes=ranks[0]["gpipe_m8"]["activation"],
         one_f_one_b_bytes=ranks[0]["1f1b_m8"]["activation"])


if __name__ == "__main__":
    main()
