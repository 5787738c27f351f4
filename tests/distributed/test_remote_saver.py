"""The saver process, with real worker processes and gloo: its backups hold exactly what a
foreground save of the same step holds (also when the copy of the optimizers' state is left
to the saver's thread), and a save that falls due while the previous one is still being
written is skipped on every rank, counted and logged, never queued."""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import replicator as rp
from replicator import fault_points
from replicator.checkpoint import CheckpointManager, serialization
from replicator.resume import BackupAndRestore
from replicator.testing import run_distributed
from tests.helpers import make_mlp, regression_data
from tests.s3_server import s3_server  # noqa: F401 - a fixture

#: The step the main loop has reached, read by a fault hook on the save's thread.
PROGRESS = {"step": 0}


def _train(backup_dir: str, steps: int, save_freq: int, **options) -> dict:
    strategy = rp.MirroredStrategy()
    data = strategy.distribute_dataset(regression_data(), batch_size=16, shuffle=True, seed=3)
    with strategy.scope():
        model = make_mlp()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    backup = BackupAndRestore(backup_dir, save_freq=save_freq, delete_checkpoint=False, keep=9,
                              **options)
    backup.track(model=model, optimizer=optimizer)
    saver = None
    for step, (x, y) in backup.steps(data, num_steps=steps):
        PROGRESS["step"] = step
        saver = backup._saver or saver
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"skipped": getattr(saver, "skipped", None),
            "kind": getattr(saver, "async_mode", None)}


def _same_as_foreground(root: str) -> list:
    bg = _train(os.path.join(root, "process"), 12, 5, saver="process")
    _train(os.path.join(root, "fg"), 12, 5, background=False)
    return [bg]


@pytest.mark.timeout(200)
def test_the_saver_process_writes_what_a_foreground_save_writes(tmp_path):
    results = run_distributed(_same_as_foreground, world_size=2, args=(str(tmp_path),),
                              timeout_seconds=60)
    assert [r[0]["kind"] for r in results] == ["process", "process"]
    steps = CheckpointManager(tmp_path / "process").committed_steps()
    # step 10 is skipped when the save of step 5 is still being written then (a busy machine)
    assert steps in ([5, 10, 12], [5, 12])
    assert (steps == [5, 12]) == (results[0][0]["skipped"] == 1)
    for step in (f"step-{s:08d}" for s in steps):
        for name in ("model", "optimizer", "rank-00000", "rank-00001"):
            got = load_file(str(tmp_path / "process" / step / f"{name}.safetensors"))
            want = load_file(str(tmp_path / "fg" / step / f"{name}.safetensors"))
            assert got.keys() == want.keys()
            for key in got:
                assert torch.equal(got[key], want[key]), f"{step}/{name}: {key} differs"


def _slow_first_save(backup_dir: str) -> dict:
    def hold(step: int, path: object, rank: int) -> None:
        if step != 2:
            return
        deadline = time.monotonic() + 60
        while PROGRESS["step"] < 5 and time.monotonic() < deadline:
            time.sleep(0.01)  # the loop runs on past the next due save (step 4)

    fault_points.add_hook("before_write", hold)
    return _train(backup_dir, 8, 2, saver="process")


@pytest.mark.timeout(200)
def test_a_save_due_while_one_is_written_is_skipped_and_counted(tmp_path):
    results = run_distributed(_slow_first_save, world_size=2, args=(str(tmp_path / "b"),),
                              timeout_seconds=60)
    skipped = results[0]["skipped"]
    assert results[1]["skipped"] == skipped  # the ranks agree on every skip
    committed = CheckpointManager(tmp_path / "b").committed_steps()
    assert 4 not in committed and committed[0] == 2 and committed[-1] == 8  # 8: the final save
    # step 4 was skipped; 6 and 8 too if the save of step 2 was still being written then
    assert 1 <= skipped <= 3 and len({4, 6} - set(committed)) <= skipped


def _differences(got, want, where: str = "") -> list[str]:
    """Where two state trees differ (tensors bit for bit)."""
    if isinstance(want, torch.Tensor):
        same = isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
        return [] if same else [where]
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{where} (keys)"]
        return [d for k in want for d in _differences(got[k], want[k], f"{where}/{k}")]
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return [f"{where} (length)"]
        return [d for i, (g, w) in enumerate(zip(got, want))
                for d in _differences(g, w, f"{where}/{i}")]
    return [] if got == want else [where]


def _save_while_its_copy_is_held(backup_dir: str) -> dict:
    """A backup at step 3 whose deferred copy waits 0.5 s on the saver's thread while the loop
    runs on (forward passes change batch norm's statistics, optimizer steps the weights and
    Adam's moments): what it holds against the state snapshotted at step 3."""
    strategy = rp.MirroredStrategy()
    with strategy.scope():
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.BatchNorm1d(32),
                                    torch.nn.ReLU(), torch.nn.Linear(32, 3))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    held: list[int] = []

    def hold(step: int, path: object, rank: int) -> None:
        if step == 3:
            held.append(step)
            time.sleep(0.5)

    fault_points.add_hook("before_copy", hold)
    backup = BackupAndRestore(backup_dir, save_freq=3, delete_checkpoint=False, keep=9,
                              saver="process", strategy=strategy)
    backup.track(model=model, optimizer=optimizer)
    backup.on_train_begin()
    x, y = regression_data(64).tensors
    snapshot = None
    for batch in range(6):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        backup.on_train_batch_end(batch)
        if backup.step == 3:
            snapshot = copy.deepcopy({"model": model.state_dict(),
                                      "optimizer": optimizer.state_dict()})
    backup.on_train_end()
    if not strategy.is_chief:
        return {"held": held}
    step_dir = Path(backup_dir) / "step-00000003"
    saved = {name: serialization.decode((step_dir / f"{name}.safetensors").read_bytes())
             for name in ("model", "optimizer")}
    return {"held": held, "differences": _differences(saved, snapshot)}


