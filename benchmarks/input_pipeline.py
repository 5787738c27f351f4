"""Input pipeline: throughput against torch's DataLoader, and overlap of input with compute.

A dataset whose per-sample transform costs a fixed CPU time (a calibrated run of small matrix
products, like decoding or augmenting in native code) feeds a training step of a fixed compute
cost. ``--step device`` (default): the step is a fixed wait of the host thread, as when it
waits for an accelerator to finish the step's kernels; ``--step cpu``: the step computes on
the host (a calibrated run of larger matrix products), so input and step compete for the
cores. One process, one torch thread.

- ``vs_dataloader``: samples/s of the whole loop (input + a short step, so the input is the
  bottleneck) with ``--workers`` process workers, ours (``distribute_dataset(...,
  transform=...)``) against a ``DataLoader`` with the same workers, shuffling, persistent
  workers and prefetch. Ratio = ours / DataLoader (goal >= 1.0). Our thread-worker engine is
  shown in the table too.
- ``overlap_prefetch`` / ``overlap_no_prefetch``: time per step of the loop divided by
  ``max(data_time, compute_time)``, each measured alone: 1.0 means the input is hidden behind
  the step completely; without prefetch the two add up (about 2.0 when they are equal). The
  input runs in the prefetch thread (``num_workers=0``); prefetch off reads in the step's thread.

Rounds alternate between the variants so machine noise hits all alike; medians are reported.
Run: ``python benchmarks/input_pipeline.py [--repeats 5] [--steps 40] [--workers 2]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import emit, median, print_table  # noqa: E402
from replicator.data import InputContext, InputOptions, distribute_dataset  # noqa: E402

BENCH = "input_pipeline"
FEATURES = 256
_WORK: dict[str, Any] = {"sample_reps": 1, "step_reps": 1, "step_wait_s": 0.0}
_SAMPLE_A = torch.randn(128, 128) / 128
_STEP_A = torch.randn(512, 512) / 512


class Samples(Dataset):
    """Cheap to read: sample ``i`` is a constant vector (the cost is in the transform)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((FEATURES,), float(i))


def transform(sample: torch.Tensor) -> torch.Tensor:
    """Fixed CPU cost per sample (``sample_reps`` small matrix products)."""
    acc = _SAMPLE_A
    for _ in range(_WORK["sample_reps"]):
        acc = torch.mm(acc, _SAMPLE_A).tanh_()
    return sample + acc[0, 0]


