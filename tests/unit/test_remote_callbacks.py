"""The Trainer's file-writing callbacks at fsspec URLs, against a real S3 server (moto):
ModelCheckpoint's weights, CSVLogger's rows, TensorBoard's event files and BackupAndRestore's
backups all land in the bucket; an unknown scheme is refused when the callback is made."""

from __future__ import annotations

import csv
import io

import pytest
import torch
from safetensors.torch import load

import replicator as rp
from replicator.checkpoint import CheckpointManager
from replicator.checkpoint.store import RemoteStore, read_url
from replicator.errors import StorageURLError
from tests.s3_server import s3_server  # noqa: F401 - a fixture
from tests.train_helpers import digits, loader, make_trainer


@pytest.mark.parametrize("make", [lambda: rp.callbacks.CSVLogger("foo://b/log.csv"),
                                  lambda: rp.ModelCheckpoint("foo://b/w.safetensors"),
                                  lambda: rp.callbacks.TensorBoard("foo://b/tb")])
def test_callbacks_refuse_an_unknown_scheme(make, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StorageURLError, match="unknown URL scheme 'foo'"):
        make()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(240)
def test_fit_writes_weights_csv_events_and_backups_to_s3(s3_server):  # noqa: F811
    s3_server.make_bucket("fit")
    train, test = digits(160)
    trainer = make_trainer(rp.OneDeviceStrategy("cpu"))
    history = trainer.fit(
        loader(train), epochs=3, validation_data=loader(test, 64, False), verbose=0,
        callbacks=[rp.ModelCheckpoint("s3://fit/weights-{epoch}.safetensors"),
                   rp.callbacks.CSVLogger("s3://fit/log.csv"),
                   rp.callbacks.TensorBoard("s3://fit/tb"),
                   rp.BackupAndRestore("s3://fit/backup", save_freq=2,
                                       delete_checkpoint=False)])
    weights = load(read_url("s3://fit/weights-3.safetensors"))
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(weights[key], value), key
    rows = list(csv.DictReader(io.StringIO(read_url("s3://fit/log.csv").decode())))
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2]
    assert float(rows[-1]["loss"]) == pytest.approx(history.history["loss"][-1])
    events = RemoteStore("s3://fit/tb").objects("")
    assert any(name.startswith("events.out.tfevents") and size > 0 for name, size in events)
    steps = CheckpointManager("s3://fit/backup").committed_steps()
    assert steps and steps[-1] == 15  # 5 batches x 3 epochs, the final backup
