"""Hand-over: the CPU a pipeline spends beside the user's function, per batch, ours against
torch's DataLoader with the same two worker processes.

Each sample is one cached 3x224x224 float tensor (an ImageNet crop after augmentation) and its
label, so what is measured is the pipeline's own work: task hand-out, collate into shared
memory, the hand-over of the batch to the consumer, and the consumer's side. The figure is CPU
seconds of the whole process tree (this process and its workers), which the load of other jobs
on the host changes far less than wall time (``benchmarks/ingestion.py`` measures the whole
decode + augment, whose CPU per image varies by +-15 % on a loaded 2-core host).

- ``handover_cpu_vs_dataloader``: ours / DataLoader (``num_workers=2``,
  ``persistent_workers=True``, its best case: no workers started per epoch), CPU per batch
  (goal <= 1.0).

Each round builds both afresh, takes ``--warm`` batches, then times ``--batches``; the rounds
alternate the order; medians and ranges over the rounds are reported.
Run: ``python benchmarks/handover.py [--batches 200] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as MapDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import emit, median, print_table  # noqa: E402
from benchmarks.ingestion import cpu_seconds, load_average  # noqa: E402
from replicator.data import Dataset  # noqa: E402

BENCH = "handover"
BATCH = 64
IMAGE = torch.randn(3, 224, 224)


def sample(i: Any) -> tuple[torch.Tensor, int]:
    return IMAGE, int(i)


class Samples(MapDataset):
    def __len__(self) -> int:
        return BATCH * 1000

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return sample(i)


def ours() -> Iterator[Any]:
    ds = Dataset.from_tensor_slices(torch.arange(BATCH * 1000)).repeat().map(sample)
    return iter(ds.batch(BATCH).prefetch())


def dataloader() -> Iterator[Any]:
    loader = DataLoader(Samples(), batch_size=BATCH, num_workers=2, persistent_workers=True)
    return iter(loader)


def cpu_per_batch(build: Callable[[], Iterator[Any]], warm: int, timed: int) -> float:
    """Milliseconds of CPU (process tree) per batch over ``timed`` batches after ``warm``."""
    it = build()
    for _ in range(warm):
        next(it)
    start = cpu_seconds()
    for _ in range(timed):
        x, _y = next(it)
        del x, _y
    used = cpu_seconds() - start
    del it
    gc.collect()  # the workers stop before the next variant starts its own
    return 1000 * used / timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--warm", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    builders = {"ours": ours, "DataLoader num_workers=2": dataloader}
    got: dict[str, list[float]] = {name: [] for name in builders}
    loads = [load_average()]
    for r in range(args.rounds):
        names = list(builders)[r % 2:] + list(builders)[:r % 2]
        for name in names:
            got[name].append(cpu_per_batch(builders[name], args.warm, args.batches))
            print(f"round {r}: {name}: {got[name][-1]:.2f} ms CPU per batch", flush=True)
    loads.append(load_average())
    print_table(["variant", "CPU ms per batch (median)", "range"],
                [[n, median(v), f"{min(v):.4g}-{max(v):.4g}"] for n, v in got.items()])
    print(f"load average (1, 5, 15 min) at the start: {loads[0]}; at the end: {loads[1]}")
    emit(BENCH, "handover_cpu_vs_dataloader",
         median(got["ours"]) / median(got["DataLoader num_workers=2"]), "<= 1.0",
         load=loads[1])


if __name__ == "__main__":
    main()
