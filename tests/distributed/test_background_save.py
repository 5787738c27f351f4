"""Background checkpoint saves: the state of the step boundary, written while training goes on.

Real worker processes and real gloo: a background save holds exactly what a foreground save of
the same step holds; a rank killed with SIGKILL while its background save is being written
leaves the previous backup as the one that loads; a failed background save is raised at the
next save on every rank.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import replicator as rp
from replicator import fault_points
from replicator.errors import CheckpointWriteError
from replicator.resume import BackupAndRestore
from replicator.testing import run_distributed
from tests.helpers import make_mlp, regression_data

SAVE_FREQ = 5
#: The step the main loop has reached, read by fault hooks running on the save's thread.
PROGRESS = {"step": 0}


def _attempt() -> int:
    return int(os.environ.get("REPLICATOR_RESTART_COUNT",
                              os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


def _train(backup_dir: str, steps: int, background: bool = True) -> BackupAndRestore:
    strategy = rp.MirroredStrategy()
    data = strategy.distribute_dataset(regression_data(), batch_size=16, shuffle=True, seed=3)
    with strategy.scope():
        model = make_mlp()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    backup = BackupAndRestore(backup_dir, save_freq=SAVE_FREQ, delete_checkpoint=False, keep=9,
                              background=background)
    backup.track(model=model, optimizer=optimizer)
    for step, (x, y) in backup.steps(data, num_steps=steps):
        PROGRESS["step"] = step
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return backup


def _same_as_foreground(root: str) -> dict:
    _train(os.path.join(root, "bg"), 12, background=True)
    _train(os.path.join(root, "fg"), 12, background=False)
    return {}


@pytest.mark.timeout(150)
def test_background_save_holds_the_state_of_its_step(tmp_path):
    run_distributed(_same_as_foreground, world_size=2, args=(str(tmp_path),),
                    timeout_seconds=60)
    for step in ("step-00000005", "step-00000010", "step-00000012"):
        for name in ("model", "optimizer", "rank-00000", "rank-00001"):
            bg = load_file(str(tmp_path / "bg" / step / f"{name}.safetensors"))
            fg = load_file(str(tmp_path / "fg" / step / f"{name}.safetensors"))
            assert bg.keys() == fg.keys()
            for key in bg:
                assert torch.equal(bg[key], fg[key]), f"{step}/{name}: {key} differs"
        assert (tmp_path / "bg" / step / "COMMIT.json").exists()


def _killed_mid_write(backup_dir: str, out_dir: str) -> int:
    rank = int(os.environ.get("RANK", "0"))
    if _attempt() == 0 and rank == 0:
        def die(step: int, path: Path, rank: int) -> None:
            if step != 2 * SAVE_FREQ:
                return
            deadline = time.monotonic() + 20
            while PROGRESS["step"] <= step + 1 and time.monotonic() < deadline:
                time.sleep(0.005)  # the training loop runs on while this save is written
            Path(out_dir, "killed.json").write_text(json.dumps(
                {"saving": step, "training_at": PROGRESS["step"],
                 "files": sorted(p.name for p in path.iterdir())}))
            os.kill(os.getpid(), signal.SIGKILL)

        fault_points.add_hook("before_commit", die)
    backup = _train(backup_dir, 4 * SAVE_FREQ)
    restored = backup.restored
    return -1 if restored is None else restored.step


@pytest.mark.timeout(150)
def test_sigkill_during_a_background_write_loads_the_previous_backup(tmp_path, capfd):
    backup = tmp_path / "backup"
    results = run_distributed(_killed_mid_write, world_size=2,
                              args=(str(backup), str(tmp_path)), timeout_seconds=60,
                              max_restarts=1)
    killed = json.loads((tmp_path / "killed.json").read_text())
    assert killed["saving"] == 2 * SAVE_FREQ
    assert killed["training_at"] > 2 * SAVE_FREQ + 1  # the next steps ran during the write
    assert "model.safetensors" in killed["files"] and "COMMIT.json" not in killed["files"]
    assert results == [SAVE_FREQ, SAVE_FREQ]  # the restart resumed from the previous backup
    err = capfd.readouterr().err
    assert "skipping checkpoint step-00000010" in err
    assert (backup / "step-00000020" / "COMMIT.json").exists()


def _fails_then_reports(backup_dir: str) -> dict:
    rank = int(os.environ.get("RANK", "0"))

    def fail(step: int, path: Path, rank: int) -> None:
        if step == SAVE_FREQ and rank == 1:
            raise OSError(28, "No space left on device (injected)")

    fault_points.add_hook("before_write", fail)
    try:
        _train(backup_dir, 3 * SAVE_FREQ)
    except CheckpointWriteError as exc:
        return {"rank": rank, "at": PROGRESS["step"], "error": str(exc)}
    return {"rank": rank, "at": None, "error": ""}


@pytest.mark.timeout(150)
def test_a_failed_background_save_is_raised_at_the_next_save_on_every_rank(tmp_path):
    results = run_distributed(_fails_then_reports, world_size=2,
                              args=(str(tmp_path / "backup"),), timeout_seconds=60)
    for r in results:
        assert r["at"] == 2 * SAVE_FREQ, r
        assert "step 5" in r["error"] and "rank 1" in r["error"], r["error"]
    assert not (tmp_path / "backup" / "step-00000005").exists()
