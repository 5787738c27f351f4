"""Datasets and helpers for the input-pipeline tests (module level, so workers can import them).

Every sample carries its id, so a test can check exactly which samples each replica saw.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset


class IdDataset(Dataset):
    """Map-style: sample ``i`` is ``(i, x_i)`` with ``x_i = [i, i]`` as floats."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return int(i), torch.tensor([float(i), float(i)])


class IdStream(IterableDataset):
    """The same samples as :class:`IdDataset`, as a stream."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor]]:
        for i in range(self.n):
            yield i, torch.tensor([float(i), float(i)])


def write_id_files(folder: str, sizes: list[int]) -> list[str]:
    """JSON-lines files holding consecutive ids, file ``k`` with ``sizes[k]`` lines."""
    os.makedirs(folder, exist_ok=True)
    paths, start = [], 0
    for k, size in enumerate(sizes):
        path = os.path.join(folder, f"part-{k:03d}.jsonl")
        with open(path, "w") as f:
            for i in range(start, start + size):
                f.write(json.dumps({"id": i}) + "\n")
        paths.append(path)
        start += size
    return paths


def read_id_file(path: str) -> Iterator[tuple[int, torch.Tensor]]:
    with open(path) as f:
        for line in f:
            i = json.loads(line)["id"]
            yield i, torch.tensor([float(i), float(i)])


def double_x(sample: tuple[int, torch.Tensor]) -> tuple[int, torch.Tensor]:
    """A per-sample transform (module level, so process workers can run it)."""
    i, x = sample
    return i, x * 2


def batch_ids(batch: Any, mask: torch.Tensor | None = None) -> list[int]:
    """The ids of the real samples of a batch (``mask`` 0 rows left out)."""
    ids = batch[0].tolist()
    if mask is None:
        return ids
    return [i for i, m in zip(ids, mask.tolist()) if m > 0]


def take_steps(dist: Any, steps: int) -> list[list[int]]:
    """The real ids of the next ``steps`` batches, crossing epoch ends as training would."""
    out: list[list[int]] = []
    while len(out) < steps:
        before = len(out)
        for batch in dist:
            out.append(batch_ids(batch, dist.mask))
            if len(out) == steps:
                break
        if len(out) == before:
            raise AssertionError("an epoch produced no batch")
    return out


def id_batches(n_batches: int, batch_size: int, start: int = 0) -> list[tuple[torch.Tensor]]:
    """Per-replica batches of consecutive ids (what an ``input_fn`` pipeline could yield)."""
    return [(torch.arange(start + b * batch_size, start + (b + 1) * batch_size),)
            for b in range(n_batches)]


class SleepingLinear(torch.nn.Module):
    """A ``Linear(4, 1)`` whose forward also sleeps ``step_s``: a training step of a fixed
    length whatever the machine's load, beside which an input pipeline's waits are measured."""

    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.step_s = step_s
        self.linear = torch.nn.Linear(4, 1)
        self.started: list[float] = []  # when each forward began (the loop's step cycle)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.started.append(time.monotonic())
        time.sleep(self.step_s)
        return self.linear(x)