class Transformed(Dataset):
    """The DataLoader baseline: the same transform inside ``__getitem__``."""

    def __init__(self, base: Dataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> torch.Tensor:
        return transform(self.base[i])


def step(batch: torch.Tensor) -> float:
    """Fixed compute cost per step: a wait (``--step device``) or ``step_reps`` larger matrix
    products (``--step cpu``)."""
    if _WORK["step_wait_s"]:
        time.sleep(_WORK["step_wait_s"])
        return float(batch[0, 0])
    acc = _STEP_A
    for _ in range(_WORK["step_reps"]):
        acc = torch.mm(acc, _STEP_A).tanh_()
    return float(acc[0, 0]) + float(batch[0, 0])


def calibrate(fn: Callable[[], Any], key: str, target_s: float) -> float:
    """Set ``_WORK[key]`` so that ``fn()`` takes about ``target_s``; returns the time."""
    _WORK[key] = 1
    for _ in range(3):
        t = min(_time(fn) for _ in range(5))
        _WORK[key] = max(1, round(_WORK[key] * target_s / t))
    return median([_time(fn) for _ in range(7)])


def _time(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def loop_time(batches: Iterable[Any], steps: int, compute: bool = True) -> float:
    """Seconds per step of ``steps`` steps (after one warm-up step), from an epoch's start."""
    if callable(getattr(batches, "set_epoch", None)):
        batches.set_epoch(0)  # type: ignore[attr-defined]
    it = iter(batches)
    step(next(it))
    start = time.perf_counter()
    for _ in range(steps):
        batch = next(it)
        if compute:
            step(batch)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sample-ms", type=float, default=0.6)
    parser.add_argument("--step-ms", type=float, default=20.0,
                        help="step cost in the overlap loops (about the input's cost)")
    parser.add_argument("--vs-step-ms", type=float, default=4.0,
                        help="step cost in the DataLoader comparison (small: input-bound)")
    parser.add_argument("--step", choices=("device", "cpu"), default="device")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sample_s = calibrate(lambda: transform(torch.zeros(FEATURES)), "sample_reps",
                         args.sample_ms / 1e3)
    reps_per_ms = 0.0
    if args.step == "cpu":
        calibrate(lambda: step(torch.zeros(1, 1)), "step_reps", args.step_ms / 1e3)
        reps_per_ms = _WORK["step_reps"] / args.step_ms

    def set_step(ms: float) -> None:
        if args.step == "device":
            _WORK["step_wait_s"] = ms / 1e3
        else:
            _WORK["step_reps"] = max(1, round(reps_per_ms * ms))

    n = args.batch * (args.steps + 2)
    data, ctx, cpu = Samples(n), InputContext(), torch.device("cpu")
    print(f"transform {sample_s * 1e3:.2f} ms/sample x batch {args.batch}; {args.step} step "
          f"{args.vs_step_ms:g} ms (vs DataLoader) / {args.step_ms:g} ms (overlap); "
          f"{args.workers} workers; {args.steps} steps x {args.repeats} rounds", flush=True)

    def ours(workers: int, kind: str, prefetch: int = 2) -> Any:
        return distribute_dataset(data, ctx, cpu, batch_size=args.batch, shuffle=True,
                                  transform=transform, options=InputOptions(
                                      num_workers=workers, worker_type=kind, prefetch=prefetch,
                                      worker_start_method="fork"))

    torch_loader = DataLoader(Transformed(data), batch_size=args.batch, shuffle=True,
                              num_workers=args.workers, persistent_workers=True,
                              prefetch_factor=2, multiprocessing_context="fork")
    ours_process, ours_thread = ours(args.workers, "process"), ours(args.workers, "thread")
    inline_prefetch, inline_sync = ours(0, "thread", 2), ours(0, "thread", 0)
    times: dict[str, list[float]] = {k: [] for k in (
        "dataloader", "ours_process", "ours_thread", "data_alone", "step_alone",
        "loop_prefetch", "loop_no_prefetch")}
    for _ in range(args.repeats):
        set_step(args.vs_step_ms)
        times["dataloader"].append(loop_time(torch_loader, args.steps))
        times["ours_process"].append(loop_time(ours_process, args.steps))
        times["ours_thread"].append(loop_time(ours_thread, args.steps))
        set_step(args.step_ms)
        times["data_alone"].append(loop_time(inline_sync, args.steps, compute=False))
        times["step_alone"].append(median([_time(lambda: step(torch.zeros(1, 1)))
                                           for _ in range(5)]))
        times["loop_prefetch"].append(loop_time(inline_prefetch, args.steps))
        times["loop_no_prefetch"].append(loop_time(inline_sync, args.steps))
    med = {k: median(v) for k, v in times.items()}
    rate = {k: args.batch / med[k] for k in ("dataloader", "ours_process", "ours_thread")}
    bound = max(med["data_alone"], med["step_alone"])
    overlap_on, overlap_off = med["loop_prefetch"] / bound, med["loop_no_prefetch"] / bound
    vs = rate["ours_process"] / rate["dataloader"]
    print()
    print_table(["loop", "ms/step (median)", "samples/s"], [
        [f"torch DataLoader, {args.workers} process workers", med["dataloader"] * 1e3,
         rate["dataloader"]],
        [f"ours, {args.workers} process workers", med["ours_process"] * 1e3,
         rate["ours_process"]],
        [f"ours, {args.workers} thread workers", med["ours_thread"] * 1e3, rate["ours_thread"]],
        ["input alone (no step)", med["data_alone"] * 1e3, args.batch / med["data_alone"]],
        [f"step alone ({args.step_ms:g} ms, no input)", med["step_alone"] * 1e3,
         args.batch / med["step_alone"]],
        ["ours, prefetch=2 (input in the prefetch thread)", med["loop_prefetch"] * 1e3,
         args.batch / med["loop_prefetch"]],
        ["ours, prefetch=0 (input in the step's thread)", med["loop_no_prefetch"] * 1e3,
         args.batch / med["loop_no_prefetch"]],
    ])
    print()
    print_table(["figure", "ratio", "goal"], [
        ["vs_dataloader (ours / DataLoader samples/s)", vs, ">= 1.0"],
        ["overlap_prefetch (step / max(data, compute))", overlap_on, "<= 1.15"],
        ["overlap_no_prefetch", overlap_off, "(reference)"],
    ])
    print()
    emit(BENCH, "vs_dataloader", vs, ">= 1.0", ours_samples_per_s=round(rate["ours_process"], 1),
         dataloader_samples_per_s=round(rate["dataloader"], 1), workers=args.workers,
         step=args.step)
    emit(BENCH, "overlap_prefetch", overlap_on, "<= 1.15",
         step_ms=round(med["loop_prefetch"] * 1e3, 2), data_ms=round(med["data_alone"] * 1e3, 2),
         compute_ms=round(med["step_alone"] * 1e3, 2), step=args.step)
    emit(BENCH, "overlap_no_prefetch", overlap_off, "reference (no overlap: about 2)",
         step_ms=round(med["loop_no_prefetch"] * 1e3, 2), step=args.step)
    for dist in (ours_process, ours_thread, inline_prefetch, inline_sync):
        dist.close()


if __name__ == "__main__":
    main()
