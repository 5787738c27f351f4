"""Callbacks and metrics on one device."""

from __future__ import annotations

import csv
import json
import math
import re
import time

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

import replicator as rp
from tests.train_helpers import digits, loader, make_trainer


def test_metrics_values():
    acc = rp.metrics.SparseCategoricalAccuracy()
    acc.update(torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]), torch.tensor([1, 1, 1]))
    assert acc.result() == pytest.approx(2 / 3)
    acc.update(torch.tensor([[0.0, 1.0]]), torch.tensor([0]), sample_weight=torch.tensor([0.0]))
    assert acc.result() == pytest.approx(2 / 3)  # a padded sample counts not at all
    auc = rp.metrics.AUC()
    auc.update(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]))
    assert auc.result() == pytest.approx(0.75, abs=0.01)
    mean = rp.metrics.Mean()
    mean.update(torch.tensor([1.0, 2.0, 6.0]), torch.zeros(3))
    assert mean.result() == pytest.approx(3.0)
    with pytest.raises(ValueError, match="unknown metric 'f1'"):
        rp.Trainer(rp.OneDeviceStrategy("cpu"), nn.Linear(2, 2), torch.optim.SGD(
            nn.Linear(2, 2).parameters(), lr=0.1), nn.MSELoss(), metrics=["f1"])


def test_fit_history_checkpoint_csv_lr_and_early_stopping(tmp_path):
    train, test = digits(320)
    trainer = make_trainer(rp.OneDeviceStrategy("cpu"))
    lrs = []

    class RecordLR(rp.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            lrs.append(self.trainer.optimizer.param_groups[0]["lr"])

    ckpt = rp.ModelCheckpoint(str(tmp_path / "best.safetensors"), monitor="val_accuracy",
                              save_best_only=True)
    history = trainer.fit(
        loader(train), epochs=4, validation_data=loader(test, 64, False), verbose=0,
        callbacks=[rp.callbacks.LearningRateScheduler(lambda epoch, lr: 0.01 * 0.5 ** epoch),
                   RecordLR(), ckpt, rp.callbacks.CSVLogger(str(tmp_path / "log.csv")),
                   rp.EarlyStopping(monitor="loss", patience=10)])
    assert lrs == pytest.approx([0.01, 0.005, 0.0025, 0.00125])
    assert history.epoch == [0, 1, 2, 3] and len(history.history["val_loss"]) == 4
    assert history.history["lr"] == pytest.approx(lrs)
    weights = load_file(str(tmp_path / "best.safetensors"))
    assert set(weights) == set(trainer.model.state_dict())
    rows = list(csv.DictReader(open(tmp_path / "log.csv")))
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2, 3]
    assert float(rows[-1]["loss"]) == pytest.approx(history.history["loss"][-1])


def test_early_stopping_stops_and_restores_best_weights():
    trainer = make_trainer(rp.OneDeviceStrategy("cpu"))
    train, _ = digits(128)
    seen = []

    class WorseEachEpoch(rp.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["fake"] = float(epoch)  # increases: never improves for mode=min
            seen.append(epoch)

    stop = rp.EarlyStopping(monitor="fake", mode="min", patience=1)
    trainer.fit(loader(train), epochs=10, callbacks=[WorseEachEpoch(), stop], verbose=0)
    assert seen == [0, 1, 2] and stop.stopped_epoch == 2


def test_terminate_on_nan_stops_training():
    x = torch.randn(64, 4)
    y = torch.full((64, 1), float("nan"))
    trainer = rp.Trainer(rp.OneDeviceStrategy("cpu"), lambda: nn.Linear(4, 1),
                         lambda p: torch.optim.SGD(p, lr=0.1), nn.MSELoss())
    trainer.fit(DataLoader(TensorDataset(x, y), batch_size=8), epochs=3,
                callbacks=[rp.callbacks.TerminateOnNaN()], verbose=0)
    assert trainer.global_step == 1 and math.isnan(trainer.history.history["loss"][0])


def test_progress_prints_plain_lines_when_not_a_terminal(capsys):
    train, _ = digits(128)
    make_trainer(rp.OneDeviceStrategy("cpu")).fit(loader(train), epochs=2)
    out = capsys.readouterr().out
    assert "epoch 1/2  step 4/4  loss" in out and "accuracy" in out and "samples/s" in out


def test_fit_ends_with_a_summary_line_unless_silent(capsys):
    train, test = digits(128)
    trainer = make_trainer(rp.OneDeviceStrategy("cpu"))
    trainer.fit(loader(train), epochs=2, validation_data=loader(test, 64, False))
    last = capsys.readouterr().out.strip().splitlines()[-1]
    match = re.fullmatch(r"fit: 2 epochs in ([\d.]+) s, ([\d,]+) samples/s on 1 replica; "
                         r"loss ([\d.e-]+), accuracy ([\d.e-]+), val_loss [\d.e-]+, "
                         r"val_accuracy ([\d.e-]+)", last)
    assert match, last
    seconds, rate = float(match[1]), float(match[2].replace(",", ""))
    # 2 epochs of 128 samples; the time is printed to 0.1 s
    assert 256 / (seconds + 0.05) * 0.98 <= rate <= 256 / max(seconds - 0.05, 1e-3) * 1.02
    assert float(match[3]) == pytest.approx(trainer.history.history["loss"][-1], rel=1e-3)
    make_trainer(rp.OneDeviceStrategy("cpu")).fit(loader(train), epochs=1, verbose=0)
    assert capsys.readouterr().out == ""


class _Crash(Exception):
    pass


class CrashAt(rp.Callback):
    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if self.trainer.global_step == self.step:
            raise _Crash(f"crash at step {self.step}")


def _resumable_fit(out, crash_at: int | None) -> tuple[dict, rp.EarlyStopping]:
    train, test = digits(96)
    trainer = make_trainer(rp.OneDeviceStrategy("cpu"))
    early = rp.EarlyStopping(monitor="val_loss", patience=1)
    callbacks = [CrashAt(crash_at), rp.callbacks.CSVLogger(str(out / "log.csv")),
                 # relative: not applied twice
                 rp.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.7),
                 early,
                 rp.ModelCheckpoint(str(out / "best.safetensors"), save_best_only=True),
                 rp.BackupAndRestore(str(out / "backup"), save_freq=2)]
    history = trainer.fit(loader(train), epochs=5, validation_data=loader(test, 64, False),
                          callbacks=callbacks, verbose=0)
    return history.history, early


