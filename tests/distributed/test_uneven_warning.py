"""An uneven last batch with a loss not built by ``compute_average_loss`` warns once, naming the
sizes and the fix (real processes; the warning needs no collective)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import replicator as rp
from replicator.testing import run_distributed


def _train(samples: int, loss_kind: str, per_replica: bool = False) -> list[str]:
    strategy = rp.MirroredStrategy()
    with strategy.scope():
        model = nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(samples, 3), torch.randn(samples, 1))
    if per_replica:  # replica r reads samples + r rows in batches of 4
        def input_fn(ctx: rp.InputContext) -> DataLoader:
            n = samples + ctx.input_pipeline_id
            return DataLoader(TensorDataset(torch.randn(n, 3), torch.randn(n, 1)),
                              batch_size=4)

        dist_data = strategy.distribute_datasets_from_function(input_fn,
                                                               drop_remainder=False)
    else:
        dist_data = strategy.distribute_dataset(DataLoader(data, batch_size=4))

    def step(batch: tuple) -> torch.Tensor:
        x, y = batch
        if loss_kind == "mean":
            loss = F.mse_loss(model(x), y)
        else:
            per_example = F.mse_loss(model(x), y, reduction="none").mean(1)
            loss = rp.compute_average_loss(per_example, sample_weight=dist_data.mask)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # two epochs: two uneven batches, one warning
            for batch in dist_data:
                strategy.run(step, args=(batch,))
    return [str(w.message) for w in caught if "uneven batch" in str(w.message)]


@pytest.mark.timeout(120)
def test_mean_loss_on_an_uneven_batch_warns_once_on_the_chief():
    chief, other = run_distributed(_train, 2, args=(11, "mean"))  # last batch: 3 = 2 + 1
    assert other == []
    assert len(chief) == 1, chief
    text = chief[0]
    assert "step 3 of epoch 0" in text and "global batch of 3 samples is split 2 + 1" in text
    assert "rp.compute_average_loss" in text and "sample_weight=mask" in text


@pytest.mark.timeout(120)
@pytest.mark.parametrize("samples,loss_kind", [(11, "average"), (12, "mean"), (10, "mean")])
def test_no_warning_when_exact_or_even(samples, loss_kind):
    # compute_average_loss; or 12 = 3 full batches; or a last batch of 2 = 1 + 1
    assert run_distributed(_train, 2, args=(samples, loss_kind)) == [[], []]


@pytest.mark.timeout(120)
def test_per_replica_pipelines_warn_where_the_batch_is_short():
    # replica 0 reads 9 rows (last batch 1), replica 1 reads 10 rows (last batch 2)
    results = run_distributed(_train, 2, args=(9, "mean", True))
    for rank, texts in enumerate(results):
        assert len(texts) == 1, texts
        assert f"replica {rank}: an uneven batch at step 3 of epoch 0" in texts[0]
