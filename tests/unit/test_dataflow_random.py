"""Random augmentation in process workers: forked workers start with their parent's random
state, so without a seed of their own two workers draw the same "random" crops for different
images. Each task is seeded (torch, ``random``, NumPy) from the consumer's torch generator, the
pass and the task: draws differ between elements, do not depend on how many workers run, and
repeat under the same ``torch.manual_seed``."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from replicator.data import Dataset, Options

pytestmark = pytest.mark.timeout(120)


def draws(x: torch.Tensor) -> tuple[float, float, float]:
    return torch.rand(()).item(), random.random(), float(np.random.rand())


def epochs(workers: int, seed: int = 0) -> list[list[tuple[float, float, float]]]:
    torch.manual_seed(seed)
    ds = Dataset.from_tensor_slices(torch.arange(24)).map(draws, num_parallel_calls=workers) \
        .with_options(Options(worker_type="process", cpu_budget=workers))
    try:
        return [list(ds) for _ in range(2)]
    finally:
        ds.close()


def test_process_workers_draw_their_own_random_numbers_the_same_for_any_count() -> None:
    two = epochs(2)
    for epoch in two:
        for generator in range(3):  # torch, random, numpy
            values = [d[generator] for d in epoch]
            assert len(set(values)) == len(values), f"generator {generator} repeated a draw"
    assert two[0] != two[1]  # a new epoch draws anew
    assert epochs(3) == two  # the same draws whichever worker took which element
    assert epochs(2) == two  # and again under the same seed
    assert epochs(2, seed=1) != two