@pytest.mark.timeout(200)
def test_a_deferred_copy_holds_the_values_of_its_step_bit_for_bit(tmp_path):
    results = run_distributed(_save_while_its_copy_is_held, world_size=2,
                              args=(str(tmp_path / "b"),), timeout_seconds=60)
    assert results[0]["held"] == [3]  # the chief's optimizer state was copied after the step
    assert results[0]["differences"] == []


def _fit_fsdp(backup_dir: str | None, epochs: int) -> dict:
    """Trainer.fit under FSDP(2) with sharded backups written in the background."""
    import torch.nn as nn

    from tests.train_helpers import digits, loader, model_fn

    strategy = rp.FSDPStrategy()
    train, _ = digits(4 * 32)
    trainer = rp.Trainer(strategy, model_fn, lambda p: torch.optim.Adam(p, lr=0.01),
                         nn.CrossEntropyLoss(), metrics=["accuracy"])
    callbacks = ([BackupAndRestore(backup_dir, save_freq=3, delete_checkpoint=False,
                                   saver="process")] if backup_dir is not None else [])
    history = trainer.fit(loader(train), epochs=epochs, callbacks=callbacks, verbose=0)
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in trainer.model.state_dict().items()}
    return {"state": state, "loss": history.history["loss"], "steps": trainer.global_step}


@pytest.mark.timeout(300)
def test_sharded_saves_in_the_background_resume_an_fsdp_run_exactly(tmp_path):
    backup = str(tmp_path / "backup")
    whole = run_distributed(_fit_fsdp, 2, args=(None, 4), timeout_seconds=150)
    first = run_distributed(_fit_fsdp, 2, args=(backup, 2), timeout_seconds=150)
    assert first[0]["steps"] == 8
    assert CheckpointManager(backup).committed_steps()[-1] == 8
    assert (tmp_path / "backup" / "sharded" / "step-00000006" / "COMMIT.json").exists() or \
        (tmp_path / "backup" / "sharded" / "step-00000003" / "COMMIT.json").exists()
    second = run_distributed(_fit_fsdp, 2, args=(backup, 4), timeout_seconds=150)
    assert second[0]["steps"] == 16
    assert second[0]["loss"] == pytest.approx(whole[0]["loss"], abs=1e-6)
    for rank in (0, 1):
        for key, value in whole[rank]["state"].items():
            assert torch.equal(second[rank]["state"][key], value), key


def _first_commit(url: str) -> dict:
    """100 steps of about 70 ms, a 1 MB state, a backup every 10 steps to the loopback S3
    server: at which step of the loop the chief saw the first backup's commit object."""
    import torch.nn as nn

    strategy = rp.MirroredStrategy()
    with strategy.scope():
        model = nn.Linear(512, 512)  # 1.05 MB of float32
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seen: dict[str, int] = {}
    fault_points.add_hook("after_commit", lambda step, path, rank: seen.setdefault(
        "at", PROGRESS["step"]))
    backup = BackupAndRestore(url, save_freq=10, delete_checkpoint=False, strategy=strategy)
    backup.track(model=model, optimizer=optimizer)
    started_early = backup._process is not None  # the saver process, before any save is due
    x = torch.randn(8, 512)
    saver = None
    for step, _ in backup.steps(range(100), num_steps=100):
        PROGRESS["step"] = step
        saver = backup._saver or saver
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(0.07)
    return {"at": seen.get("at"), "skipped": getattr(saver, "skipped", None),
            "started_early": started_early,
            "first_commit_s": (getattr(saver, "commit_seconds", None) or [None])[0]}


@pytest.mark.timeout(300)
def test_the_first_backup_to_a_store_commits_soon_after_its_step(s3_server, tmp_path):  # noqa: F811
    s3_server.make_bucket("first")
    results = run_distributed(_first_commit, world_size=2, args=("s3://first/run",),
                              timeout_seconds=200)
    chief = results[0]
    # the saver process started with the backup, so the save of step 10 does not wait for its
    # imports (how soon it commits is a speed, measured by benchmarks/checkpoint.py as
    # first_commit_s, not asserted here); later saves are not all skipped
    assert chief["started_early"], chief
    assert chief["at"] is not None, chief
    assert chief["skipped"] is not None and chief["skipped"] <= 8, chief
    committed = CheckpointManager("s3://first/run").committed_steps()
    assert len(committed) == 2 and committed[-1] == 100, committed  # keep=2; the end waits
