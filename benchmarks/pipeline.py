"""Pipeline bubble and activation memory: GPipe vs 1F1B on 2 stages of fixed compute.

Each stage is a block whose forward takes ``--forward-ms`` and backward twice that, simulated
by sleeping (so the measured idle time shows the schedule, not the contention of a shared
2-core machine), and which saves a ``--width``-float activation per row for backward. For
1, 2, 4, 8 and 16 microbatches the schedule phase of a step (torch's schedule, driven by the
loss gradient) is timed on both ranks; idle fraction = 1 - busy / wall per step, the median
over steps and then the mean of the two ranks, against the theoretical bubble (p-1)/(m+p-1).
Peak activation memory (bytes saved for backward alive at once, rank 0) is compared between
1F1B and GPipe at 8 microbatches.

The theory counts no cost for handing an activation or a gradient to the other stage; here
each costs gloo's one-way latency, which on a loaded 2-core machine is milliseconds. So every
configuration also runs with zero compute: that step's wall time is the transport on the
critical path, and ``ratio_without_transport`` is the ratio once it is taken out of the wall
time (the schedule's own bubble). The gloo round trip of one microbatch's activation is
measured and printed too. "whole step ms" adds the strategy's forward pass without autograd
that precedes the schedule (see ``replicator/parallel/pipeline.py``): about a third more compute.
At 8 microbatches the whole step is also timed with ``strategy.forward_backward`` (forward and
backward in one schedule run, no second forward pass): ``step_forward_backward_vs_two_pass_<s>_m8``
is its step time over the two-pass step's (goal <= 0.8: a third of the compute goes).

JSON lines: ``bubble_<schedule>_m<m>`` (ratio measured / theoretical, goal <= 1.1) and
``activation_1f1b_vs_gpipe_m8`` (goal <= 0.6).

Run: ``python benchmarks/pipeline.py [--steps 5] [--forward-ms 400]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import replicator as rp  # noqa: E402
from benchmarks._report import emit, median, print_table  # noqa: E402
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


def _roundtrip_ms(width: int, rows: int, repeats: int = 40) -> float:
    """Median gloo round trip (send, then receive back) of a ``rows x width`` tensor."""
    t = torch.zeros(rows, width)
    peer = 1 - torch.distributed.get_rank()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        if peer == 1:
            torch.distributed.send(t, peer)
            torch.distributed.recv(t, peer)
        else:
            torch.distributed.recv(t, peer)
            torch.distributed.send(t, peer)
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:]) * 1000


def _measure(schedule: str, m: int, steps: int, forward_ms: float, width: int,
             single_pass: bool = False) -> dict[str, Any]:
    """Median idle fraction and schedule wall time (ms) per step, and peak activations."""
    strategy = rp.PipelineStrategy(num_stages=2, num_microbatches=m, schedule=schedule)
    with strategy.scope():
        model = torch.nn.Sequential(FixedBlock(width, forward_ms / 1000 / m),
                                    FixedBlock(width, forward_ms / 1000 / m))
    runner = strategy._pipelines[0]
    idle: list[float] = []
    walls: list[float] = []
    original = runner._run_schedule

    def run_schedule(x: torch.Tensor, grad: torch.Tensor) -> None:
        torch.distributed.barrier(group=runner.group)
        BUSY[0] = 0.0
        start = time.perf_counter()
        original(x, grad)
        torch.distributed.barrier(group=runner.group)  # the step ends for both
        wall = time.perf_counter() - start
        idle.append(1.0 - BUSY[0] / wall)
        walls.append(wall * 1000)

    runner._run_schedule = run_schedule  # type: ignore[method-assign]
    x = torch.randn(16 * m, width)
    full: list[float] = []
    for i in range(steps + 1):
        if i == 1:  # the first step builds the stages and infers shapes
            idle.clear()
            walls.clear()
            strategy._activation_peak = 0
        start = time.perf_counter()
        strategy.run(lambda: model(x).sum().backward())
        full.append((time.perf_counter() - start) * 1000)
    result = {"idle": median(idle), "wall_ms": median(walls), "step_ms": median(full[1:]),
              "busy_ms": median([w * (1 - f) for w, f in zip(walls, idle)]),
              "activation": strategy.memory_report().peak_activation_bytes}
    if single_pass:
        target = torch.zeros(x.shape[0], width)
        single = []
        for _ in range(steps):
            start = time.perf_counter()
            strategy.run(lambda: strategy.forward_backward(
                model, x, target, lambda out, t: (out - t).sum()))
            single.append((time.perf_counter() - start) * 1000)
        result["single_step_ms"] = median(single)
    strategy.close()
    return result


def _worker(steps: int, forward_ms: float, width: int) -> dict:
    torch.manual_seed(0)
    out: dict[str, Any] = {}
    for schedule in ("gpipe", "1f1b"):
        for m in MICROBATCHES:
            if schedule == "1f1b" and m < 2:
                continue  # 1F1B needs m >= p; with one microbatch it is GPipe
            key = f"{schedule}_m{m}"
            out[key] = _measure(schedule, m, steps, forward_ms, width, single_pass=m == 8)
            # the same schedule and shapes with no compute: the transport on the critical path
            out[key]["transport_ms"] = _measure(schedule, m, steps, 0.0, width)["wall_ms"]
            if "roundtrip_ms" not in out:
                out["roundtrip_ms"] = _roundtrip_ms(width, 16)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--forward-ms", type=float, default=400.0,
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
            # idle once the no-compute step's wall time (transport) is taken out of the wall
            net = [1 - r[key]["busy_ms"] / max(r[key]["wall_ms"] - r[key]["transport_ms"],
                                               r[key]["busy_ms"]) for r in ranks]
            idle_net = sum(net) / len(net)
            theory = (p - 1) / (m + p - 1)
            transport = sum(r[key]["transport_ms"] for r in ranks) / len(ranks)
            rows.append((key, idle, theory, idle / theory, ranks[0][key]["wall_ms"], transport,
                         idle_net / theory, ranks[0][key]["step_ms"],
                         ranks[0][key]["activation"]))
    print(f"stage forward {args.forward_ms:g} ms per batch (backward twice that), "
          f"{args.steps} timed steps; gloo round trip of one microbatch's activation "
          f"(16 x {args.width} floats): {ranks[0]['roundtrip_ms']:.2f} ms; load average "
          f"{os.getloadavg()[0]:.2f}")
    print_table(["run", "idle fraction", "theoretical bubble", "ratio", "schedule ms",
                 "transport ms (no compute)", "ratio without transport",
                 "whole step ms", "peak activation bytes (rank 0)"], rows)
    for key, idle, theory, ratio, _, transport, net_ratio, _, _ in rows:
        emit(BENCH, f"bubble_{key}", ratio, "<= 1.1", measured=round(idle, 4),
             theoretical=round(theory, 4), transport_ms=round(transport, 2),
             ratio_without_transport=round(net_ratio, 4))
    for schedule in ("gpipe", "1f1b"):
        r = ranks[0][f"{schedule}_m8"]
        print(f"{schedule} m=8 whole step: {r['step_ms']:.0f} ms with model(x) + backward, "
              f"{r['single_step_ms']:.0f} ms with strategy.forward_backward")
        emit(BENCH, f"step_forward_backward_vs_two_pass_{schedule}_m8",
             r["single_step_ms"] / r["step_ms"], "<= 0.8",
             two_pass_ms=round(r["step_ms"], 1), forward_backward_ms=round(r["single_step_ms"], 1))
    act = ranks[0]["1f1b_m8"]["activation"] / ranks[0]["gpipe_m8"]["activation"]
    emit(BENCH, "activation_1f1b_vs_gpipe_m8", act, "<= 0.6",
         gpipe_bytes=ranks[0]["gpipe_m8"]["activation"],
         one_f_one_b_bytes=ranks[0]["1f1b_m8"]["activation"])


if __name__ == "__main__":
    main()
