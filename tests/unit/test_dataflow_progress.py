"""The progress bar shows the share of the epoch the training loop spent waiting for input, as
measured by the input itself (the time the loop was blocked in ``next()``): a pipeline made slow
on purpose shows a larger share than the same pipeline without the delay, for an
``rp.data.Dataset`` (whose ``stats()`` hold the waits) and for a plain ``DataLoader``."""

from __future__ import annotations

import re
import statistics
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import replicator as rp
from tests.data_helpers import SleepingLinear

N, BATCH = 96, 8


DELAY_S = 0.02  # per example: the slow epoch waits N * DELAY_S in all, whatever the load
STEP_S = 0.04  # per step: a step as long as a real one, so the fast pipeline's share stays
#              # small however slow a busy machine makes its Python (a bare Linear's step left
#              # both shares near 100% beside four CPU hogs)


def slow(example: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    time.sleep(DELAY_S)  # a decode that takes a while: the step waits for it
    return example


def fast(example: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return example


def fit(pipeline: object, capsys: pytest.CaptureFixture[str]) -> tuple[float, float]:
    """The share of waiting the progress bar showed, and the median step (forward to forward)
    as the machine ran it."""
    models: list[SleepingLinear] = []

    def model() -> SleepingLinear:
        models.append(SleepingLinear(STEP_S))
        return models[-1]
    trainer = rp.Trainer(rp.OneDeviceStrategy("cpu"), model,
                         lambda p: torch.optim.SGD(p, lr=0.01), torch.nn.MSELoss())
    capsys.readouterr()
    trainer.fit(pipeline, epochs=1)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("epoch 1/1"))
    found = re.search(r"input (\d+)%", line)
    assert found, line
    return int(found.group(1)) / 100, statistics.median(np.diff(models[-1].started))


def dataflow(fn) -> rp.data.Dataset:
    x, y = torch.randn(N, 4), torch.randn(N, 1)
    return rp.data.Dataset.from_tensor_slices((x, y)).map(fn, num_parallel_calls=None).batch(BATCH)


@pytest.mark.timeout(120)
def test_a_slow_pipeline_shows_a_larger_share_of_waiting_than_a_fast_one(capsys) -> None:
    slow_ds, fast_ds = dataflow(slow), dataflow(fast)
    slow_share, _ = fit(slow_ds, capsys)
    fast_share, step_s = fit(fast_ds, capsys)
    assert slow_share > fast_share, (slow_share, fast_share)
    # the input measured the waits (the sleeps, less what prefetching overlapped with the
    # steps: at most one step per batch, a step as long as the fast epoch's, which waited for
    # next to nothing, on this machine at its load now), and the pipeline's stats hold them
    overlap = N // BATCH * max(STEP_S, step_s)
    assert slow_ds.stats()["input_wait_s"] >= (N * DELAY_S - overlap) * 0.9, step_s
    assert slow_ds.stats()["input_wait_s"] > fast_ds.stats()["input_wait_s"] > 0.0


@pytest.mark.timeout(60)
def test_the_share_is_shown_for_a_plain_dataloader_too(capsys) -> None:
    data = TensorDataset(torch.randn(N, 4), torch.randn(N, 1))
    share, _ = fit(DataLoader(data, batch_size=BATCH), capsys)
    assert 0.0 <= share <= 1.0