def test_callback_states_survive_a_restart(tmp_path):
    """One process: a fit that crashes mid-epoch and is rerun equals an uninterrupted one."""
    ref, ref_early = _resumable_fit(tmp_path / "ref", None)
    # 3 steps per epoch: the last backup is at step 8, mid-epoch 2; the epoch-2 row is
    # written at step 9; the crash comes at step 10. The restart resumes mid-epoch 2 (its
    # learning rate must not be applied twice) and must cut the epoch-2 row off
    with pytest.raises(_Crash):
        _resumable_fit(tmp_path / "run", 10)
    rows = (tmp_path / "run" / "log.csv").read_bytes().count(b"\n")
    assert rows == 4  # header, epochs 0, 1 and 2
    out, early = _resumable_fit(tmp_path / "run", None)
    assert out == ref
    assert (early.best, early.wait, early.stopped_epoch) == (
        ref_early.best, ref_early.wait, ref_early.stopped_epoch)
    for name in ("log.csv", "best.safetensors"):
        assert (tmp_path / "run" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()


def test_a_crashed_fit_lets_its_save_in_flight_commit_before_raising(tmp_path):
    """The step-8 save is still being written when step 10 crashes: fit's error leaves only
    after that save committed, so a rerun in the same process neither races it nor misses it."""
    from replicator import fault_points

    def slow_step_8(step, **_):
        if step == 8:
            time.sleep(1.0)

    remove = fault_points.add_hook("before_commit", slow_step_8)
    try:
        with pytest.raises(_Crash):
            _resumable_fit(tmp_path / "run", 10)
    finally:
        remove()
    from replicator.checkpoint import CheckpointManager
    backup = tmp_path / "run" / "backup"
    assert CheckpointManager(backup).committed_steps()[-1] == 8
    assert not [p.name for p in backup.iterdir() if p.name.startswith(".tmp-")]


def test_callback_state_is_plain_data_and_round_trips(tmp_path):
    early = rp.EarlyStopping(restore_best_weights=True)
    early.best, early.wait = 0.25, 2
    early._best_weights = {"w": torch.ones(2)}
    again = rp.EarlyStopping(restore_best_weights=True)
    again.load_state_dict(early.state_dict())
    assert (again.best, again.wait) == (0.25, 2) and torch.equal(again._best_weights["w"],
                                                                 torch.ones(2))
    ckpt = rp.ModelCheckpoint(str(tmp_path / "m.safetensors"), save_best_only=True)
    ckpt.best, ckpt.saved = 0.5, ["a"]
    json_safe = json.loads(json.dumps(ckpt.state_dict()))
    other = rp.ModelCheckpoint(str(tmp_path / "m.safetensors"), save_best_only=True)
    other.load_state_dict(json_safe)
    assert (other.best, other.saved) == (0.5, ["a"])
    assert rp.callbacks.TerminateOnNaN().state_dict() == {}


def test_bad_trainer_input_is_a_clear_error():
    with pytest.raises(TypeError, match="needs a replicator Strategy"):
        rp.Trainer("mirrored", nn.Linear(2, 2), None, nn.MSELoss())
    with pytest.raises(TypeError, match="a batch must be"):
        make_trainer(rp.OneDeviceStrategy("cpu")).fit(
            DataLoader(TensorDataset(torch.randn(8, 64)), batch_size=4), epochs=1, verbose=0)
