"""A Trainer run killed mid-run (SIGKILL of a rank) and restarted equals, as a whole, one that
was never interrupted: History, the CSV log byte for byte, the best checkpoint file and the
epoch where early stopping ends training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import replicator as rp
from replicator.testing import run_distributed
from tests.train_helpers import digits, loader, model_fn

EPOCHS, STEPS_PER_EPOCH, SAVE_FREQ = 16, 3, 4  # 96 samples, global batch 32


class KillAt(rp.Callback):
    """SIGKILLs rank 1 at a global step, on the first attempt only."""

    def __init__(self, step: int) -> None:
        self.fault = rp.testing.kill_rank(1, at_step=step)

    def on_train_batch_end(self, batch, logs=None):
        self.fault(self.trainer.global_step)


class RecordWait(rp.Callback):
    """Early stopping's patience counter at each epoch's end (to place the kill)."""

    def __init__(self, early: rp.EarlyStopping) -> None:
        self.early = early
        self.waits: list[int] = []

    def on_epoch_end(self, epoch, logs=None):
        self.waits.append(self.early.wait)


def fit_resumable(work: str, kill_step: int | None) -> dict:
    from replicator.resume import BackupAndRestore

    out = Path(work)
    strategy = rp.MirroredStrategy()
    train, test = digits(STEPS_PER_EPOCH * 32)
    test = TensorDataset(*test[:200])
    trainer = rp.Trainer(strategy, model_fn, lambda p: torch.optim.Adam(p, lr=0.05),
                         nn.CrossEntropyLoss(), metrics=["accuracy"])
    early = rp.EarlyStopping(monitor="val_loss", patience=1)
    record = RecordWait(early)
    callbacks = [rp.callbacks.CSVLogger(str(out / "log.csv")), early,
                 rp.ModelCheckpoint(str(out / "best.safetensors"), monitor="val_loss",
                                    save_best_only=True), record,
                 BackupAndRestore(str(out / "backup"), save_freq=SAVE_FREQ)]
    if kill_step is not None:
        callbacks.insert(0, KillAt(kill_step))
    history = trainer.fit(loader(train), epochs=EPOCHS, validation_data=loader(test, 64, False),
                          callbacks=callbacks, verbose=0)
    result = {"history": history.history, "epochs": history.epoch, "waits": record.waits,
              "stopped_epoch": early.stopped_epoch, "steps": trainer.global_step}
    if strategy.is_chief:
        result["csv"] = (out / "log.csv").read_bytes()
        result["best"] = (out / "best.safetensors").read_bytes()
    return result


def _kill_step(reference: dict) -> int:
    """The first step of the epoch where early stopping ends the run. Checks that this epoch
    tells a resume that forgot anything: early stopping was already waiting (a reset counter
    runs on), the epoch is worse than the best (a forgotten best overwrites the checkpoint),
    and the previous epoch ended after the last backup (the CSV holds a row to cut off)."""
    stop = reference["stopped_epoch"]
    val_loss = reference["history"]["val_loss"]
    assert reference["waits"][stop - 1] >= 1, reference["waits"]
    assert val_loss[stop] > min(val_loss[:stop]), val_loss
    assert (stop * STEPS_PER_EPOCH) % SAVE_FREQ != 0
    return stop * STEPS_PER_EPOCH + 1


@pytest.mark.timeout(240)
def test_killed_fit_resumes_history_csv_best_checkpoint_and_early_stop(tmp_path):
    ref = run_distributed(fit_resumable, 2, args=(str(tmp_path / "ref"), None))[0]
    # the data and patience make early stopping end the run before its last epoch
    assert ref["stopped_epoch"] is not None and ref["stopped_epoch"] < EPOCHS - 1
    assert ref["epochs"] == list(range(ref["stopped_epoch"] + 1))
    kill_step = _kill_step(ref)
    out = run_distributed(fit_resumable, 2, args=(str(tmp_path / "run"), kill_step),
                          max_restarts=1)[0]
    # the second attempt ran: its RecordWait saw only the epochs after the restore
    assert len(out["waits"]) < len(ref["waits"])
    assert out["stopped_epoch"] == ref["stopped_epoch"]
    assert out["epochs"] == ref["epochs"] and out["steps"] == ref["steps"]
    assert out["history"] == ref["history"]  # exact, not approximately
    assert out["csv"] == ref["csv"]
    assert out["best"] == ref["best"]
