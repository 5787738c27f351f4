"""``Trainer.fit`` stops on a NaN loss by default (Keras's TerminateOnNaN), on every replica at
the same step and before that step's optimizer step; ``terminate_on_nan=False`` trains on."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import replicator as rp
from replicator.testing import assert_params_close, run_distributed

GLOBAL_BATCH = 4


def regression_with_nan_at(row: int | None) -> TensorDataset:
    """16 samples; the input of sample ``row`` is NaN (global step ``row // 4 + 1``)."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3, generator=gen), torch.randn(16, 1, generator=gen)
    if row is not None:
        x[row] = float("nan")
    return TensorDataset(x, y)


def fit_until_nan(row: int | None, epochs: int = 2, steps: int | None = None,
                  **fit_kwargs) -> dict:
    strategy = rp.get_strategy("mirrored")
    torch.manual_seed(0)
    trainer = rp.Trainer(strategy, lambda: torch.nn.Linear(3, 1),
                         lambda p: torch.optim.SGD(p, lr=0.1), torch.nn.MSELoss())
    loader = DataLoader(regression_with_nan_at(row), batch_size=GLOBAL_BATCH)
    out: dict = {"error": None}
    try:
        trainer.fit(loader, epochs=epochs, verbose=0, steps_per_epoch=steps, **fit_kwargs)
    except rp.errors.NonFiniteLossError as exc:
        out["error"] = str(exc)
    out["state"] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    out["global_step"] = trainer.global_step
    return out


@pytest.mark.timeout(120)
def test_a_nan_loss_on_one_replica_stops_every_replica_before_the_step() -> None:
    # sample 11 is in global step 3 (samples 8..11), on rank 1's half of it
    ranks = run_distributed(fit_until_nan, 2, args=(11,))
    clean = run_distributed(fit_until_nan, 2, args=(None, 1, 2))  # 2 steps, no NaN
    for rank, out in enumerate(ranks):
        message = out["error"]
        assert message is not None, f"rank {rank} trained on"
        assert "at step 3 of epoch 1/2 (global step 3) on 1 of 2 replica(s)" in message
        assert f"rank {rank}'s own loss is {'not finite' if rank == 1 else 'finite'}" in message
        assert "terminate_on_nan=False" in message and "HINT" in message
        assert out["global_step"] == 2
        # the weights are those after step 2: as a clean run stopped after 2 steps
        assert all(torch.isfinite(v).all() for v in out["state"].values())
        assert_params_close(clean[0]["state"], out["state"], atol=0.0)


@pytest.mark.timeout(120)
def test_terminate_on_nan_false_trains_on_as_before() -> None:
    ranks = run_distributed(fit_until_nan, 2, args=(11,), kwargs={"terminate_on_nan": False})
    for out in ranks:
        assert out["error"] is None and out["global_step"] == 8
        assert any(math.isnan(float(v.flatten()[0])) for v in out["state"].values())
