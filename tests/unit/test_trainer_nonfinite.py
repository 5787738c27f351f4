"""``Trainer.fit(terminate_on_nan=True)``, one process: the default stop, and who decides
instead when the user gave a ``TerminateOnNaN`` callback or a ``BackupAndRestore``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import replicator as rp


def _trainer() -> rp.Trainer:
    torch.manual_seed(0)
    return rp.Trainer(rp.OneDeviceStrategy("cpu"), lambda: nn.Linear(4, 1),
                      lambda p: torch.optim.SGD(p, lr=0.1), nn.MSELoss())


def _data(nan_row: int) -> DataLoader:
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    y[nan_row] = float("inf")
    return DataLoader(TensorDataset(x, y), batch_size=8)


def test_fit_raises_naming_the_step_and_epoch_with_the_weights_of_the_step_before() -> None:
    trainer = _trainer()
    with pytest.raises(rp.errors.NonFiniteLossError,
                       match=r"at step 2 of epoch 1/3 \(global step 2\)"
                       r" on 1 of 1 replica\(s\).*weights are those after global step 1"):
        trainer.fit(_data(nan_row=9), epochs=3, verbose=0)  # row 9: in the 2nd step
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert trainer.global_step == 1


def test_a_backup_with_its_own_setting_decides(tmp_path) -> None:
    trainer = _trainer()
    backup = rp.BackupAndRestore(tmp_path / "backup", terminate_on_nan=False)
    trainer.fit(_data(nan_row=9), epochs=1, verbose=0, callbacks=[backup])
    assert trainer.global_step == 4
    assert any(not torch.isfinite(p).all() for p in trainer.model.parameters())
    assert math.isinf(trainer.history.history["loss"][0]) or \
        math.isnan(trainer.history.history["loss"][0])
