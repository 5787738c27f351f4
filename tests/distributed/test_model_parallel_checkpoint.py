"""Sharded checkpoints (torch.distributed.checkpoint, safetensors, atomic commit): saved under
data x pipeline on 4 processes, loaded into one device and into FSDP on 4."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import replicator as rp
from replicator.errors import CheckpointCorruptError
from replicator.resume import load_sharded, save_sharded
from replicator.testing import run_distributed
from tests.distributed.model_parallel_models import loss_of, make_transformer, token_data

PROBE = torch.arange(4 * 8).reshape(4, 8) % 32


def _strategy(layout: str) -> rp.Strategy:
    if layout == "data_pipeline":
        return rp.MeshStrategy(data=2, pipeline=2)
    if layout == "fsdp":
        return rp.FSDPStrategy()
    return rp.OneDeviceStrategy("cpu")


def _steps(strategy, model, optimizer, n: int, seed: int) -> None:
    def step(b):
        x, y = b
        loss_of(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    it = iter(strategy.distribute_dataset(DataLoader(token_data(), batch_size=16,
                                                     shuffle=True), seed=seed))
    for _ in range(n):
        strategy.run(step, args=(next(it),))


def _session(layout: str, directory: str, save: bool) -> dict:
    strategy = _strategy(layout)
    with strategy.scope():
        model = make_transformer(seed=2 if save else 7)  # loading must overwrite the init
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    if save:
        _steps(strategy, model, optimizer, 3, seed=1)
        save_sharded(directory, 3, model, optimizer)
        step = 3
    else:
        step = load_sharded(directory, model, optimizer)
    with torch.no_grad():
        before = model(PROBE).clone()
    _steps(strategy, model, optimizer, 2, seed=2)  # the optimizer state came back too
    with torch.no_grad():
        after = model(PROBE).clone()
    return {"step": step, "before": before, "after": after}


@pytest.mark.timeout(300)
def test_save_under_data_x_pipeline_load_into_one_device_and_fsdp(tmp_path):
    directory = str(tmp_path / "ckpt")
    saved = run_distributed(_session, 4, args=("data_pipeline", directory, True),
                            timeout_seconds=150)
    files = sorted(p.name for p in (Path(directory) / "step-00000003").iterdir())
    assert "COMMIT.json" in files and all(f.endswith((".safetensors", ".json")) for f in files)
    manifest = json.loads((Path(directory) / "step-00000003" / "COMMIT.json").read_text())
    assert len([f for f in manifest["files"] if f.endswith(".safetensors")]) >= 2  # sharded
    one = run_distributed(_session, 1, args=("one_device", directory, False),
                          timeout_seconds=60)[0]
    fsdp = run_distributed(_session, 4, args=("fsdp", directory, False), timeout_seconds=150)
    assert one["step"] == 3 and fsdp[0]["step"] == 3
    for result in (one, fsdp[0], fsdp[3]):
        assert torch.allclose(result["before"], saved[0]["before"], atol=1e-6)
        assert torch.allclose(result["after"], saved[0]["after"], atol=1e-5)


def _load_damaged(directory: str) -> str:
    model = make_transformer()
    try:
        load_sharded(directory, model)
    except CheckpointCorruptError as exc:
        return str(exc)
    return ""


@pytest.mark.timeout(120)
def test_a_damaged_shard_is_refused(tmp_path):
    directory = str(tmp_path / "ckpt")
    run_distributed(_session, 1, args=("one_device", directory, True), timeout_seconds=60)
    step_dir = Path(directory) / "step-00000003"
    shard = next(p for p in step_dir.iterdir() if p.suffix == ".safetensors")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    message = run_distributed(_load_damaged, 1, args=(directory,), timeout_seconds=60)[0]
    assert "SHA-256" in message and "no valid sharded checkpoint" in message


def _fit_fsdp(backup_dir: str | None, epochs: int) -> dict:
    """Trainer.fit under FSDP(2), with a kept backup in ``backup_dir`` (None: no backup)."""
    import torch.nn as nn

    from replicator.resume import BackupAndRestore
    from tests.train_helpers import digits, loader, model_fn

    strategy = rp.FSDPStrategy()
    train, _ = digits(4 * 32)
    trainer = rp.Trainer(strategy, model_fn, lambda p: torch.optim.Adam(p, lr=0.01),
                         nn.CrossEntropyLoss(), metrics=["accuracy"])
    callbacks = ([BackupAndRestore(backup_dir, save_freq=3, delete_checkpoint=False)]
                 if backup_dir is not None else [])
    history = trainer.fit(loader(train), epochs=epochs, callbacks=callbacks, verbose=0)
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in trainer.model.state_dict().items()}
    return {"state": state, "loss": history.history["loss"], "steps": trainer.global_step}


@pytest.mark.timeout(300)
def test_trainer_backup_under_fsdp_resumes_in_a_second_launch(tmp_path):
    """A Trainer run under FSDP stopped after 2 of 4 epochs and launched again finishes with
    the parameters and losses of a run that was never stopped (sharded backups, restored)."""
    backup = str(tmp_path / "backup")
    whole = run_distributed(_fit_fsdp, 2, args=(None, 4), timeout_seconds=150)
    first = run_distributed(_fit_fsdp, 2, args=(backup, 2), timeout_seconds=150)
    assert (tmp_path / "backup" / "sharded").is_dir() and first[0]["steps"] == 8
    second = run_distributed(_fit_fsdp, 2, args=(backup, 4), timeout_seconds=150)
    assert second[0]["steps"] == 16
    assert second[0]["loss"] == pytest.approx(whole[0]["loss"], abs=1e-6)
    for rank in (0, 1):
        for key, value in whole[rank]["state"].items():
            assert torch.equal(second[rank]["state"][key], value), key
